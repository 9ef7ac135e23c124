"""A micro-batch's rows packed end to end into one sequence, without padding (tuning.remove_padding).

Right-padded micro-batches run every row to the longest row's width: where completions vary in
length, most of the positions run are padding. Packed, the forward and backward run only the real
tokens. Each row keeps its own positions (0, 1, ... for the rotary embedding) and attends only
within itself: the attention is variable-length (cumulative row offsets), torch's flash-attention
kernel on CUDA (torch.nn.attention.varlen) and one causal SDPA call per row elsewhere.

The log-probs, the loss mask and the loss are those of the padded batch, token for token: a row's
last position would predict the next row's first token, and that position is outside the loss
mask as padding is (tests/test_packing.py checks the gradients are the same).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import NamedTuple

import torch

# The name under which the packed attention is registered with transformers.
ATTENTION = "syncrl_packed"


class PackedShape(NamedTuple):
    """One tensor shape for all of an iteration's packed micro-batches (tuning.train_graphs: a graph
    replays the shape it captured). `longest` bounds every segment, rows and padding alike: it is the
    attention's max_length, which sizes the flash kernel's grid (blocks of queries per row and head),
    so it is the longest row, not the batch's positions; None is the positions."""
    positions: int
    segments: int
    longest: int | None = None

    @property
    def max_length(self) -> int:
        return self.positions if self.longest is None else self.longest


def pack(micro: list[dict | None], device, shape: tuple | None = None) -> dict:
    """The rows of `micro` (None: a padding row, skipped) as one sequence, with the same fields as
    batches.collate over [1, T] (T the rows' summed lengths), the per-token advantages, and the row
    offsets the attention needs (cu_seq_lens, max_length).

    With shape (a PackedShape or its tuple) every batch has the same tensor shapes, as a captured
    CUDA graph needs (tuning.train_graphs): T is `positions`, the rows followed by masked padding
    segments of 1 to `longest` tokens (no zero-length sequence for the attention kernel), and
    cu_seq_lens has segments + 1 entries; max_length is the shape's, which bounds every segment."""
    real = [r for r in micro if r is not None]
    seqs = [r["prompt_ids"] + r["completion_ids"] for r in real] or [[0, 0]]  # an empty batch: one masked row
    total = sum(len(s) for s in seqs)
    offsets = [0]
    for s in seqs:
        offsets.append(offsets[-1] + len(s))
    lengths = [len(s) for s in seqs] if real else []
    if shape is not None:
        shape = PackedShape(*shape)
        seqs, offsets, total = _fill(seqs, offsets, total, shape)
    # Built on the host as two tensors (token ids and positions; loss mask, old log-probs and
    # advantages), each sent in one copy: a copy from ordinary host memory makes the host wait for
    # the GPU to finish what is queued, which five copies per micro-batch did.
    ints = torch.empty(2, total, dtype=torch.long)
    ints[0] = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
    ints[1] = torch.cat([torch.arange(len(s)) for s in seqs])
    floats = torch.zeros(3, total - 1)  # mask, old log-probs, advantages
    for r, o in zip(real, offsets):
        p, c = len(r["prompt_ids"]), len(r["completion_ids"])
        # As in collate: shifted position o + j predicts token o + j + 1, so completion tokens are
        # predicted at o + p - 1 .. o + p + c - 2; o + p + c - 1 would predict the next row's first.
        span = slice(o + p - 1, o + p - 1 + c)
        floats[0, span] = 1
        if "logprobs" in r:
            floats[1, span] = torch.tensor(r["logprobs"])
        floats[2, span] = r.get("advantage", 0.0)
    cu = torch.tensor(offsets, dtype=torch.int32)
    ints, floats, cu = (to_device(x, device) for x in (ints, floats, cu))
    out = dict(input_ids=ints[0:1], position_ids=ints[1:2], mask=floats[0:1], old_logp=floats[1:2],
               advantages=floats[2:3], cu_seq_lens=cu)
    out["max_length"] = shape.max_length if shape is not None else max(len(s) for s in seqs)
    out["lengths"] = lengths
    out["tokens"] = sum(len(r["completion_ids"]) for r in real)
    return out


def _fill(seqs: list, offsets: list, total: int, shape: PackedShape):
    """The sequences, offsets and length of a batch filled out to the shape's positions and segments
    with padding segments of token 0 (outside the loss mask; no row attends to them), one token each
    and the rest of the positions on the last ones, none longer than the shape's max_length."""
    missing, padding, bound = shape.segments - len(seqs), shape.positions - total, shape.max_length
    if missing < 1 or padding < missing or padding > missing * bound or max(map(len, seqs)) > bound:
        raise ValueError(f"a micro-batch of {len(seqs)} rows and {total} positions (the longest "
                         f"{max(map(len, seqs))}) does not fit the fixed shape of {shape.segments - 1} rows and "
                         f"{shape.positions} positions it was given (rows + 1 segments, a position for each "
                         f"segment left, none longer than {bound})")
    sizes, rest = [1] * missing, padding - missing
    for i in reversed(range(missing)):
        sizes[i] += min(rest, bound - 1)
        rest -= sizes[i] - 1
    for size in sizes:
        offsets = offsets + [offsets[-1] + size]
    return seqs + [[0] * size for size in sizes], offsets, shape.positions


def to_device(x: torch.Tensor, device) -> torch.Tensor:
    """`x` on `device`; to a GPU through page-locked memory without waiting (torch's host allocator
    caches the page-locked blocks, and keeps each until its copy is done)."""
    device = torch.device(device)
    if device.type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


def model_kwargs(batch: dict) -> dict:
    """What the model's forward takes besides input_ids for a packed batch (transformers passes the
    cu_seq_lens / max_length keywords down to the attention function)."""
    cu, m = batch["cu_seq_lens"], batch["max_length"]
    return dict(position_ids=batch["position_ids"], cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=m,
                max_length_k=m, use_cache=False)


def use_packed_attention(model) -> None:
    """Make `model` (an HF model) run its attention through packed_attention: variable-length for
    packed batches, SDPA for padded ones."""
    register_packed_attention()
    model.set_attn_implementation(ATTENTION)


def register_packed_attention() -> None:
    """packed_attention registered with transformers as ATTENTION, for a forward that names it."""
    from transformers import AttentionInterface

    _VARLEN[0] = _varlen_attn()
    AttentionInterface.register(ATTENTION, packed_attention)


# Set while a forward runs packed rows that the caller built (offsets_required): an attention call
# without their offsets then comes from a model whose layers do not hand attention keywords on.
_OFFSETS_REQUIRED = [False]


@contextlib.contextmanager
def offsets_required():
    """Within this block every packed_attention call must get the rows' offsets: without them the
    fallback below would attend causally across the packed rows (each row's tokens to the rows
    before it), silently. The compact sampler's packed prefill runs in one."""
    _OFFSETS_REQUIRED[0] = True
    try:
        yield
    finally:
        _OFFSETS_REQUIRED[0] = False


def packed_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                     cu_seq_lens_q=None, max_length_q=None, **kwargs):
    """transformers' attention-function contract: query [1, H, T, D], key/value [1, Hkv, T, D]; returns
    ([1, T, H, D], None). Without row offsets (a padded batch) it is transformers' SDPA attention."""
    if cu_seq_lens_q is None:
        if _OFFSETS_REQUIRED[0]:
            raise ValueError(f"{type(module).__name__} was called without the packed prompts' offsets "
                             "(cu_seq_lens_q): this model's layers do not pass attention keywords on, so its "
                             "prompts cannot be prefilled packed; set generate.cache=static")
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"a packed batch is one sequence; got {query.shape[0]}")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # grouped-query attention: each key/value head serves `groups` query heads
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    # The flash kernel takes half precision only; other dtypes take the per-row path.
    varlen = _VARLEN[0] if query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) else None
    if varlen is not None:
        q, k, v = (token_major(x) for x in (query, key, value))
        # max_length_q stays as given: under train.compile it is symbolic, and int() would make each
        # micro-batch's value a new graph.
        return varlen(q, k, v, cu_seq_lens_q, max_length_q, scale).unsqueeze(0), None
    bounds = cu_seq_lens_q.tolist()
    rows = [torch.nn.functional.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b],
                                                             is_causal=True, scale=scale)
            for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(rows, dim=2).transpose(1, 2), None


def token_major(x: torch.Tensor) -> torch.Tensor:
    """[1, H, T, D] as transformers hands it to attention -> [T, H, D] as the variable-length kernel
    takes it; no copy either way where x is a transposed view of a contiguous [1, T, H, D] (the
    fused layers' q, k, v). Squeezed, not indexed: x[0]'s backward writes the gradient into new zeros
    through a strided copy, and the rotary kernel's backward then copies it again to make it
    contiguous: copies and fills in every layer for nothing."""
    return x.squeeze(0).transpose(0, 1).contiguous()


# torch's variable-length kernel, looked up when a model is switched to packed attention: the lookup
# (an import and a signature) stays outside what train.compile traces.
_VARLEN: list = [None]


@functools.cache
def _varlen_attn():
    """torch's variable-length flash attention as f(q, k, v, cu, max_len, scale) -> [T, H, D], causal
    (its keywords differ between torch releases), or None where this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    takes_scale = "scale" in params

    def call(q, k, v, cu, max_len, scale):
        if takes_scale:
            return varlen_attn(q, k, v, cu, cu, max_len, max_len, scale=scale, **causal)
        # This release scales by 1/sqrt(D) only: fold any other scale into the queries.
        return varlen_attn(q * (scale * q.shape[-1] ** 0.5), k, v, cu, cu, max_len, max_len, **causal)

    return call


def row_width(row: dict) -> int:
    """The positions a row takes in a batch: its prompt and its completion."""
    return len(row["prompt_ids"]) + len(row["completion_ids"])


def fixed_shape(micro_batches: list[list[dict | None]], multiple: int = 64) -> PackedShape:
    """The PackedShape that every one of `micro_batches` fits packed (pack's `shape`): a segment per
    row of the fullest plus padding segments, as many as it takes for each micro-batch's padding to
    fit segments no longer than the longest row (rounded up to `multiple`); the most positions of any
    plus a position for each padding segment, rounded up to `multiple`."""
    sizes, widest = [], 2  # (positions, rows) of each; an empty micro-batch packs as one masked row of 2 tokens
    for micro in micro_batches:
        widths = [row_width(r) for r in micro if r is not None] or [2]
        sizes.append((sum(widths), len(widths)))
        widest = max(widest, *widths)
    sizes = sizes or [(2, 1)]
    longest = -(-widest // multiple) * multiple
    most_rows, most_positions = max(r for _, r in sizes), max(t for t, _ in sizes)
    for extra in range(1, len(sizes) * most_positions + 2):
        segments = most_rows + extra
        positions = -(-(most_positions + segments) // multiple) * multiple
        if all(positions - t <= (segments - r) * longest for t, r in sizes):
            return PackedShape(positions, segments, longest)
    raise AssertionError("unreachable: each padding segment added holds `longest` more positions")
