"""generate.cache: compact: syncrl's own batched sampling loop over an HF causal LM.

HF `generate` keeps every sequence of a call in the batch until the longest one stops, and with a
static cache it attends over the whole preallocated length at every step. On RL rollouts (mean
completion far below the cap) that spends most decode steps on finished sequences and unwritten
cache. This loop runs the same model forward, with three differences:

- finished sequences leave the batch: the live rows are compacted to the front of one preallocated
  KV buffer whenever their count falls to the next smaller batch size of a fixed ladder;
- attention reads only the written prefix of the buffer, rounded up to a multiple of LENGTH_STEP
  positions: every row of a call shares its positions (prompts are left-padded to one width), so the
  prefix is the same for all of them;
- on GPU, each (batch size, prefix length) decode step is captured once as a CUDA graph and
  replayed, so a step costs one launch instead of a few hundred; the decode kernel reads the prefix
  length from the GPU, so with it one graph per batch size serves every prefix length;
- with the decode kernel, each prompt of at least APART_FROM positions has its K/V held once, in a
  region of the buffer apart from the rows, which hold only the positions after the prompts: a call
  holds more rows. The attempts of one prompt (consecutive rows) read the prompt's positions once for
  all of them while they are many and the prompt long (SharedPrompts), then each on its own.

The buffer holds as many K/V positions as fit the free GPU memory (generate.memory_fraction). When
that is fewer than every sequence reaching max_new_tokens needs, all sequences still start at once,
in rows shorter than the longest completion. When the rows are full, with the prompts held apart,
the live ones go on in longer rows laid out in the room of those that ended; the few still going
when no longer row fits are spilled, and a later round continues them in longer rows, prefilled
from their tokens so far. RL completions are mostly far shorter than the cap, so this decodes one
tail of steps where calls of full-length rows would each decode their own. Prompts are prefilled
once; where they are not held apart, their cache is copied to each attempt's row. Sampling is HF's:
temperature, then top-p, then a draw from the softmax, each sequence keeping its end-of-sequence
token and stopping there or at max_new_tokens. The model is used only through its forward (input
ids, position ids, a 4-D additive mask, a cache object with `update`), so any HF decoder whose
layers all use full attention works; others are refused with the setting to
use instead.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import time
from dataclasses import dataclass, field

import torch

from stages.rl import packing

log = logging.getLogger("syncrl.generate")

# The attended prefix grows in steps of this many positions: each step is one more CUDA graph per
# batch size, and a row reads at most this many unwritten positions.
LENGTH_STEP = 64
# Batch sizes the live rows are compacted to: a geometric ladder (ratio ~1.33), multiples of 8.
# A finished row is carried until the count reaches the next rung, so a rung is at most a third
# larger than the rows it holds; each rung is one compaction and one graph per prefix length.
LADDER_RATIO = 4 / 3
# Prompt tokens per prefill forward pass: bounds the activations of a long-prompt batch.
PREFILL_TOKENS = 1 << 16
# Rows shorter than the longest completion are used only when they give every sequence at least
# this share of its remaining new tokens (and LENGTH_STEP): below it, more of them spill than the
# shared tail saves, and the sequences go in calls of full-length rows instead.
MIN_ROUND_SHARE = 1 / 4


@dataclass
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    eos_token_id: int = 0
    pad_token_id: int = 0


@dataclass
class DecodeStats:
    """What a sampling run did, for the stage's marker and the benchmarks."""
    calls: int = 0
    rows: int = 0  # the buffer's rows: the most sequences decoded at once
    new_tokens: int = 0  # up to and including end-of-sequence
    decoded_positions: int = 0  # rows the decode steps ran, finished and padding rows included
    steps: int = 0
    compactions: int = 0
    spilled: int = 0  # sequences whose row filled up, continued in a later round
    widenings: int = 0  # full rows laid out again longer, in the room of rows that had ended
    rounds: int = 0
    graphs: int = 0
    graph_capture_s: float = 0.0
    prefill_s: float = 0.0
    # The decode steps' time, and the part of it while every sequence of a call was still running
    # (read at the loop's own per-step sync: no sync of their own).
    decode_s: float = 0.0
    full_s: float = 0.0
    kv_bytes_read: int = 0  # K and V bytes the decode steps' attention read
    weight_bytes_read: int = 0  # parameter bytes the decode steps read (once per step)
    extra: dict = field(default_factory=dict)


def check_supported(config) -> None:
    """Refuse models whose layers do not all attend over the whole past (sliding windows, linear or
    hybrid layers): this loop keeps one full-length cache per layer."""
    types = set(getattr(config, "layer_types", None) or ["full_attention"])
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if types != {"full_attention"} or window:
        raise ValueError(f"generate.cache=compact supports decoders with full attention in every layer; "
                         f"{config.model_type} has layer types {sorted(types)}"
                         f"{f' and a sliding window of {window}' if window else ''}: set generate.cache=static")


def kv_heads(config) -> int:
    """The K/V heads of a layer (fewer than the query heads under grouped-query attention)."""
    return config.num_key_value_heads or config.num_attention_heads


def tensor_parallel_size(model) -> int:
    """How many processes share each layer of `model` (transformers' tensor-parallel plan under
    torch.distributed), each holding its shard of the heads; 1 for a whole model."""
    return int(getattr(model, "tp_size", None) or getattr(model, "_tp_size", None) or 1)


def kv_bytes_per_position(config, dtype: torch.dtype) -> int:
    heads = kv_heads(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * torch.empty((), dtype=dtype).element_size()


def buffer_length(prompt_width: int, max_new_tokens: int) -> int:
    """Positions a row may need: the prompt plus every new token but the last (which is sampled, never
    fed back), rounded up to the prefix step; at least one past the prompt (a spilled sequence with one
    token to go still gets a row longer than its prefix)."""
    return LENGTH_STEP * math.ceil((prompt_width + max(1, max_new_tokens - 1)) / LENGTH_STEP)


def positions_that_fit(model, rows: int, memory_fraction: float) -> int:
    """How many K/V positions (summed over rows) fit in `memory_fraction` of the memory free now on
    each GPU that holds layers, next to `rows` rows of float32 logits on the first. On CPU: no limit."""
    first = next(model.parameters()).device
    if first.type != "cuda":
        return 1 << 40
    config, dtype = model.config, next(model.parameters()).dtype
    shards = tensor_parallel_size(model)
    per_layer = kv_bytes_per_position(config, dtype) // config.num_hidden_layers // shards
    devices = layer_devices(model, first)
    fit = []
    for d in sorted(set(devices), key=str):
        free, _ = torch.cuda.mem_get_info(d)
        budget = free * memory_fraction - (4 * 3 * config.vocab_size * rows if d == first else 0)
        fit.append(int(max(0, budget) // (per_layer * devices.count(d))))
    if shards == 1:
        return min(fit)
    # The members of a tensor-parallel group decode the same rows in step: the least room sets them.
    import torch.distributed as dist

    least = torch.tensor([min(fit)], device=first)
    dist.all_reduce(least, op=dist.ReduceOp.MIN)
    return int(least.item())


def layer_devices(model, default: torch.device) -> list:
    """The device of each decoder layer (they differ when the model is spread over GPUs)."""
    layers = getattr(model.base_model, "layers", None)
    if layers is None or len(layers) != model.config.num_hidden_layers:
        return [default] * model.config.num_hidden_layers
    return [next(layer.parameters()).device for layer in layers]


def ladder(top: int) -> list[int]:
    """Batch sizes from `top` down to 1: multiples of 8 in ratio ~LADDER_RATIO, then 4, 2, 1."""
    sizes, b = [top], top
    while b > 8:
        b = max(8, int(b / LADDER_RATIO) // 8 * 8)
        if b < sizes[-1]:
            sizes.append(b)
    sizes += [s for s in (4, 2, 1) if s < sizes[-1]]
    return sizes


def decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """Attention of one new position per row over a short attended prefix, as two batched products.

    SDPA with a mask runs cuDNN's prefill kernel here, which tiles the single query up to a block
    of rows and wastes most of it. Query heads that share a K/V head (grouped-query attention) go in
    one product, without repeating K/V.
    """
    b, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    if q_len != 1:
        raise ValueError(f"decode_attention serves single-position decode steps (got {q_len} query positions)")
    q = query.reshape(b, kv_heads, heads // kv_heads, dim)
    scores = torch.matmul(q, key.transpose(-1, -2)).float() * (scaling or dim ** -0.5)
    if attention_mask is not None:
        scores = scores + attention_mask  # [b, 1, 1, L]: the same for every head
    probs = scores.softmax(-1).to(value.dtype)
    out = torch.matmul(probs, value)  # [b, kv_heads, groups, dim]
    return out.reshape(b, 1, heads, dim), None


def kernel_decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """decode_attention's result from one Triton kernel (stages/rl/fused_kernels.py decode_attention): per
    row and K/V head, the query heads that share the head attend together over the prefix, in splits
    of it where rows x K/V heads are too few programs to fill the GPU, each split's softmax combined
    by a second kernel."""
    from stages.rl.fused_layers import kernels

    b, heads, q_len, dim = query.shape
    apart = _prompts_apart
    held = apart.held if apart is not None else 0
    kv_heads, attend = key.shape[1], key.shape[2] + held
    if q_len != 1:
        raise ValueError(f"the decode kernel serves single-position decode steps (got {q_len} query positions)")
    if query.stride(-1) != 1 or key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError("the decode kernel reads each head's values contiguous")
    group = heads // kv_heads
    out = query.new_empty(b, 1, heads, dim)
    mask = attention_mask if attention_mask is not None else query.new_zeros(b, 1, 1, attend)
    splits = kernel_splits(b * kv_heads, attend, query.device)
    part = torch.empty(b * kv_heads * splits * max(16, pow2(group)) * (dim + 2) if splits > 1 else 1,
                       dtype=torch.float32, device=query.device)
    k = kernels()
    scale = scaling or dim ** -0.5
    if apart is not None:  # the layer's region of prompts, which the rows' views do not reach
        kp, vp = apart.keys[module.layer_idx], apart.values[module.layer_idx]
        if kp.stride(2) != key.stride(2) or vp.stride(2) != value.stride(2):
            raise ValueError("the decode kernel reads the prompts' region with the rows' position stride")
        row_prompt, prompt_strides = apart.row_prompt, (kp.stride(0), kp.stride(1))
    else:
        kp, vp, row_prompt, prompt_strides = key, value, part, (0, 0)
    strides = (query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2), value.stride(0),
               value.stride(1), value.stride(2), mask.stride(0), *prompt_strides)
    # Where rows are too few to fill the GPU the prefix is split instead, and groups of rows are small.
    prompts = _shared_prompts if splits == 1 else None
    if prompts is not None:
        # The prompt's positions once per group of rows, then each row's own (decode_step_state).
        k.decode_attention_prompt[(b, kv_heads)](
            query, key, value, kp, vp, row_prompt, mask, prompts.part, prompts.group_rows, prompts.width, *strides,
            scale, KV_HEADS=kv_heads, GROUP=group, G2=pow2(group), ROWS=max(1, 32 // pow2(group)), DIM=dim,
            BLOCK=KERNEL_BLOCK, APART=apart is not None)
    written = _written_at
    shape = dict(KV_HEADS=kv_heads, GROUP=group, G_P2=max(16, pow2(group)), DIM=dim)
    k.decode_attention[(b * kv_heads, splits)](
        query, key, value, kp, vp, row_prompt, mask, out, part, prompts.part if prompts else part,
        prompts.width if prompts else part, written if written is not None else part, *strides, out.stride(0),
        out.stride(2), attend, held, scale, BLOCK=KERNEL_BLOCK, SPLITS=splits, SHARED=prompts is not None,
        WRITTEN=written is not None, APART=apart is not None, **shape)
    if splits > 1:
        k.decode_attention_combine[(b * kv_heads,)](part, out, out.stride(0), out.stride(2), SPLITS=splits, **shape)
    return out, None


@dataclass
class SharedPrompts:
    """What the decode kernel needs to read a prompt's K/V once for all the rows that share it (the
    attempts of one prompt, consecutive rows whose buffer holds the same copy of its K/V): group_rows
    [rows] int32, a group's row count at its first row and 0 elsewhere; width [1] int32, the
    positions the prompts take (all of a call's prompts are left-padded to one width); part, float32
    room for each row's and head's attention over them. Device tensors, so that a captured step reads
    what the loop last wrote into them."""
    group_rows: torch.Tensor
    width: torch.Tensor
    part: torch.Tensor


@dataclass
class PromptsApart:
    """Where the decode kernel finds a row's prompt when the buffer holds each prompt's K/V once, apart
    from the rows (RowCache.set_layout with prompts): each layer's region of prompts, which prompt each
    row reads (row_prompt [rows] int32, on the device, kept through compactions) and the positions the
    prompts take, after which the rows' own begin."""
    keys: list
    values: list
    row_prompt: torch.Tensor
    held: int


# Set around a decode step's forward by the compact sampler (the attention interface passes no state
# of the caller's to kernel_decode_attention): the rows' shared prompts, where they share them; the
# position the step writes, a device scalar, when K, V and the mask span the whole buffer row; and the
# prompts' region, where the prompts are held apart.
_shared_prompts: SharedPrompts | None = None
_written_at: torch.Tensor | None = None
_prompts_apart: PromptsApart | None = None


class decode_step_state:
    """`with decode_step_state(prompts, written, apart):` the decode kernel reads the prompts' positions
    once per group (`prompts`; None: each row its own), the prefix up to the position `written` holds
    (None: all of K and V as given), and each row's prompt from the prompts' region (`apart`; None: K and
    V hold every position)."""

    def __init__(self, prompts: SharedPrompts | None, written: torch.Tensor | None = None,
                 apart: PromptsApart | None = None):
        self.state = prompts, written, apart

    def __enter__(self):
        global _shared_prompts, _written_at, _prompts_apart
        self.before = _shared_prompts, _written_at, _prompts_apart
        _shared_prompts, _written_at, _prompts_apart = self.state

    def __exit__(self, *exc):
        global _shared_prompts, _written_at, _prompts_apart
        _shared_prompts, _written_at, _prompts_apart = self.before


# Positions the decode kernel reads a block at a time.
KERNEL_BLOCK = 64
# The decode kernel reads a prompt once for the rows that share it while that pays for its second
# kernel: in calls whose prompts take at least SHARE_PROMPTS_FROM positions, while the live rows
# number at least SHARE_ROWS_PER_GROUP a prompt on average (rows end and the groups thin out).
SHARE_PROMPTS_FROM = 2 * KERNEL_BLOCK
SHARE_ROWS_PER_GROUP = 3
# The decode kernel holds a call's prompts apart from its rows where they take at least a block of its
# reads: a narrower prompt saves little room, and its own range of positions costs every row a block
# read of its own, most of a step's attention while the rows are short.
APART_FROM = KERNEL_BLOCK


def prefill_passes(lengths: list[int]) -> list[tuple[int, int]]:
    """The prefill's passes over prompts of these lengths, in order: (first, end), each as many prompts
    as PREFILL_TOKENS tokens hold (at least one)."""
    passes, i = [], 0
    while i < len(lengths):
        j, tokens = i + 1, lengths[i]
        while j < len(lengths) and tokens + lengths[j] <= PREFILL_TOKENS:
            tokens += lengths[j]
            j += 1
        passes.append((i, j))
        i = j
    return passes


def pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def kernel_splits(programs: int, attend: int, device: torch.device) -> int:
    """Splits of the prefix for the decode kernel: a power of two (each a compiled variant), enough that
    programs x splits fill the GPU's multiprocessors about twice, no more than the prefix has blocks."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    splits = 1
    while programs * splits < 2 * sms and splits * 2 <= -(-attend // KERNEL_BLOCK) and splits < 16:
        splits *= 2
    return splits


def decode_kernel_runs(config, device: torch.device) -> bool:
    """Whether kernel_decode_attention serves this model here: Triton present, on a GPU (or its
    interpreter), heads of a power of two from 16 to 256 (one block of the kernel)."""
    from stages.rl.fused_layers import kernels

    k = kernels()
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return (k is not None and (device.type == "cuda" or k.INTERPRETED) and 16 <= dim <= 256
            and dim == pow2(dim))


DECODE_ATTENTION = "syncrl_decode"
DECODE_KERNEL_ATTENTION = "syncrl_decode_kernel"
# Attended prefixes shorter than this go through decode_attention, longer ones through SDPA. The
# products win at short prefixes and lose at long ones step by step (tests/benchmarks/decode_step.py),
# but SDPA's cuDNN kernel builds a plan for every new shape as a graph is captured, which made the
# whole call slower with SDPA from short prefixes on (tests/benchmarks/generate_cache.py). Longer
# prefixes than measured keep SDPA, whose memory does not grow with rows x prefix as the products'
# float32 scores do; except with grouped-query attention, where HF's SDPA path (a mask is given)
# repeats K and V for every query group, a copy of the attended prefix larger than the products'
# scores, taken while the graph pools hold the rest.
MATMUL_ATTENTION_BELOW = 1024


class RowCache:
    """K/V of every layer in one preallocated buffer, viewed as [rows, kv_heads, length, head_dim]
    for the call in progress (set_layout), in the cache protocol the HF attention layers call
    (`update`). Before each forward the loop sets how many rows run, where the new positions are
    written and how much of the prefix attention reads; the layers get views of the buffer, which a
    CUDA graph can replay because their addresses never change within one layout."""

    is_compileable = False
    # The fused attention (stages/rl/fused_layers.py) hands update() its rotated K and V directly.
    takes_fused_layers = True

    def __init__(self, config, positions: int, dtype, layer_devices: list, shards: int = 1):
        heads = kv_heads(config) // shards  # a tensor-parallel model's layers hold their shard of the heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self._shape = (heads, head_dim)
        # Zeros, not empty: masked positions still enter the attention product, and stale memory could
        # hold NaN or inf, which a zero weight does not cancel (what earlier calls leave is finite). Each
        # layer's buffer lives where the layer does (a model spread over GPUs).
        self._keys = [torch.zeros(positions * heads * head_dim, dtype=dtype, device=d) for d in layer_devices]
        self._values = [torch.zeros_like(k) for k in self._keys]
        self.positions = positions
        devices = sorted(set(layer_devices), key=str)
        # Decode: the position written, on every device that holds layers.
        self._write_at = {d: torch.zeros(1, dtype=torch.long, device=d) for d in devices}
        self.write_at = self._write_at[layer_devices[0]]
        self._layer_devices = layer_devices
        # Prefill: the buffer row (held apart: the prompts' region) and position of each token, per device.
        self._prefill_at: dict = {}
        self.prefill_at: tuple | None = None
        self.set_layout(1, positions)

    def set_layout(self, rows: int, length: int, prompts: int = 0, width: int = 0) -> None:
        """View the buffer as `rows` rows of `length` positions (at most the positions it holds). With
        `prompts`, the first `width` positions of a row are its prompt's, held once for all of its rows
        in a region at the buffer's start (`prompt_keys`, `prompt_values`: [prompts, heads, width,
        head_dim]), and a row holds only positions width..length, after that region (prompts apart; the
        decode kernel's layout). The prompts' region stays in place when only the rows change."""
        held = width if prompts else 0  # positions of each row held in the prompts' region
        if rows * (length - held) + prompts * held > self.positions:
            raise ValueError(f"{rows} rows x {length} positions ({prompts} prompts of {width} held apart) exceed "
                             f"the buffer's {self.positions} positions")
        heads, head_dim = self._shape
        n = rows * heads * (length - held) * head_dim
        p = prompts * heads * held * head_dim
        self.prompt_keys = [k[:p].view(prompts, heads, held, head_dim) for k in self._keys]
        self.prompt_values = [v[:p].view(prompts, heads, held, head_dim) for v in self._values]
        self.keys = [k[p:p + n].view(rows, heads, length - held, head_dim) for k in self._keys]
        self.values = [v[p:p + n].view(rows, heads, length - held, head_dim) for v in self._values]
        self.rows, self.length, self.held = rows, length, held
        self.layout = (rows, length, prompts, held)
        self.active, self.attend = rows, length

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k, v = self.keys[layer_idx], self.values[layer_idx]
        device = self._layer_devices[layer_idx]
        if self.prefill_at is not None:  # packed prompts: key_states [1, heads, tokens, head_dim]
            rows, cols = self._prefill_at.setdefault(device, tuple(t.to(device) for t in self.prefill_at))
            if self.held:
                k, v = self.prompt_keys[layer_idx], self.prompt_values[layer_idx]
            k[rows, :, cols] = key_states[0].transpose(0, 1)
            v[rows, :, cols] = value_states[0].transpose(0, 1)
            return key_states, value_states
        k, v = k[:self.active], v[:self.active]
        k.index_copy_(2, self._write_at[device], key_states)
        v.index_copy_(2, self._write_at[device], value_states)
        return k[:, :, :self.attend - self.held], v[:, :, :self.attend - self.held]

    def widen_rows(self, rows: int, length: int, kept: int) -> None:
        """Lay the rows' region out again as `rows` rows of `length` positions, the prompts' region as it
        was, each of the first `rows` rows keeping its first `kept` positions of its own."""
        _, _, prompts, held = self.layout
        before = self.keys + self.values
        self.set_layout(rows, length, prompts, held)
        for old, new in zip(before, self.keys + self.values):
            new[:, :, :kept] = old[:rows, :, :kept].clone()  # the two layouts overlap: through a copy

    def set_prefill_at(self, rows: torch.Tensor | None, cols: torch.Tensor | None = None) -> None:
        """The prefill's K/V of each token goes to buffer row `rows[t]` (held apart: the prompts' region),
        position `cols[t]` (None: decode steps)."""
        self.prefill_at, self._prefill_at = (None if rows is None else (rows, cols)), {}

    def set_write_position(self, pos: int) -> None:
        """The next decode step writes position `pos` of every row (held apart: index pos - width of its own)."""
        for t in self._write_at.values():
            t.fill_(pos - self.held)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.write_at.item()) + self.held

    def nbytes(self) -> int:
        return 2 * sum(k.numel() * k.element_size() for k in self._keys)


class CompactDecoder:
    """Samples completions for batches of prompts; reuse one for every call of a stage, so that the
    buffer and the captured graphs are made once.

    `rows` is the most sequences decoded at once, `length` the longest row a sequence may need
    (buffer_length), `positions` the K/V positions the buffer holds (default rows x length; fewer
    makes rounds of shorter rows, see the module's docstring)."""

    def __init__(self, model, rows: int, length: int, cuda_graphs: bool = True, decode_attention: bool = True,
                 positions: int | None = None, decode_kernel: bool = True):
        check_supported(model.config)
        packing.register_packed_attention()  # the prefill's
        if decode_attention:
            from transformers import AttentionInterface

            AttentionInterface.register(DECODE_ATTENTION, globals()["decode_attention"])
            AttentionInterface.register(DECODE_KERNEL_ATTENTION, kernel_decode_attention)
        self.decode_attention = decode_attention
        # tuning.decode_kernel: the decode steps' attention as one Triton kernel, at every prefix length.
        self.decode_kernel = decode_attention and decode_kernel and decode_kernel_runs(
            model.config, next(model.parameters()).device)
        self._grouped = kv_heads(model.config) < model.config.num_attention_heads
        self.model = model
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.rows, self.length = rows, length
        self.positions = min(positions or rows * length, rows * length)
        if self.positions < length:
            raise ValueError(f"a buffer of {self.positions} positions cannot hold one row of {length}")
        self.vocab = model.get_output_embeddings().weight.shape[0]
        devices = layer_devices(model, self.device)
        if len(set(devices)) > 1:
            # The buffer follows each layer's device, but this path has not run on several GPUs yet.
            raise ValueError(f"generate.cache=compact has not been validated on a model spread over "
                             f"{len(set(devices))} GPUs (generate.gpus_per_process > 1): set generate.cache=static")
        self.cache = RowCache(model.config, self.positions, self.dtype, devices, tensor_parallel_size(model))
        # A model spread over GPUs runs its layers in turn on each: no one graph captures that.
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda" and len(set(devices)) == 1
        self._cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.ids = torch.zeros(rows, 1, dtype=torch.long, device=self.device)
        self.position_ids = torch.zeros(rows, 1, dtype=torch.long, device=self.device)
        self.mask = torch.zeros(rows, 1, 1, length, dtype=self.dtype, device=self.device)
        self.logits = torch.zeros(rows, self.vocab, dtype=torch.float32, device=self.device)
        # The attempts of a prompt decode in consecutive rows whose prompt K/V is one copy: the decode
        # kernel reads it once for all of them (SharedPrompts). Which group each row is in, to keep
        # the groups through compactions.
        self.prompts, self._share = None, False
        if self.decode_kernel:
            heads, dim = self.cache._shape
            group = model.config.num_attention_heads // kv_heads(model.config)
            self.prompts = SharedPrompts(torch.zeros(rows, dtype=torch.int32, device=self.device),
                                         torch.zeros(1, dtype=torch.int32, device=self.device),
                                         torch.empty(rows * heads * group * (dim + 2), dtype=torch.float32,
                                                     device=self.device))
            self.group_of_row = torch.zeros(rows, dtype=torch.long, device=self.device)
            # With the kernel each prompt's K/V is held once, apart from the rows: which one each row reads.
            self.row_prompt = torch.zeros(rows, dtype=torch.int32, device=self.device)
        # One graph per (buffer layout, rows decoded, attended prefix, prompts shared): a layout's views
        # have their own addresses and strides. The decode kernel's graphs leave the prefix out.
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pool = None
        self._stream = None
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.kv_per_position = kv_bytes_per_position(model.config, self.dtype)
        self.stats = DecodeStats(rows=rows)

    @torch.no_grad()
    def sample(self, prompts: list[list[int]], attempts: int, params: SamplingParams,
               generator: torch.Generator | None, record_logprobs: bool = False):
        """Completion ids per sequence, in prompt order, `attempts` consecutive sequences per prompt;
        with record_logprobs also each sampled token's log-prob under softmax(logits / T) at the
        decode step that drew it (the policy's, before any top-p truncation)."""
        n_seq = len(prompts) * attempts
        out_ids: list[list[int]] = [[] for _ in range(n_seq)]
        out_lp: list[list[float]] = [[] for _ in range(n_seq)]
        # Work by remaining new tokens: groups of sequences that share a prefix (a prompt's attempts;
        # a spilled sequence is a group of its own, its prefix the prompt and its tokens so far).
        work = {params.max_new_tokens: [(list(p), list(range(i * attempts, (i + 1) * attempts)))
                                        for i, p in enumerate(prompts)]}
        while work:
            remaining = max(work)
            groups = work.pop(remaining)
            self.stats.rounds += 1
            for call_groups, rows, length, held in self._plan(groups, remaining):
                seqs = [q for _, qs in call_groups for q in qs]
                ids, lps, spilled = self._call([p for p, _ in call_groups], [len(qs) for _, qs in call_groups],
                                               dataclasses.replace(params, max_new_tokens=remaining), generator,
                                               record_logprobs, rows, length, held)
                for q, i, lp in zip(seqs, ids, lps):
                    out_ids[q] += i
                    out_lp[q] += lp or []
                prefix_of = {q: p for p, qs in call_groups for q in qs}
                for j in spilled:
                    q = seqs[j]
                    work.setdefault(remaining - len(ids[j]), []).append((prefix_of[q] + ids[j], [q]))
        self.stats.new_tokens += sum(len(x) for x in out_ids)
        return (out_ids, out_lp) if record_logprobs else out_ids

    def holds_apart(self, width: int) -> bool:
        """Whether a call's prompts of `width` positions are held apart from its rows (APART_FROM)."""
        return self.decode_kernel and width >= APART_FROM

    def _plan(self, groups: list, remaining: int) -> list[tuple[list, int, int, int]]:
        """Calls for `groups`, each (its groups, rows, row length, the width of its prompts held apart from
        the rows, 0 where each row holds its prompt): all sequences at once in full-length
        rows when they fit; else at once in shorter rows when those give each sequence enough new
        tokens (MIN_ROUND_SHARE); else in calls of full-length rows, each as many as its width fits."""
        n = sum(len(qs) for _, qs in groups)
        width = max(len(p) for p, _ in groups)
        full = buffer_length(width, remaining)
        at_once = min(n, self.rows)
        calls = math.ceil(n / at_once)
        per_call = math.ceil(n / calls)
        # Held apart, a call's prompts take the widest one's width once each, its rows the rest.
        held = width if self.holds_apart(width) else 0
        room = self.positions - min(len(groups), per_call) * held
        length = min(full, held + LENGTH_STEP * (max(0, room) // per_call // LENGTH_STEP))
        if length == full and calls > 1 or \
                length < full and length - width < max(LENGTH_STEP, remaining * MIN_ROUND_SHARE):
            return self._calls_by_width(groups, remaining)
        chunks, current, size = [], [], 0
        # Shortest prefixes first: each call's rows are padded to its own longest prefix and every decode
        # step reads the K/V of that whole width, so calls of like lengths read less padding.
        for prefix, qs in sorted(groups, key=lambda g: len(g[0])):
            while qs:  # a prompt's attempts may go in two calls: each prefills the prompt
                take = qs[:per_call - size]
                current.append((prefix, take))
                size += len(take)
                qs = qs[len(take):]
                if size == per_call:
                    chunks.append((current, per_call, length, held))
                    current, size = [], 0
        if current:  # the same layout as the others: their graphs serve it
            chunks.append((current, per_call, length, held))
        return chunks

    def _calls_by_width(self, groups: list, remaining: int) -> list[tuple[list, int, int, int]]:
        """Calls of full-length rows, shortest prefixes first, each holding as many sequences as rows of
        its own longest prefix plus the new tokens fit: a call of short prompts then holds more of them
        than rows sized for the longest prompt of all would, so there are fewer calls, and each call
        reads the weights at every one of its steps. A call's rows are all its width fits (calls of one
        width share a layout, and with it their CUDA graphs)."""
        def rows_at(width: int, prompts: int) -> int:
            full = buffer_length(width, remaining)
            if not self.holds_apart(width):
                return min(self.rows, self.positions // full)
            return min(self.rows, (self.positions - prompts * width) // (full - width))  # prompts held apart

        chunks, current, size, width = [], [], 0, 0
        for prefix, qs in sorted(groups, key=lambda g: len(g[0])):
            while qs:  # a prompt's attempts may go in two calls: each prefills the prompt
                room = rows_at(max(width, len(prefix)), len(current) + 1) - size
                if room <= 0 and not current:
                    raise ValueError(f"not one row of a {len(prefix)}-token prefix and {remaining} new tokens fits "
                                     f"the buffer's {self.positions} positions")
                if room <= 0:  # this prefix would shorten the call below what it holds: the call is full
                    chunks.append((current, rows_at(width, len(current)), buffer_length(width, remaining),
                                   width if self.holds_apart(width) else 0))
                    current, size, width = [], 0, 0
                    continue
                take = qs[:room]
                current.append((prefix, take))
                size, width, qs = size + len(take), max(width, len(prefix)), qs[len(take):]
        if current:
            chunks.append((current, rows_at(width, len(current)), buffer_length(width, remaining),
                                   width if self.holds_apart(width) else 0))
        return chunks

    def _call(self, prefixes, counts, params: SamplingParams, generator, record_logprobs, rows: int, length: int,
              held: int = 0):
        """One batch of sequences through the buffer laid out as `rows` x `length`, with its prompts held
        apart at width `held` where that is not 0: (ids per sequence, log-probs per sequence or None,
        indices of the sequences whose row filled before they ended)."""
        n_seq = sum(counts)
        # Calls of one plan share the widest prompt's layout, the rows the positions after it.
        width = max(held, *(len(p) for p in prefixes))
        if width >= length or n_seq > rows:
            raise ValueError(f"{n_seq} sequences of prefix width {width} do not fit a layout of "
                             f"{rows} rows x {length} positions")
        # Held apart: each prompt's K/V once, in a region before the rows.
        self.cache.set_layout(rows, length, len(prefixes) if held else 0, width)
        st = self.stats
        st.calls += 1
        dev, n_new = self.device, params.max_new_tokens
        tokens = torch.full((n_seq, n_new), params.pad_token_id, dtype=torch.long, device=dev)
        logprobs = torch.zeros(n_seq, n_new, dtype=torch.float32, device=dev) if record_logprobs else None
        seq_of_row = torch.arange(n_seq, device=dev)  # which sequence each buffer row decodes; -1: none
        done = torch.zeros(n_seq, dtype=torch.bool, device=dev)
        results = torch.full((n_seq, n_new), params.pad_token_id, dtype=torch.long, device=dev)
        results_lp = torch.zeros_like(logprobs) if record_logprobs else None

        t0 = time.perf_counter()
        self._prefill(prefixes, counts, width)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)  # once a call: the prefill's own time, apart from the steps'
        t1 = time.perf_counter()
        st.prefill_s += t1 - t0
        b, spilled, full = n_seq, False, True
        longest = buffer_length(width, n_new)  # what a row of this call may need
        sizes = ladder(self.rows)
        for step in range(n_new):
            tok, lp = self._draw(b, params, generator, record_logprobs)
            tok = torch.where(done[:b], params.pad_token_id, tok)
            tokens[:b, step] = tok
            if record_logprobs:
                logprobs[:b, step] = lp
            done[:b] |= tok == params.eos_token_id
            live = int((~done[:b]).sum())  # the loop's one host sync per step
            if full and live < n_seq:
                full = False
                st.full_s += time.perf_counter() - t1
            if live == 0 or step == n_new - 1:
                break
            # Feed the drawn tokens back: written at position width + step, attending to all before it.
            pos = width + step
            smaller = [s for s in sizes if s >= live]
            if smaller[-1] < b:
                b = self._compact(b, smaller[-1], live, pos, done, seq_of_row, tokens, logprobs,
                                  results, results_lp)
            if pos >= length:  # the rows are full: longer rows where ended ones left room, else a later round
                if not self._widen(b, pos, longest):
                    spilled = True
                    break
                length = self.cache.length
            self.ids[:b, 0] = tokens[:b, step]
            self.mask[:b, 0, 0, pos] = 0
            self.cache.set_write_position(pos)
            attend = min(length, LENGTH_STEP * math.ceil((pos + 1) / LENGTH_STEP))
            self._forward(b, attend)
            self.position_ids[:b] += 1
            st.steps += 1
            st.decoded_positions += b
            st.kv_bytes_read += b * (pos + 1 if self.decode_kernel else attend) * self.kv_per_position
            st.weight_bytes_read += self.weight_bytes
        decode_s = time.perf_counter() - t1
        st.decode_s += decode_s
        if full:
            st.full_s += decode_s
        cut = []
        if spilled:
            live_rows = seq_of_row[:b][~done[:b]]
            cut = sorted(live_rows[live_rows >= 0].tolist())
        self._collect(slice(0, b), seq_of_row, tokens, logprobs, results, results_lp)
        ids_out, lp_out = [], []
        drawn = step + 1
        cut_set = set(cut)
        for q, (row, row_lp) in enumerate(zip(results.tolist(),
                                              results_lp.tolist() if record_logprobs else [None] * n_seq)):
            if q in cut_set:
                n = drawn
            else:
                n = row.index(params.eos_token_id) + 1 if params.eos_token_id in row else n_new
            ids_out.append(row[:n])
            lp_out.append(row_lp[:n] if row_lp is not None else None)
        st.spilled += len(cut)
        log.info("decoding call %d: %d sequences of width %d, %d steps, %d new tokens, %d spilled, in %.1fs "
                 "(prefill %.2fs; %d compactions, %d widenings, %d graphs so far)", st.calls, n_seq, width, drawn,
                 sum(len(x) for x in ids_out), len(cut), time.perf_counter() - t0, t1 - t0, st.compactions,
                 st.widenings, st.graphs)
        return ids_out, lp_out, cut

    def _prefill(self, prefixes, counts, width):
        """Every prefix's cache, left-padded to `width`, into its `counts` rows (consecutive), or once into
        the prompts' region where the layout holds them apart; the last position's logits into each
        row's logits."""
        apart = self.cache.held > 0
        n_prompt = len(prefixes)
        counts_t = torch.tensor(counts, device=self.device)
        pads = torch.tensor([width - len(p) for p in prefixes], device=self.device)
        real = torch.arange(width, device=self.device).unsqueeze(0) >= pads.unsqueeze(1)  # [n, width]: not padding
        first_rows = torch.cumsum(counts_t, 0) - counts_t
        neg = torch.finfo(self.dtype).min
        # The prompts run packed, one sequence of their tokens with the attention within each prompt
        # (packing.packed_attention): the padding that left-aligns them in the buffer is not computed.
        lengths = [len(p) for p in prefixes]
        lengths_t = torch.tensor(lengths, device=self.device)
        config = self.model.config
        before = config._attn_implementation
        config._attn_implementation = packing.ATTENTION
        try:
            with packing.offsets_required():
                for i, j in prefill_passes(lengths):
                    n = lengths_t[i:j]
                    ids = torch.tensor([t for p in prefixes[i:j] for t in p], device=self.device).unsqueeze(0)
                    cu = torch.nn.functional.pad(torch.cumsum(n, 0), (1, 0)).int()
                    # Each token's position within its own prompt.
                    at = torch.arange(ids.shape[1], device=self.device) - cu[:-1].repeat_interleave(n)
                    rows = torch.arange(i, j, device=self.device) if apart else first_rows[i:j]
                    self.cache.set_prefill_at(rows.repeat_interleave(n), at + pads[i:j].repeat_interleave(n))
                    packed = packing.model_kwargs(dict(position_ids=at.unsqueeze(0), cu_seq_lens=cu,
                                                       max_length=max(lengths[i:j])))
                    out = self.model(input_ids=ids, **{**packed, "use_cache": True}, logits_to_keep=cu[1:] - 1,
                                     **{self._cache_kw: self.cache})
                    self.logits[first_rows[i:j]] = out.logits[0].float()
        finally:
            config._attn_implementation = before
            self.cache.set_prefill_at(None)
        n_seq = sum(counts)
        if n_seq > n_prompt:  # each prefix's logits (and, in rows of their own, its cache) to its group's other rows
            source = first_rows.repeat_interleave(counts_t)
            if not apart:
                for k in self.cache.keys + self.cache.values:
                    k[:n_seq, :, :width] = k[source, :, :width]
            self.logits[:n_seq] = self.logits[source]
        if apart:
            self.row_prompt[:n_seq] = torch.arange(n_prompt, device=self.device).repeat_interleave(counts_t).int()
        self._share = self.prompts is not None and width >= SHARE_PROMPTS_FROM and \
            n_seq >= SHARE_ROWS_PER_GROUP * n_prompt
        if self.prompts is not None:
            self.group_of_row[:n_seq] = torch.arange(n_prompt, device=self.device).repeat_interleave(counts_t)
            self.prompts.group_rows.zero_()
            self.prompts.group_rows[first_rows] = counts_t.int()
            self.prompts.width.fill_(width)
        rows_real = real.repeat_interleave(counts_t, 0)
        self.mask[:n_seq].fill_(neg)
        self.mask[:n_seq, 0, 0, :width].masked_fill_(rows_real, 0)
        self.position_ids[:n_seq, 0] = (width - pads).repeat_interleave(counts_t)

    def _draw(self, b: int, params: SamplingParams, generator, with_logprobs: bool = False):
        """One token per row from softmax(logits / T), restricted to the top-p nucleus (HF's order:
        temperature, then top-p, which keeps at least the most likely token); with_logprobs also its
        log-prob under the untruncated softmax(logits / T), which is what train recomputes."""
        x = self.logits[:b]
        if params.temperature != 1.0:
            x = x / params.temperature
        scaled = x
        if params.top_p < 1.0:
            sorted_x, order = torch.sort(x, dim=-1, descending=False)
            cum = sorted_x.softmax(-1).cumsum(-1)
            drop_sorted = cum <= 1 - params.top_p
            drop_sorted[:, -1] = False
            x = x.masked_fill(drop_sorted.scatter(1, order, drop_sorted), float("-inf"))
        tok = torch.multinomial(x.softmax(-1), 1, generator=generator)
        if not with_logprobs:
            return tok.squeeze(1), None
        return tok.squeeze(1), scaled.gather(1, tok).squeeze(1) - torch.logsumexp(scaled, -1)

    def _forward(self, b: int, attend: int) -> None:
        if not self.cuda_graphs:
            self._step(b, attend)
            return
        graph = self.graphs.get(self._graph_key(b, attend))
        if graph is None:
            graph = self._capture(b, attend)
        graph.replay()

    def _graph_key(self, b: int, attend: int) -> tuple:
        # The decode kernel's steps read their prefix length on the GPU: one graph for all of them.
        return *self.cache.layout, b, 0 if self.decode_kernel else attend, self._share

    def _step(self, b: int, attend: int) -> None:
        config = self.model.config
        before = config._attn_implementation
        written, cache, apart = None, self.cache, None
        if cache.held:  # the kernel reads each row's prompt from the prompts' region
            apart = PromptsApart(cache.prompt_keys, cache.prompt_values, self.row_prompt, cache.held)
        if self.decode_kernel:
            # The kernel reads up to the written position itself: the layers get whole rows, and one
            # graph per batch size serves every prefix length.
            attend, written = cache.length, cache.write_at
            config._attn_implementation = DECODE_KERNEL_ATTENTION
        elif self.decode_attention and (attend < MATMUL_ATTENTION_BELOW or self._grouped):
            config._attn_implementation = DECODE_ATTENTION
        cache.active, cache.attend = b, attend
        try:
            with decode_step_state(self.prompts if self._share else None, written, apart):
                out = self.model(input_ids=self.ids[:b], position_ids=self.position_ids[:b],
                                 attention_mask=self.mask[:b, :, :, :attend], use_cache=True, logits_to_keep=1,
                                 **{self._cache_kw: cache})
        finally:
            config._attn_implementation = before
        self.logits[:b].copy_(out.logits[:, -1])

    def _capture(self, b: int, attend: int):
        t0 = time.perf_counter()
        if self._stream is None:
            # Kernels and library handles initialise on their first use, which a capture must not see.
            # The warm-up step writes at the current position, which the replay writes again.
            self._stream = torch.cuda.Stream(self.device)
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                self._step(b, attend)
            torch.cuda.current_stream().wait_stream(self._stream)
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # capture_begin/end rather than torch.cuda.graph(), which collects garbage and empties the
        # allocator's cache before every capture (slow with a stage's heap). One memory pool for
        # all graphs: they never run at once, and each keeps nothing past its replay (the logits go
        # to the decoder's own buffer).
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            graph.capture_begin(pool=self._pool)
            try:
                self._step(b, attend)
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(self._stream)
        self.graphs[self._graph_key(b, attend)] = graph
        self.stats.graphs += 1
        self.stats.graph_capture_s += time.perf_counter() - t0
        return graph

    def _widen(self, b: int, written: int, longest: int) -> bool:
        """The rows are full at position `written`. Where the prompts are held apart and rows have ended,
        lay the rows' region out again as `b` rows as long as it allows (at most `longest`): the sequences
        go on in this call instead of spilling into a later round, whose prefill would compute their K/V
        again. False where no longer row fits."""
        rows, length, _, held = self.cache.layout
        new_length = min(longest, held + rows * (length - held) // b)
        if not held or new_length <= written:
            return False
        self.cache.widen_rows(b, new_length, written - held)
        self.stats.widenings += 1
        return True

    def _compact(self, b, new_b, live, written, done, seq_of_row, tokens, logprobs, results, results_lp) -> int:
        """Move the live rows to the front of every buffer and decode `new_b` rows from now on."""
        keep = torch.nonzero(~done[:b]).squeeze(1)
        finished = torch.nonzero(done[:b]).squeeze(1)
        self._collect(finished, seq_of_row, tokens, logprobs, results, results_lp)
        own = written - self.cache.held  # positions the rows hold themselves (held apart: after the prompts)
        for k in self.cache.keys + self.cache.values:
            k[:live, :, :own] = k[keep, :, :own]
        if self.cache.held:
            self.row_prompt[:live] = self.row_prompt[keep]
            self.row_prompt[live:new_b] = 0  # a padding row reads some prompt; its output is never collected
        for buf in (self.position_ids, self.mask, self.logits, tokens, seq_of_row, done) + \
                ((logprobs,) if logprobs is not None else ()):
            buf[:live] = buf[keep]
        # Rows past the live ones are padding: decoded, never collected.
        seq_of_row[live:new_b] = -1
        done[live:new_b] = True
        if self.prompts is not None:  # the live rows keep their order: a group's rows stay consecutive
            groups = self.group_of_row
            groups[:live] = groups[keep]
            groups[live:new_b] = -1 - torch.arange(new_b - live, device=groups.device)  # each a group of its own
            leads = torch.ones(new_b, dtype=torch.bool, device=groups.device)
            leads[1:] = groups[1:new_b] != groups[:new_b - 1]
            starts = torch.nonzero(leads).squeeze(1)
            sizes = torch.diff(starts, append=torch.tensor([new_b], device=groups.device))
            self.prompts.group_rows.zero_()
            self.prompts.group_rows[starts] = sizes.int()
            self._share = self._share and live >= SHARE_ROWS_PER_GROUP * int((starts < live).sum())
        self.stats.compactions += 1
        return new_b

    @staticmethod
    def _collect(rows, seq_of_row, tokens, logprobs, results, results_lp) -> None:
        seqs = seq_of_row[rows]
        valid = seqs >= 0
        results[seqs[valid]] = tokens[rows][valid]
        if logprobs is not None:
            results_lp[seqs[valid]] = logprobs[rows][valid]
