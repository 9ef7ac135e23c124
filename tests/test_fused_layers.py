"""The fused attention and MLP (tuning.fused_layers, stages/rl/fused_layers.py) compute what HF's do.

On the host the Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1, numpy underneath),
the same kernel code the GPU compiles; in float32 the only differences are the order of float32
operations. On a GPU (`pytest -m gpu`) they run compiled, in bf16, where they round once where HF
rounds after every operation: they agree within bf16's reach.
"""

import copy
from pathlib import Path

import pytest
import torch

from stages.rl import fused_layers, packing
from tests.devices import DEVICES
from tests.workers.step_gradients import train_rows

pytest.importorskip("triton")


def models(kind: str, device: str):
    """(HF's, fused) copies of a small model with grouped-query attention: Llama (no biases) or Qwen2
    (biases on q, k and v); float32 on the host, bf16 on a GPU."""
    plain, fused, _ = models_and_reference(kind, device)
    return plain, fused


def models_and_reference(kind: str, device: str):
    """models()'s pair and HF's model in float32 on the same device, the reference on a GPU."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from stages.rl.tiny_model import build_tokenizer, llama_config

    dims = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128)
    if kind == "llama":
        config = llama_config(dims)
    else:
        tok = build_tokenizer()
        config = Qwen2Config(vocab_size=len(tok), pad_token_id=tok.pad_token_id, **dims)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float32).to(device)
    with torch.no_grad():  # HF initialises biases to zero: make them count
        for name, p in reference.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    plain = copy.deepcopy(reference).to(torch.float32 if device == "cpu" else torch.bfloat16)
    fused = copy.deepcopy(plain)
    assert fused_layers.fuse_layers(fused) == 2 * config.num_hidden_layers  # an attention and an MLP each
    return plain, fused, reference


def logits_and_grads(model, **inputs):
    model.zero_grad()
    logits = model(**inputs).logits.float()
    (logits.logsumexp(-1) * torch.linspace(-1, 1, logits.shape[1], device=logits.device)).sum().backward()
    return logits.detach(), {n: p.grad.float() for n, p in model.named_parameters()}


def assert_close(got, want, exact, what):
    """Float32 on the host: equal up to the order of operations. bf16 on a GPU: the fused layers are
    no further from float32's result `exact` than HF's own bf16 layers are (or within 1% of it)."""
    if exact is None:
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (what, (got - want).abs().max())
    else:
        err, hf_err = (got - exact).norm(), (want - exact).norm()
        assert err <= 2 * hf_err + 0.01 * exact.norm() + 1e-6, (what, err / exact.norm(), hf_err / exact.norm())


def lay_out_flat(model) -> None:
    """`model`'s parameters moved into one buffer in the order they were registered, as DeepSpeed's
    ZeRO 1-2 lays them out (tests/workers/flat_layout.py checks DeepSpeed's own)."""
    params = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    offset = 0
    for p in params:
        p.data = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()


@pytest.mark.parametrize("kernels_on", DEVICES, indirect=True)
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("layout", ["own", "flat"])
def test_fused_layers_give_hfs_logits_and_gradients(kernels_on, kind, layout):
    device = kernels_on
    plain, fused, reference = models_and_reference(kind, device)
    if layout == "flat":
        lay_out_flat(fused)
    attn, mlp = fused.model.layers[0].self_attn, fused.model.layers[0].mlp
    # fuse_layers laid q, k, v (and gate, up) back to back, their values kept: the fused layers take
    # them as one view. In DeepSpeed's flat buffer Llama's stay so; Qwen2's biases sit between its
    # q, k and v weights there, so those are concatenated.
    viewed = layout == "own" or kind == "llama"
    assert fused_layers.adjacent([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]) == viewed
    assert fused_layers.adjacent([mlp.gate_proj.weight, mlp.up_proj.weight])
    if kind == "qwen2" and layout == "own":
        assert fused_layers.adjacent([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])
    models_ = (plain, fused) if device == "cpu" else (plain, fused, reference)

    def compare(keep=None, **inputs):
        want, want_grads = logits_and_grads(plain, **inputs)
        got, got_grads = logits_and_grads(fused, **inputs)
        exact, exact_grads = logits_and_grads(reference, **inputs) if device != "cpu" else (None, {})
        keep = keep if keep is not None else torch.ones(got.shape[:2], dtype=torch.bool, device=device)
        assert_close(got[keep], want[keep], None if exact is None else exact[keep], "logits")
        for name, g in want_grads.items():
            assert_close(got_grads[name], g, exact_grads.get(name), name)

    # A padded batch (SDPA with a mask), then the same rows packed (variable-length attention).
    ids = torch.randint(4, plain.config.vocab_size, (3, 24), device=device)
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0
    for model in models_:
        model.set_attn_implementation("sdpa")
    compare(mask.bool(), input_ids=ids, attention_mask=mask)
    for model in models_:
        packing.use_packed_attention(model)
    batch = packing.pack(train_rows(5, seed=3), device)
    compare(input_ids=batch["input_ids"], **packing.model_kwargs(batch))


def test_joined_weights_are_a_view_where_adjacent_and_split_the_gradient():
    flat = torch.arange(24.0, requires_grad=True)
    a, b = flat[:8].view(2, 4), flat[8:20].view(3, 4)
    both = fused_layers.joined([a, b])
    assert both.data_ptr() == a.data_ptr() and torch.equal(both, torch.cat([a, b]))  # no copy
    (both * torch.arange(20.0).view(5, 4)).sum().backward()
    assert torch.equal(flat.grad, torch.cat([torch.arange(20.0), torch.zeros(4)]))
    apart = fused_layers.joined([b, a])  # out of order: a copy, the same values
    assert apart.data_ptr() != b.data_ptr() and torch.equal(apart, torch.cat([b, a]))


def test_decoding_with_a_cache_runs_hfs_forward(kernels_on, monkeypatch):
    plain, fused = models("llama", "cpu")
    calls = []
    rotary = fused_layers.RotaryQKV.apply
    monkeypatch.setattr(fused_layers.RotaryQKV, "apply", lambda *a: calls.append(1) or rotary(*a))
    ids = torch.randint(4, plain.config.vocab_size, (2, 6))
    want = plain.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    got = fused.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)
    assert calls == []  # every forward of generate's had a cache: HF's own
    fused(input_ids=ids, use_cache=False)
    assert len(calls) == 2  # a whole-sequence pass: the fused one, in each layer


@pytest.mark.parametrize("kernels_on", DEVICES, indirect=True)
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_the_compact_sampler_runs_the_fused_layers_and_draws_the_policys_tokens(kernels_on, kind, monkeypatch):
    # The compact sampler's cache takes the fused attention's rotated K and V: its prefill and its decode
    # steps run the fused layers, and each drawn token's log-prob is HF's teacher-forced one.
    from stages.rl.decoding import CompactDecoder, SamplingParams, buffer_length
    from stages.rl.modeling import token_logprobs

    device = kernels_on
    plain, fused = models(kind, device)
    widths = []
    rotary = fused_layers.RotaryQKV.apply
    monkeypatch.setattr(fused_layers.RotaryQKV, "apply", lambda *a: widths.append(a[0].shape[1]) or rotary(*a))
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]
    params = SamplingParams(max_new_tokens=6, eos_token_id=3, pad_token_id=0)
    decoder = CompactDecoder(fused.eval(), rows=6, length=buffer_length(5, 6), cuda_graphs=device == "cuda")
    ids, lps = decoder.sample(prompts, 2, params, torch.Generator(device).manual_seed(0), record_logprobs=True)
    assert 1 in widths and 10 in widths, widths  # decode steps of one position, the prefill of the prompts packed
    diffs = []
    for j, (completion, lp) in enumerate(zip(ids, lps)):
        prompt = prompts[j // 2]
        x = torch.tensor([prompt + completion], device=device)
        with torch.no_grad():
            logits = plain.eval()(input_ids=x).logits
        diffs.append((token_logprobs(logits[:, len(prompt) - 1:-1], x[:, len(prompt):])[0].cpu() - torch.tensor(lp)).abs())
    diffs = torch.cat(diffs)
    if device == "cpu":  # float32: the same arithmetic up to its order
        assert diffs.max() < 1e-4, diffs.max()
    else:  # bf16, other kernels
        assert diffs.mean() < 0.02 and diffs.max() < 0.1, (diffs.mean(), diffs.max())


def test_a_head_size_that_is_not_a_power_of_two(kernels_on):
    # Heads of 24 (halves of 12: the kernel's block is 16, masked); odd sizes have no halves to rotate.
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    qkv = torch.randn(2, 5, (3 + 2 * 1) * 24, requires_grad=True)
    angles = torch.randn(2, 5, 12)
    cos, sin = angles.cos().repeat(1, 1, 2), angles.sin().repeat(1, 1, 2)
    q, k, v = fused_layers.RotaryQKV.apply(qkv, cos, sin, 3, 1, 24)
    hq, hk, hv = qkv.split([72, 24, 24], dim=-1)
    wq, wk = apply_rotary_pos_emb(hq.view(2, 5, 3, 24).transpose(1, 2), hk.view(2, 5, 1, 24).transpose(1, 2), cos, sin)
    assert torch.allclose(q, wq.transpose(1, 2), atol=1e-6) and torch.allclose(k, wk.transpose(1, 2), atol=1e-6)
    assert torch.equal(v, hv.view(2, 5, 1, 24))
    weights = [torch.randn_like(x) for x in (q, k, v)]
    got = torch.autograd.grad(sum((x * w).sum() for x, w in zip((q, k, v), weights)), qkv)[0]
    want = torch.autograd.grad(sum((x * w).sum() for x, w in zip((wq.transpose(1, 2), wk.transpose(1, 2),
                                                                   hv.view(2, 5, 1, 24)), weights)), qkv)[0]
    assert torch.allclose(got, want, atol=1e-5)
    with pytest.raises(ValueError, match="head size is 13: set tuning.fused_layers=false"):
        fused_layers.RotaryQKV.apply(torch.randn(1, 3, 3 * 13), sin[:1, :3, :13], sin[:1, :3, :13], 1, 1, 13)



@pytest.mark.slow
def test_deepspeed_keeps_the_joined_weights_back_to_back(tmp_path):
    # Real DeepSpeed, ZeRO-2 (gloo on the host, 2 ranks: each holds the whole model in one flat buffer
    # and a partition of the optimizer's copy; ZeRO-1 lays the model out with the same code).
    from stages.rl.tiny_model import create_base_model
    from tests.test_train_batching import run_workers

    model_dir = create_base_model(tmp_path / "base", "tiny-llama", seed=0)
    ds = Path(__file__).resolve().parents[1] / "configs" / "ds_zero2_cpu.json"
    got = run_workers("tests.workers.flat_layout", tmp_path, model_dir, 2,
                      [f"train.deepspeed_config={ds}", "tuning.remove_padding=true"], "layout")
    assert got["before"] == got["after"] == [(True, True)] * len(got["before"]) and got["before"]


def test_a_capture_calls_a_fused_layer_on_deepspeeds_layout(kernels_on, monkeypatch):
    # make_graphed_callables runs each layer through cuda_graphs._layer_call with aliases of its
    # parameters (stages/rl/cuda_graphs.py). With the weights laid out flat, as under ZeRO 1-2, the
    # fused layer takes the aliases' q/k/v and gate/up as views: HF's output and gradients.
    from stages.rl import cuda_graphs
    from tests.test_cuda_graphs import layer_io

    plain, fused = models("llama", "cpu")
    lay_out_flat(fused)
    for model in (plain, fused):
        packing.use_packed_attention(model)
    rows = train_rows(4, seed=1)
    shape = packing.fixed_shape([rows])
    batch = packing.pack(rows, torch.device("cpu"), shape)
    views, adjacent = [], fused_layers._Adjacent.apply
    monkeypatch.setattr(fused_layers._Adjacent, "apply", lambda *t: views.append(1) or adjacent(*t))
    blocks = cuda_graphs.decoder_layers(fused)
    for plain_block, block, (args, kwargs, output) in zip(cuda_graphs.decoder_layers(plain), blocks,
                                                          layer_io(plain, batch)):
        cos, sin = kwargs["position_embeddings"]
        names, params = zip(*block.named_parameters())
        aliases = [p.detach().requires_grad_() for p in params]
        call = cuda_graphs._layer_call(block, names, shape.max_length)
        got = call(args[0], cos, sin, kwargs["cu_seq_lens_q"], *aliases)
        assert torch.allclose(got, output, rtol=1e-4, atol=1e-5)
        got.square().sum().backward()
        plain_block(args[0], **kwargs).square().sum().backward()
        for name, p, a in zip(names, plain_block.parameters(), aliases):
            assert torch.allclose(a.grad, p.grad, rtol=1e-4, atol=1e-5), name
    assert len(views) == 2 * len(blocks)  # q/k/v and gate/up of each layer
