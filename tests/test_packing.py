"""tuning.remove_padding: a micro-batch's rows packed into one sequence (stages/rl/packing.py).

Packed rows must give what right-padded rows give: the same log-probs at every loss position, and
the same loss and gradient, in the model alone (a real transformers Llama built from a config, with
grouped-query attention) and in train's real DeepSpeed step (ZeRO-2, gloo on CPU; with token-budget
groups on 2 ranks too). On CPU the packed attention runs one causal SDPA call per row; the GPU test
(tests/test_gpu.py) runs torch's variable-length kernel.
"""

import pytest
import torch

from stages.rl import packing
from stages.rl.batches import collate, sequence_logprobs
from stages.rl.loss import ppo_clip_loss
from tests.test_train_batching import model_dir, step_gradients  # noqa: F401 (model_dir is a fixture)
from tests.workers.step_gradients import train_rows


def test_rows_are_laid_end_to_end_with_their_own_positions_and_loss_spans():
    rows = [{"prompt_ids": [5, 6], "completion_ids": [7, 8, 9], "logprobs": [-1.0, -2.0, -3.0], "advantage": 0.5},
            None,
            {"prompt_ids": [10], "completion_ids": [11], "logprobs": [-4.0], "advantage": -1.0}]
    b = packing.pack(rows, torch.device("cpu"))
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 11]]
    assert b["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1]]
    assert b["cu_seq_lens"].tolist() == [0, 5, 7] and b["max_length"] == 5
    # Shifted position j predicts token j + 1: 7, 8, 9 at 1..3, 11 at 5; position 4 (token 9) would
    # predict the next row's first token and is masked, as padding is.
    assert b["mask"].tolist() == [[0, 1, 1, 1, 0, 1]]
    assert b["old_logp"].tolist() == [[0, -1, -2, -3, 0, -4]]
    assert b["advantages"].tolist() == [[0, 0.5, 0.5, 0.5, 0, -1]]
    assert b["tokens"] == 4 and b["lengths"] == [5, 2]
    empty = packing.pack([None, None], torch.device("cpu"))
    assert empty["mask"].sum() == 0 and empty["tokens"] == 0 and empty["lengths"] == []


def test_a_fixed_shape_pads_with_masked_segments_of_at_least_one_token():
    rows = [{"prompt_ids": [5, 6], "completion_ids": [7, 8, 9], "logprobs": [-1.0, -2.0, -3.0], "advantage": 0.5},
            {"prompt_ids": [10], "completion_ids": [11], "logprobs": [-4.0], "advantage": -1.0}]
    # The fullest has 2 rows (3 segments), the most positions 7: 7 + 3, rounded up to 4; the longest
    # row 5, rounded up to 4: the attention's max_length.
    assert packing.fixed_shape([rows, rows[:1], [None]], multiple=4) == (12, 3, 8)
    b = packing.pack(rows, torch.device("cpu"), (10, 5))
    assert b["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10, 11, 0, 0, 0]]
    # Three padding segments: one token, one token, the rest (no zero-length sequence for the kernel).
    assert b["cu_seq_lens"].tolist() == [0, 5, 7, 8, 9, 10] and b["max_length"] == 10
    assert b["mask"].tolist() == [[0, 1, 1, 1, 0, 1, 0, 0, 0]]
    # The figures count the rows, not the padding.
    assert b["tokens"] == 4 and b["lengths"] == [5, 2]
    tight = packing.pack(rows, torch.device("cpu"), (8, 3))  # room for the one padding segment only
    assert tight["cu_seq_lens"].tolist() == [0, 5, 7, 8] and tight["input_ids"].shape == (1, 8)
    empty = packing.pack([None], torch.device("cpu"), (8, 3))
    assert empty["cu_seq_lens"].tolist() == [0, 2, 3, 8] and empty["mask"].sum() == 0 and empty["lengths"] == []
    with pytest.raises(ValueError, match="2 rows and 7 positions .* does not fit .* 2 rows and 7 positions"):
        packing.pack(rows, torch.device("cpu"), (7, 3))
    with pytest.raises(ValueError, match="does not fit .* 1 rows"):
        packing.pack(rows, torch.device("cpu"), (10, 2))


def test_padding_segments_are_no_longer_than_the_longest_row():
    # The attention kernel's grid is sized by max_length: the longest row, not the batch's positions;
    # a padding segment longer than it would be attended only in part.
    long = {"prompt_ids": [1] * 4, "completion_ids": [2] * 12, "logprobs": [-1.0] * 12, "advantage": 1.0}
    short = {"prompt_ids": [1], "completion_ids": [2], "logprobs": [-1.0], "advantage": 1.0}
    micro_batches = [[long, long], [short, None], [None, None]]
    shape = packing.fixed_shape(micro_batches, multiple=4)
    assert shape.max_length == 16 and shape.positions >= 32 + shape.segments
    for micro in micro_batches:
        b = packing.pack(micro, torch.device("cpu"), shape)
        cu = b["cu_seq_lens"].tolist()
        widths = [y - x for x, y in zip(cu, cu[1:])]
        assert len(widths) == shape.segments and cu[-1] == shape.positions and b["max_length"] == 16
        assert min(widths) >= 1 and max(widths) <= 16, widths
    # A short row's micro-batch needs more padding segments than the fullest's one: fixed_shape adds them.
    assert shape.segments > 3
    with pytest.raises(ValueError, match="none longer than 4"):
        packing.pack([short], torch.device("cpu"), (12, 2, 4))


@pytest.fixture(scope="module")
def gqa_model():
    from transformers import AutoModelForCausalLM

    from stages.rl.tiny_model import llama_config

    torch.manual_seed(0)
    dims = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128)
    return AutoModelForCausalLM.from_config(llama_config(dims), dtype=torch.float32)


def loss_and_grads(model, batch):
    model.zero_grad()
    logp = sequence_logprobs(model, batch, 1.0)
    loss, _ = ppo_clip_loss(logp, batch["old_logp"], batch["advantages"], batch["mask"], 0.2)
    loss.backward()
    return logp, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_packed_rows_give_the_padded_rows_log_probs_loss_and_gradient(gqa_model):
    rows = train_rows(9, seed=4)
    padded_logp, padded_loss, padded_grads = loss_and_grads(gqa_model, collate(rows, torch.device("cpu")))
    packing.use_packed_attention(gqa_model)
    packed = packing.pack(rows, torch.device("cpu"))
    packed_logp, packed_loss, packed_grads = loss_and_grads(gqa_model, packed)
    pad_mask = collate(rows, torch.device("cpu"))["mask"].bool()
    assert torch.allclose(packed_logp[packed["mask"].bool()], padded_logp[pad_mask], atol=1e-5)
    assert torch.allclose(packed_loss, padded_loss, atol=1e-6)
    for name, g in padded_grads.items():
        assert torch.allclose(packed_grads[name], g, rtol=1e-4, atol=1e-6), name
    # The packed attention keeps each row to itself: a row packed after another is unchanged.
    alone = packing.pack(rows[-1:], torch.device("cpu"))
    with torch.no_grad():
        last = sequence_logprobs(gqa_model, alone, 1.0)[alone["mask"].bool()]
    assert torch.allclose(packed_logp[packed["mask"].bool()][-len(last):], last, atol=1e-5)
    # A padded batch still runs through it (SDPA) as before.
    again, _, _ = loss_and_grads(gqa_model, collate(rows, torch.device("cpu")))
    assert torch.allclose(again[pad_mask], padded_logp[pad_mask], atol=1e-6)


@pytest.mark.slow
def test_rows_packed_to_a_fixed_shape_give_the_same_loss_and_gradient(gqa_model):
    # What tuning.train_graphs runs: the rows, then padding segments, one token each but the last.
    rows = train_rows(6, seed=5)
    want_logp, want_loss, want_grads = loss_and_grads(gqa_model, packing.pack(rows, torch.device("cpu")))
    batch = packing.pack(rows, torch.device("cpu"), (packing.fixed_shape([rows])[0] + 64, 10))
    logp, loss, grads = loss_and_grads(gqa_model, batch)
    n = want_logp.shape[1]
    assert torch.allclose(logp[:, :n], want_logp, atol=1e-6) and torch.allclose(loss, want_loss, atol=1e-7)
    for name, g in want_grads.items():
        assert torch.allclose(grads[name], g, rtol=1e-5, atol=1e-8), name


@pytest.mark.slow
def test_packed_step_gradient_equals_the_padded_one_in_deepspeed(tmp_path, model_dir):  # noqa: F811
    ds = ["train.deepspeed_config=configs/ds_zero2_cpu.json"]
    # The whole 12-row step in one padded micro-batch, against the same rows packed on 2 ranks and
    # grouped by a token budget (tests/test_train_batching.py checks the groupings of padded rows).
    padded = step_gradients(tmp_path, model_dir, 1, ds + ["train.micro_batch_size=12", "tuning.remove_padding=false"],
                            "padded")
    grouped = step_gradients(tmp_path, model_dir, 2, ds + ["train.micro_batch_size=6", "tuning.remove_padding=true",
                                                          "tuning.max_tokens_per_micro_batch=60"], "grouped")
    assert len(grouped["micro_batches"]) >= 2
    for name, g in padded["grads"].items():
        assert torch.allclose(grouped["grads"][name], g, rtol=1e-4, atol=1e-7), name


def test_compiled_layers_give_the_eager_loss_and_gradient():
    # train.compile on ZeRO 0-2 compiles each decoder layer in place (modeling.compile_layers);
    # "aot_eager" traces forward and backward as Inductor would, without building kernels on CPU.
    import copy

    from transformers import AutoModelForCausalLM

    from stages.rl.modeling import compile_layers
    from stages.rl.tiny_model import llama_config

    torch.manual_seed(1)
    dims = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128)
    eager = AutoModelForCausalLM.from_config(llama_config(dims), dtype=torch.float32)
    compiled = copy.deepcopy(eager)
    for m in (eager, compiled):
        packing.use_packed_attention(m)
    assert compile_layers(compiled, "aot_eager") == 3
    assert [n for n, _ in compiled.named_parameters()] == [n for n, _ in eager.named_parameters()]
    # Padded rows, then rows of other lengths (dynamic=True: the lengths are symbolic). Packed rows run the CPU's per-row attention, which breaks the graph at every row (seconds of
    # tracing per row count); their compiled path, the variable-length kernel, is tests/test_gpu.py's.
    for seed, n in ((2, 7), (3, 5)):
        batch = collate(train_rows(n, seed=seed), torch.device("cpu"))
        want_logp, want_loss, want_grads = loss_and_grads(eager, batch)
        logp, loss, grads = loss_and_grads(compiled, batch)
        assert torch.allclose(logp, want_logp, atol=1e-5) and torch.allclose(loss, want_loss, atol=1e-6)
        for name, g in want_grads.items():
            assert torch.allclose(grads[name], g, rtol=1e-4, atol=1e-6), name


def test_compile_layers_names_a_model_without_repeated_blocks():
    from stages.rl.modeling import compile_layers

    with pytest.raises(ValueError, match="train.compile=eager"):
        compile_layers(torch.nn.Linear(2, 2), "aot_eager")


def test_the_kernels_layout_and_its_gradient_are_views_of_the_fused_layers_tensors():
    # The fused layers' q is a contiguous [1, T, H, D], handed to attention transposed as [1, H, T, D].
    q = torch.randn(1, 7, 3, 4, requires_grad=True)
    x = q.transpose(1, 2)
    out = packing.token_major(x)
    assert out.shape == (7, 3, 4) and torch.equal(out, x[0].transpose(0, 1))
    assert out.data_ptr() == q.data_ptr()  # no copy forward
    grad = torch.randn(7, 3, 4)
    with torch.profiler.profile() as prof:
        (g,) = torch.autograd.grad(out, q, grad)
    # Backward: the gradient comes back in q's own layout, no zeros filled and none copied in.
    assert torch.equal(g, grad.unsqueeze(0))
    ops = {e.key for e in prof.key_averages()}
    assert not ops & {"aten::select_backward", "aten::zeros", "aten::copy_", "aten::clone"}, ops
