"""One training micro-step rehearsed on a one-layer model of the policy's architecture, before train's turn.

CUDA loads a kernel the first time a process launches it, so the first micro-batch of a fresh train
process runs several times longer than the others: nearly all of it in the first launch of each
kernel of the log-probs, the loss, their backward and the optimizer step (docs/benchmarks.md). The
Triton kernels of tuning.fused_layers are compiled or read from Triton's cache on first use too.

A train process started early runs the same path once on a model with one decoder layer and the
policy's widths, vocabulary and dtype (so the same kernel variants), on a packed or padded batch as
tuning.remove_padding says: forward, log-probs, PPO-clip loss, backward, then a flat gradient norm,
clipping and a fused AdamW step on float32 copies, as ZeRO's optimizer takes them. Nothing of it is
kept but the loaded kernels. The policy, the engine and the process group are untouched.

It runs while another stage (generate, or the previous train) holds the GPU, so it is bounded: it is
skipped where a one-layer model's states would need more than GPU_SHARE of the GPU's memory (a
layer of a 70B model with its fp32 master and Adam state is ~17 GB), and the allocator is capped at
that share while it runs (an allocation past it fails the rehearsal, not the stage that holds the
GPU). It is skipped too where it cannot pay: ZeRO-3 runs each layer through gathering hooks the
one-layer model has not, and an offloaded optimizer steps on the host, so neither's first step
launches the kernels the rehearsal would load.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time

import torch

from stages.runtime.config import optimizer_offloaded, zero_stage

log = logging.getLogger(__name__)

ROWS, PROMPT, COMPLETION = 8, 16, 112  # 1,024 positions: the shapes of a short micro-batch
# The most of the GPU's memory the rehearsal may take, beside the stage that holds the GPU.
GPU_SHARE = 0.05


def skip_reason(config, dtype: torch.dtype, ds_config: dict, gpu_bytes: int) -> str | None:
    """Why the rehearsal would not pay, or would not fit beside another stage (None: run it)."""
    if zero_stage(ds_config) == 3:
        return "ZeRO-3 runs each layer through its gathering hooks, which a one-layer model has not"
    if optimizer_offloaded(ds_config):
        return "the optimizer is offloaded (its step runs on the host)"
    return over_share(memory_bytes(config, dtype), gpu_bytes)


def over_share(need: int, gpu_bytes: int) -> str | None:
    """Why a rehearsal needing `need` bytes would not fit beside the stage that holds the GPU (None: it fits)."""
    if need > GPU_SHARE * gpu_bytes:
        return (f"a one-layer model of this architecture needs ~{need / 1e9:.1f} GB, over {GPU_SHARE:.0%} of the "
                f"GPU's {gpu_bytes / 1e9:.0f} GB")
    return None


def one_layer_parameters(config) -> int:
    """The parameters of a one-layer model of `config`'s architecture (embeddings included)."""
    d, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    heads = config.num_attention_heads
    kv = d * getattr(config, "num_key_value_heads", heads) // heads
    return 2 * d * d + 2 * d * kv + 3 * d * inter + vocab * d * (1 if config.tie_word_embeddings else 2)


def memory_bytes(config, dtype: torch.dtype) -> int:
    """An estimate of the rehearsal's peak memory: the one-layer model's weights and gradients in
    `dtype`, their fp32 copies, gradients and AdamW moments, and the activations of its batch (the
    layer's and the float32 logits)."""
    d, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    size = torch.finfo(dtype).bits // 8
    positions = ROWS * (PROMPT + COMPLETION)
    activations = positions * ((8 * d + 4 * inter) * size + 3 * vocab * 4)
    return one_layer_parameters(config) * (2 * size + 16) + activations


def rehearse(config, dtype: torch.dtype, tuning, train_cfg, temperature: float, device) -> float:
    """Run the rehearsal on `device` for a policy of HF `config`; returns its seconds. The process's
    random number generators are left as they were (the model's initialisation draws from them)."""
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), memory_cap(device):
        return _rehearse(config, dtype, tuning, train_cfg, temperature, device)


@contextlib.contextmanager
def memory_cap(device: torch.device):
    """This process's CUDA allocator held to GPU_SHARE of the device while the rehearsal runs; its
    memory is handed back and the cap lifted after (the process then trains with the whole GPU)."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.set_per_process_memory_fraction(GPU_SHARE, device)
    try:
        yield
    finally:
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(1.0, device)


def _rehearse(config, dtype, tuning, train_cfg, temperature, device) -> float:
    from stages.rl import grad_norm, packing
    from stages.rl.batches import collate, sequence_logprobs
    from stages.rl.loss import ppo_clip_loss

    t0 = time.time()
    model = one_layer_model(config, dtype, tuning, device)
    if tuning.remove_padding:
        packing.use_packed_attention(model)
    model.train()
    rows = synthetic_rows(config.vocab_size)
    batch = packing.pack(rows, device) if tuning.remove_padding else collate(rows, device)
    logp = sequence_logprobs(model, batch, temperature)
    ref_logp = logp.detach() if train_cfg.kl_coef > 0 else None
    loss, _ = ppo_clip_loss(logp, batch["old_logp"], batch["advantages"], batch["mask"], train_cfg.clip_eps,
                            ref_logp, train_cfg.kl_coef)
    loss.backward()
    masters = [p.detach().float().requires_grad_() for p in model.parameters()]
    for m, p in zip(masters, model.parameters()):
        m.grad = p.grad.float()
    # One process of its own: no process group yet, so clip_ reduces nothing.
    grad_norm.clip_([m.grad for m in masters], train_cfg.max_grad_norm)
    fused = {"fused": True} if device.type == "cuda" else {}
    torch.optim.AdamW(masters, lr=1e-6, **fused).step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.time() - t0


def one_layer_model(config, dtype: torch.dtype, tuning, device):
    """A one-layer model of `config`'s architecture on `device`, its kernels as tuning has the policy's
    (seeded: the same weights every time)."""
    from transformers import AutoModelForCausalLM

    from stages.rl.modeling import fuse_rms_norms

    torch.manual_seed(0)
    # Built on the device: initialising the weights on the host and copying them over is a good part
    # of a rehearsal that must be done before the turn.
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(one_layer(config), dtype=dtype)
    if tuning.fused_rms_norm:
        fuse_rms_norms(model)
    if tuning.fused_layers:
        from stages.rl.fused_layers import fuse_layers

        fuse_layers(model)
    return model


# The sampling rehearsal: calls of two prompts each sampled ATTEMPTS times for NEW_TOKENS tokens,
# one with short prompts and one with prompts long enough for the decode kernel to read each prompt
# once for its attempts (decoding.SHARE_PROMPTS_FROM): each loads its own kernel variants.
ATTEMPTS, NEW_TOKENS = 4, 8


def sample_widths() -> list[tuple[int, int]]:
    from stages.rl import decoding

    return [(16, 11), (decoding.SHARE_PROMPTS_FROM, decoding.SHARE_PROMPTS_FROM - 5)]


def sampling_skip_reason(config, dtype: torch.dtype, gpu_bytes: int) -> str | None:
    """Why the sampling rehearsal would not fit beside the stage that holds the GPU (None: run it)."""
    rows = 2 * ATTEMPTS
    # The weights, and per row its float32 logits and their sorted copy (top-p), with room to spare.
    need = one_layer_parameters(config) * (torch.finfo(dtype).bits // 8) + 4 * rows * config.vocab_size * 4
    return over_share(need, gpu_bytes)


def rehearse_sampling(config, dtype: torch.dtype, tuning, generate_cfg, device) -> float:
    """Two calls of the compact sampler (prefill, decode steps, their CUDA graphs where tuning has them)
    on a one-layer model of the policy's architecture on `device`, as a generate process started early
    runs it before its turn; returns its seconds. Nothing is kept but what the process loaded: the
    first call of a fresh process otherwise loads its kernels and libraries on the critical path. The
    random number generators are left as they were."""
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), memory_cap(device):
        return _rehearse_sampling(config, dtype, tuning, generate_cfg, device)


@torch.no_grad()
def _rehearse_sampling(config, dtype, tuning, g, device) -> float:
    from stages.rl import decoding

    t0 = time.time()
    model = one_layer_model(config, dtype, tuning, device).eval()
    g_ids = torch.Generator().manual_seed(0)
    for widths in sample_widths():
        prompts = [torch.randint(0, config.vocab_size, (w,), generator=g_ids).tolist() for w in widths]
        sampler = decoding.CompactDecoder(model, len(prompts) * ATTEMPTS,
                                          decoding.buffer_length(max(widths), NEW_TOKENS),
                                          cuda_graphs=tuning.decode_graphs, decode_kernel=tuning.decode_kernel)
        params = decoding.SamplingParams(max_new_tokens=NEW_TOKENS, temperature=g.temperature, top_p=g.top_p,
                                         eos_token_id=-1, pad_token_id=0)
        sampler.sample(prompts, ATTEMPTS, params, torch.Generator(device).manual_seed(0),
                       record_logprobs=tuning.logprobs_from_sampler(g))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.time() - t0


def before_turn(what: str, on: str, first: str, skip: str | None, run) -> None:
    """A rehearsal of `what` (`run`, returning its seconds) before the stage's turn, unless `skip` says
    why not. It only saves time: a failure is logged, and `first` (the first real call) loads the
    kernels itself."""
    if skip:
        log.info("no rehearsal of %s before the turn: %s", what, skip)
        return
    try:
        seconds = run()
    except Exception as e:  # noqa: BLE001 (any failure here only costs the first real call its loads)
        log.warning("rehearsing %s before the turn failed (%s: %s); %s loads its kernels itself", what,
                    type(e).__name__, e, first)
        return
    log.info("rehearsed %s %s a one-layer model before the turn in %.1fs: its kernels are loaded", what, on, seconds)


def one_layer(config):
    """A copy of `config` with one decoder layer (and per-layer lists cut to match)."""
    small = copy.deepcopy(config)
    small.num_hidden_layers = 1
    for key in ("layer_types",):  # Qwen2/Mistral-style per-layer attention kinds
        if isinstance(getattr(small, key, None), list):
            setattr(small, key, getattr(small, key)[:1])
    return small


def synthetic_rows(vocab: int) -> list[dict]:
    """ROWS rows of PROMPT + COMPLETION token ids in the vocabulary, with log-probs and advantages."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (ROWS, PROMPT + COMPLETION), generator=g).tolist()
    return [{"prompt_ids": r[:PROMPT], "completion_ids": r[PROMPT:], "logprobs": [-1.0] * COMPLETION,
             "advantage": 1.0 if i % 2 else -1.0} for i, r in enumerate(ids)]
