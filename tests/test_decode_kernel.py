"""The compact sampler's decode-step attention as one Triton kernel (tuning.decode_kernel,
stages/rl/fused_kernels.py decode_attention) computes what the batched products do
(stages/rl/decoding.py decode_attention): grouped-query heads, left-padded rows, prefixes that are not
a multiple of the kernel's block, the prefix in one split or several. On the host the kernel runs in
Triton's interpreter in float32; on a GPU (`pytest -m gpu`) compiled, in bf16."""

import pytest
import torch

from stages.rl import decoding
from tests.devices import DEVICES

pytest.importorskip("triton")


def assert_policy_logprobs(plain, prompts, attempts, ids, lps, device):
    """Each sampled token's log-prob equals a teacher-forced pass of the plain model over its sequence."""
    from tests.test_decoding import teacher_forced

    plain.eval()
    diffs = torch.cat([(teacher_forced(plain, prompts[j // attempts], completion, 1.0) - torch.tensor(lp)).abs()
                       for j, (completion, lp) in enumerate(zip(ids, lps))])
    if device == "cpu":
        assert diffs.max() < 1e-4, diffs.max()
    else:
        assert diffs.mean() < 0.02 and diffs.max() < 0.1, (diffs.mean(), diffs.max())


def step_inputs(rows, heads, kv_heads, dim, attend, device, dtype, length=320):
    """A decode step's query ([rows, heads, 1, dim], a transposed view as the layers give it), K and V
    as views of a buffer of `length` positions as RowCache gives them, and each row's additive mask
    with its own left padding."""
    g = torch.Generator().manual_seed(attend * 7 + heads)
    q = torch.randn(rows, 1, heads, dim, generator=g).to(device, dtype).transpose(1, 2)
    buffer = torch.randn(2, rows + 1, kv_heads, length, dim, generator=g).to(device, dtype)
    k, v = buffer[0, :rows, :, :attend], buffer[1, :rows, :, :attend]
    mask = torch.zeros(rows + 1, 1, 1, length, dtype=dtype)
    for r in range(rows):
        # Left padding, row r's a share (r + 1) / (rows + 1) of the prefix: whole splits of it masked.
        mask[r, :, :, :min(attend - 1, attend * (r + 1) // (rows + 1))] = torch.finfo(dtype).min
    return q, k, v, mask.to(device)[:rows, :, :, :attend]


@pytest.mark.parametrize("kernels_on", DEVICES, indirect=True)
@pytest.mark.parametrize("rows, heads, kv_heads, dim, attend", [
    (2, 4, 2, 64, 1), (2, 4, 2, 64, 64), (2, 4, 2, 64, 300),  # one block, exactly one, five in two splits
    (1, 4, 2, 64, 300),  # four splits, the first all padding
    (3, 24, 8, 128, 130),  # the 3B shape's heads: groups of 3 (padded to 16), heads of 128
    (1, 4, 4, 32, 50),  # no grouping
    (40, 8, 2, 64, 130),  # 80 programs: one split
])
def test_the_kernel_gives_the_products_attention(kernels_on, rows, heads, kv_heads, dim, attend):
    device = kernels_on
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v, mask = step_inputs(rows, heads, kv_heads, dim, attend, device, dtype)
    want, _ = decoding.decode_attention(None, q.float(), k.float(), v.float(), mask.float())
    got, _ = decoding.kernel_decode_attention(None, q, k, v, mask)
    assert got.shape == want.shape == (rows, 1, heads, dim)
    tol = 1e-5 if device == "cpu" else 2e-2
    assert torch.allclose(got.float(), want, atol=tol, rtol=tol), (got.float() - want).abs().max()


@pytest.mark.parametrize("kernels_on", DEVICES, indirect=True)
@pytest.mark.parametrize("heads, kv_heads, dim, width, attend, groups", [
    (24, 8, 128, 70, 130, [3, 1, 2]),  # the 3B shape's heads; a prompt of two blocks, the second part
    (4, 4, 32, 5, 9, [2, 2]),  # no grouping; a prompt shorter than a block
    (4, 2, 64, 64, 400, [40, 1]),  # more rows in a group than one pass takes
])
def test_rows_that_share_a_prompt_read_it_once_and_attend_as_alone(kernels_on, heads, kv_heads, dim, width, attend,
                                                                     groups):
    """The decode kernel with shared prompts (a group of consecutive rows holding one copy of a prompt's
    K/V and mask, as the sampler's attempts do) gives the products' attention of each row alone."""
    device = kernels_on
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    rows = sum(groups)
    q, k, v, mask = step_inputs(rows, heads, kv_heads, dim, attend, device, dtype)
    mask = mask.clone()
    first = 0
    for n in groups:  # a group's rows: one prompt (its K/V, its left padding), then positions of their own
        k[first:first + n, :, :width] = k[first, :, :width]
        v[first:first + n, :, :width] = v[first, :, :width]
        mask[first:first + n, :, :, :width] = 0
        mask[first:first + n, :, :, :width * first // rows] = torch.finfo(dtype).min
        first += n
    mask[:, :, :, attend - 3:] = torch.finfo(dtype).min  # positions not yet written
    group_rows = torch.zeros(rows, dtype=torch.int32)
    group_rows[torch.tensor(groups).cumsum(0) - torch.tensor(groups)] = torch.tensor(groups, dtype=torch.int32)
    prompts = decoding.SharedPrompts(group_rows.to(device), torch.tensor([width], dtype=torch.int32, device=device),
                                     torch.full((rows * heads * (dim + 2),), float("nan"), device=device))
    want, _ = decoding.decode_attention(None, q.float(), k.float(), v.float(), mask.float())
    with decoding.decode_step_state(prompts):
        got, _ = decoding.kernel_decode_attention(None, q, k, v, mask)
    tol = 1e-5 if device == "cpu" else 2e-2
    assert torch.allclose(got.float(), want, atol=tol, rtol=tol), (got.float() - want).abs().max()


@pytest.mark.parametrize("kernels_on", DEVICES, indirect=True)
@pytest.mark.parametrize("row_prompt, shared", [
    ([1, 0], False),  # two rows, four programs: the prefix in two splits, the first across the prompt's end
    ([0, 0, 0, 1], True),  # groups of rows that read their prompt once (one split)
])
def test_rows_whose_prompts_are_held_apart_attend_as_over_one_row(kernels_on, row_prompt, shared):
    """Prompts held apart (a region of each prompt's K/V once; each row only its own positions after them,
    and the index of its prompt): the kernel gives the products' attention over the prompt and the row
    laid end to end, split or not, with the prompts read once a group or each row on its own."""
    from types import SimpleNamespace

    device = kernels_on
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    rows, heads, kv_heads, dim, held, own, written = len(row_prompt), 4, 2, 64, 70, 96, 90
    g = torch.Generator().manual_seed(rows)
    q = torch.randn(rows, 1, heads, dim, generator=g).to(device, dtype).transpose(1, 2)
    region = torch.randn(2, 2, kv_heads, held, dim, generator=g).to(device, dtype)  # K and V of two prompts
    mine = torch.randn(2, rows, kv_heads, own, dim, generator=g).to(device, dtype)  # each row's own positions
    index = torch.tensor(row_prompt, dtype=torch.int32, device=device)
    mask = torch.zeros(rows, 1, 1, held + own, dtype=dtype)
    for r, i in enumerate(row_prompt):
        mask[r, :, :, :17 * (i + 1)] = torch.finfo(dtype).min  # each prompt's own left padding
    mask[:, :, :, held + written:] = torch.finfo(dtype).min  # positions not yet written
    mask = mask.to(device)
    whole = [torch.cat([region[x][index.long()], mine[x]], dim=2) for x in (0, 1)]
    want, _ = decoding.decode_attention(None, q.float(), whole[0].float(), whole[1].float(), mask.float())
    apart = decoding.PromptsApart([region[0]], [region[1]], index, held)
    prompts = None
    if shared:
        group_rows = torch.tensor([3, 0, 0, 1], dtype=torch.int32, device=device)
        prompts = decoding.SharedPrompts(group_rows, torch.tensor([held], dtype=torch.int32, device=device),
                                         torch.full((rows * heads * (dim + 2),), float("nan"), device=device))
    with decoding.decode_step_state(prompts, torch.tensor([written - 1], device=device), apart):
        got, _ = decoding.kernel_decode_attention(SimpleNamespace(layer_idx=0), q, mine[0], mine[1], mask)
    assert decoding.kernel_splits(rows * kv_heads, held + own, torch.device(device)) == (1 if shared else 2) or \
        device == "cuda"
    tol = 1e-5 if device == "cpu" else 2e-2
    assert torch.allclose(got.float(), want, atol=tol, rtol=tol), (got.float() - want).abs().max()

@pytest.mark.parametrize("kernels_on", DEVICES, indirect=True)
@pytest.mark.parametrize("rows, attend", [(3, 130), (1, 300), (12, 65)])  # one split; four; one, a block and a position
def test_the_kernel_reads_the_prefix_up_to_the_written_position(kernels_on, rows, attend):
    """Given whole buffer rows and the written position on the device (as the sampler's captured steps
    give them), the kernel attends over the prefix up to it: the products' attention over that prefix."""
    device = kernels_on
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v, mask = step_inputs(rows, 24, 8, 128, attend, device, dtype, length=320)
    want, _ = decoding.decode_attention(None, q.float(), k.float(), v.float(), mask.float())
    # The whole rows of the buffer, and a mask that hides the positions past the written one.
    k, v = (x.as_strided((rows, 8, 320, 128), x.stride()) for x in (k, v))
    whole = torch.full((rows, 1, 1, 320), torch.finfo(dtype).min, dtype=dtype, device=device)
    whole[..., :attend] = mask
    with decoding.decode_step_state(None, torch.tensor([attend - 1], device=device)):
        got, _ = decoding.kernel_decode_attention(None, q, k, v, whole)
    tol = 1e-5 if device == "cpu" else 2e-2
    assert torch.allclose(got.float(), want, atol=tol, rtol=tol), (got.float() - want).abs().max()


def test_a_prompts_rows_stay_one_group_through_compactions(kernels_on):
    """The sampler's bookkeeping for shared prompts: after the prefill each prompt's attempts are one
    group led by its first row; a compaction keeps the live rows in order, so a group's survivors
    are again consecutive and led by the first of them, and a padding row is a group of its own."""
    from stages.rl.decoding import CompactDecoder, buffer_length
    from tests.test_fused_layers import models

    _, fused = models("llama", "cpu")
    dec = CompactDecoder(fused.eval(), rows=8, length=buffer_length(4, 6), cuda_graphs=False)
    assert dec.prompts is not None
    dec.cache.set_layout(8, buffer_length(4, 6))
    with torch.no_grad():
        dec._prefill([[5, 6, 7], [8, 9], [10, 11, 12, 13]], [3, 1, 4], 4)
    assert dec.prompts.group_rows.tolist() == [3, 0, 0, 1, 4, 0, 0, 0] and dec.prompts.width.item() == 4
    done = torch.tensor([True, False, False, True, False, True, False, False])
    tokens, results = torch.zeros(8, 6, dtype=torch.long), torch.zeros(8, 6, dtype=torch.long)
    # Live: rows 1 and 2 (the first prompt's), 4, 6 and 7 (the third's); six rows decode from now on.
    assert dec._compact(8, 6, 5, 4, done, torch.arange(8), tokens, None, results, None) == 6
    assert dec.prompts.group_rows[:6].tolist() == [2, 0, 3, 0, 0, 1]
    for key in dec.cache.keys:  # each group's leading row holds its prompt's K/V
        assert torch.equal(key[0, :, :4], key[1, :, :4]) and torch.equal(key[2, :, :4], key[4, :, :4])
    assert not dec._share  # prompts of a few positions: each row reads its own


def test_prompts_are_read_once_a_group_while_the_groups_are_large(kernels_on):
    """Long prompts with several attempts each are shared; once the live rows average fewer than
    SHARE_ROWS_PER_GROUP a prompt, each row reads its own again (the steps' graphs are told apart)."""
    from stages.rl.decoding import SHARE_PROMPTS_FROM, SHARE_ROWS_PER_GROUP, CompactDecoder, buffer_length
    from tests.test_fused_layers import models

    _, fused = models("llama", "cpu")
    width = SHARE_PROMPTS_FROM
    n = 2 * SHARE_ROWS_PER_GROUP
    dec = CompactDecoder(fused.eval(), rows=n, length=buffer_length(width, 4), cuda_graphs=False)
    dec.cache.set_layout(n, buffer_length(width, 4))
    with torch.no_grad():
        dec._prefill([[4 + i % 20 for i in range(width)], [5 + i % 20 for i in range(width)]], [n // 2, n // 2], width)
    assert dec._share and dec._graph_key(n, width + 64)[-1]
    done = torch.ones(n, dtype=torch.bool)
    done[[0, n - 1]] = False  # one row of each prompt lives on
    tokens = torch.zeros(n, 4, dtype=torch.long)
    dec._compact(n, 2, 2, width, done, torch.arange(n), tokens, None, tokens.clone(), None)
    assert dec.prompts.group_rows[:2].tolist() == [1, 1] and not dec._share


def test_the_prefix_splits_fill_the_multiprocessors():
    cpu = torch.device("cpu")  # counted as 4 multiprocessors
    assert decoding.kernel_splits(1, 300, cpu) == 4  # 8 programs; the prefix has 5 blocks
    assert decoding.kernel_splits(2, 64, cpu) == 1  # one block: nothing to split
    assert decoding.kernel_splits(640, 300, cpu) == 1
    assert decoding.kernel_splits(1, 10**6, cpu) == 8


@pytest.mark.parametrize("kernels_on", DEVICES, indirect=True)
def test_the_sampler_draws_the_policys_tokens_through_the_kernel(kernels_on, monkeypatch):
    # Every decode step's attention through the kernel; each drawn token's log-prob is HF's
    # teacher-forced one (the prefill runs HF's attention).
    from stages.rl.decoding import CompactDecoder, SamplingParams, buffer_length
    from tests.test_fused_layers import models

    device = kernels_on
    plain, fused = models("llama", device)
    calls = []
    kernel = decoding.kernel_decode_attention
    monkeypatch.setattr(decoding, "kernel_decode_attention",
                        lambda *a, **k: calls.append(a[1].shape) or kernel(*a, **k))
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]
    params = SamplingParams(max_new_tokens=6, eos_token_id=3, pad_token_id=0)
    decoder = CompactDecoder(fused.eval(), rows=6, length=buffer_length(5, 6), cuda_graphs=device == "cuda")
    assert decoder.decode_kernel
    ids, lps = decoder.sample(prompts, 2, params, torch.Generator(device).manual_seed(0), record_logprobs=True)
    assert calls and all(shape[2] == 1 for shape in calls)  # decode steps, one position a row
    assert_policy_logprobs(plain, prompts, 2, ids, lps, device)


@pytest.mark.parametrize("kernels_on", DEVICES, indirect=True)
def test_prompts_held_apart_give_the_policys_tokens_through_shared_reads_and_rounds(kernels_on, monkeypatch):
    """With the decode kernel the buffer holds each prompt's K/V once, apart from the rows, which hold only
    their own positions: all the sequences start at once in a buffer where rows holding a copy of their
    prompt would not fit, and the policy's tokens come out through the prompts' shared reads, compactions
    and a spilled round (whose prefixes are held apart in turn). Compactions: the next test."""
    from stages.rl.decoding import CompactDecoder, SamplingParams, buffer_length
    from tests.test_fused_layers import models

    device = kernels_on
    plain, fused = models("llama", device)
    monkeypatch.setattr(decoding, "SHARE_PROMPTS_FROM", 8)  # these prompts are short: read them once a group anyway
    monkeypatch.setattr(decoding, "LENGTH_STEP", 8)  # rows of 8 positions of their own: few decode steps a round
    monkeypatch.setattr(decoding, "APART_FROM", 8)  # and held apart
    monkeypatch.setattr(decoding, "PREFILL_TOKENS", 30)  # a prefill pass per prompt
    prompts = [[5 + (i * 7 + j) % 50 for j in range(12 + 18 * i)] for i in range(2)]  # 12 and 30 tokens
    eos = 3
    width, n = 30, 2 * 3
    positions = 2 * width + n * 8 + 40  # each prompt once, and 8 positions of its own a row (not 16)
    assert n * (width + 8) > positions
    params = SamplingParams(max_new_tokens=16, eos_token_id=eos, pad_token_id=0)
    seen = []
    step = decoding.CompactDecoder._step
    monkeypatch.setattr(decoding.CompactDecoder, "_step",
                        lambda self, b, attend: seen.append((self.cache.layout, self._share)) or step(self, b, attend))
    dec = CompactDecoder(fused.eval(), rows=n, length=buffer_length(width, 16), cuda_graphs=device == "cuda",
                         positions=positions)
    ids, lps = dec.sample(prompts, 3, params, torch.Generator(device).manual_seed(3), record_logprobs=True)
    st = dec.stats
    assert dec.decode_kernel and st.spilled > 0 and st.rounds >= 2, st
    assert seen[0] == ((n, width + 8, 2, width), True)  # the first call: every row, the prompts apart and shared
    assert all(layout[3] > 0 for layout, _ in seen) and not all(share for _, share in seen)
    assert max(len(c) for c in ids) > 8  # a spilled sequence went on in the next round
    for completion in ids:
        assert eos not in completion[:-1] and (len(completion) == 16 or completion[-1] == eos)
    assert_policy_logprobs(plain, prompts, 3, ids, lps, device)


def test_a_compaction_moves_the_rows_own_positions_and_which_prompt_each_reads(kernels_on):
    """Prompts held apart: a compaction moves each live row's own positions and its prompt's index to the
    front, in order, and leaves the prompts' region as it is."""
    from stages.rl.decoding import CompactDecoder, buffer_length
    from tests.test_fused_layers import models

    _, fused = models("llama", "cpu")
    dec = CompactDecoder(fused.eval(), rows=8, length=buffer_length(4, 6), cuda_graphs=False)
    dec.cache.set_layout(8, buffer_length(4, 6), 3, 4)
    with torch.no_grad():
        dec._prefill([[5, 6, 7], [8, 9], [10, 11, 12, 13]], [3, 1, 4], 4)
    assert dec.row_prompt.tolist() == [0, 0, 0, 1, 2, 2, 2, 2]
    prompts_before = [k.clone() for k in dec.cache.prompt_keys]
    for key in dec.cache.keys:  # two positions of each row's own, marked with the row
        key[:, :, :2] = torch.arange(8.0).view(8, 1, 1, 1)
    done = torch.tensor([True, False, False, True, False, True, False, False])
    tokens, results = torch.zeros(8, 6, dtype=torch.long), torch.zeros(8, 6, dtype=torch.long)
    # Live: rows 1 and 2 (the first prompt's), 4, 6 and 7 (the third's); the next write is at position 6.
    assert dec._compact(8, 6, 5, 6, done, torch.arange(8), tokens, None, results, None) == 6
    assert dec.row_prompt[:6].tolist() == [0, 0, 2, 2, 2, 0]
    assert dec.prompts.group_rows[:6].tolist() == [2, 0, 3, 0, 0, 1]
    for key in dec.cache.keys:
        assert key[:5, :, :2].flatten(1).amin(1).tolist() == [1.0, 2.0, 4.0, 6.0, 7.0]
    assert all(torch.equal(k, before) for k, before in zip(dec.cache.prompt_keys, prompts_before))


def test_full_rows_are_laid_out_again_longer_in_the_room_of_ended_ones(kernels_on, monkeypatch):
    """Prompts held apart, the rows full: where the live sequences now decode in fewer rows, the rows'
    region is laid out again as those rows, longer (up to the row a sequence may need), each row's own
    positions where its new view reads them and the prompts' region as it was; where every row still
    decodes there is no longer row, and the sequences spill instead."""
    from stages.rl.decoding import CompactDecoder, buffer_length
    from tests.test_fused_layers import models

    monkeypatch.setattr(decoding, "LENGTH_STEP", 8)
    _, fused = models("llama", "cpu")
    dec = CompactDecoder(fused.eval(), rows=8, length=buffer_length(4, 29), cuda_graphs=False)
    dec.cache.set_layout(8, 4 + 8, 3, 4)  # 8 positions of their own a row
    with torch.no_grad():
        dec._prefill([[5, 6, 7], [8, 9], [10, 11, 12, 13]], [3, 1, 4], 4)
    prompts_before = [k.clone() for k in dec.cache.prompt_keys + dec.cache.prompt_values]
    marks = torch.arange(8.0).view(8, 1, 1, 1) * 100 + torch.arange(8.0).view(1, 1, 8, 1)  # row r, position j
    for buf in dec.cache.keys + dec.cache.values:
        buf[:] = marks
    assert not dec._widen(8, 12, 32) and dec.cache.layout == (8, 12, 3, 4)
    # Two rows in the room of eight: 32 positions of their own, cut to the 28 a sequence may need.
    assert dec._widen(2, 12, 32) and dec.cache.layout == (2, 32, 3, 4) and dec.stats.widenings == 1
    for buf in dec.cache.keys + dec.cache.values:
        assert buf.shape[:3] == (2, 2, 28) and torch.equal(buf[:, :, :8], marks[:2].expand(2, 2, 8, buf.shape[3]))
    assert all(torch.equal(k, before) for k, before in
               zip(dec.cache.prompt_keys + dec.cache.prompt_values, prompts_before))
