"""The Triton kernels of stages/rl/fused_layers.py: the rotary embedding with q, k and v laid out for
the attention, and SiLU(gate) * up, each forward and backward; and the compact sampler's decode-step
attention (stages/rl/decoding.py, tuning.decode_kernel). Imported through
fused_layers.kernels() only (Triton is not needed elsewhere)."""

import os

import triton
import triton.language as tl

# Set when the kernels were defined under Triton's interpreter (on the host, for the tests). The
# kernels call no function of triton.language's own @jit library (tl.sigmoid, tl.max, tl.zeros and the
# like): those are interpreted only when Triton itself was imported with TRITON_INTERPRET set.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def rotate_heads(fused, own, c1, c2, s1, s2, d, N: tl.constexpr, N_P2: tl.constexpr, HALF: tl.constexpr,
                 ROTATE: tl.constexpr, BACKWARD: tl.constexpr):
    # One position's N heads: `fused` in the product's layout, `own` in [B, T, N, D]. Forward reads
    # fused and writes own; backward reads own's gradient and writes fused's.
    h = tl.arange(0, N_P2)[:, None]
    mask = (h < N) & (d[None, :] < HALF)
    fused = fused + h * 2 * HALF + d[None, :]
    own = own + h * 2 * HALF + d[None, :]
    if BACKWARD:
        src, out = own, fused
    else:
        src, out = fused, own
    x1 = tl.load(src, mask=mask).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask).to(tl.float32)
    if ROTATE:
        if BACKWARD:  # the rotation's transpose
            y1 = x1 * c1[None, :] + x2 * s2[None, :]
            y2 = x2 * c2[None, :] - x1 * s1[None, :]
        else:  # x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1)
            y1 = x1 * c1[None, :] - x2 * s1[None, :]
            y2 = x2 * c2[None, :] + x1 * s2[None, :]
    else:
        y1 = x1
        y2 = x2
    tl.store(out, y1.to(out.dtype.element_ty), mask=mask)
    tl.store(out + HALF, y2.to(out.dtype.element_ty), mask=mask)

@triton.jit
def rotary(qkv, q, k, v, cos, sin, HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEADS_P2: tl.constexpr,
           KV_P2: tl.constexpr, HALF: tl.constexpr, HALF_P2: tl.constexpr, BACKWARD: tl.constexpr):
    # One program per position: its cos and sin, then every head of q and of k, and v's copy.
    row = tl.program_id(0).to(tl.int64)
    dim = 2 * HALF
    fused = qkv + row * (HEADS + 2 * KV_HEADS) * dim
    d = tl.arange(0, HALF_P2)
    half = d < HALF
    c1 = tl.load(cos + row * dim + d, mask=half).to(tl.float32)
    c2 = tl.load(cos + row * dim + HALF + d, mask=half).to(tl.float32)
    s1 = tl.load(sin + row * dim + d, mask=half).to(tl.float32)
    s2 = tl.load(sin + row * dim + HALF + d, mask=half).to(tl.float32)
    rotate_heads(fused, q + row * HEADS * dim, c1, c2, s1, s2, d, HEADS, HEADS_P2, HALF, True, BACKWARD)
    rotate_heads(fused + HEADS * dim, k + row * KV_HEADS * dim, c1, c2, s1, s2, d, KV_HEADS, KV_P2, HALF,
                 True, BACKWARD)
    rotate_heads(fused + (HEADS + KV_HEADS) * dim, v + row * KV_HEADS * dim, c1, c2, s1, s2, d, KV_HEADS,
                 KV_P2, HALF, False, BACKWARD)

@triton.jit
def swiglu(gate_up, out, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    g = tl.load(gate_up + row * 2 * width + cols, mask=mask).to(tl.float32)
    u = tl.load(gate_up + row * 2 * width + width + cols, mask=mask).to(tl.float32)
    y = g / (1 + tl.exp(-g)) * u
    tl.store(out + row * width + cols, y.to(out.dtype.element_ty), mask=mask)

@triton.jit
def swiglu_backward(gate_up, grad, d_gate_up, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    g = tl.load(gate_up + row * 2 * width + cols, mask=mask).to(tl.float32)
    u = tl.load(gate_up + row * 2 * width + width + cols, mask=mask).to(tl.float32)
    dy = tl.load(grad + row * width + cols, mask=mask).to(tl.float32)
    s = 1 / (1 + tl.exp(-g))
    # d/dg [g * s(g)] = s + g * s * (1 - s)
    dg = dy * u * s * (1 + g * (1 - s))
    du = dy * g * s
    dtype = d_gate_up.dtype.element_ty
    tl.store(d_gate_up + row * 2 * width + cols, dg.to(dtype), mask=mask)
    tl.store(d_gate_up + row * 2 * width + width + cols, du.to(dtype), mask=mask)

@triton.jit
def _max_of(a, b):
    return tl.maximum(a, b)


@triton.jit
def _sum_of(a, b):
    return a + b


# The combine functions of the reductions: Triton's own where it has them, which its interpreter (the
# tests on the host) runs as one numpy reduction, where it runs any other one element at a time.
# Compiled, either is the same maximum and sum.
max_of = getattr(tl.standard, "_elementwise_max", _max_of)
sum_of = getattr(tl.standard, "_sum_combine", _sum_of)


@triton.jit
def attend_positions(queries, keys_at, values_at, bias_at, s_kl, s_vl, start, end, scale, m, total, acc, d,
                     BLOCK: tl.constexpr):
    # Positions [start, end) of one row's K/V for one head (keys_at, values_at: its first position;
    # bias_at: the row's mask) folded into the running softmax (m, total, acc) of `queries`. The mask
    # first (two bytes a position against the K/V's thousands): a block it masks whole (the row's left
    # padding, positions not yet written) is not read.
    for n0 in range(start, end, BLOCK):
        n = n0 + tl.arange(0, BLOCK)
        inside = n < end
        bias = tl.load(bias_at + n, mask=inside, other=-1e30).to(tl.float32)
        if tl.reduce(bias, 0, max_of) > -1e29:
            keys = tl.load(keys_at + n[:, None] * s_kl + d[None, :], mask=inside[:, None], other=0.0)
            s = tl.dot(queries, tl.trans(keys)) * scale
            s = tl.where(inside[None, :], tl.maximum(s + bias[None, :], -1e30), -1e30)
            m_new = tl.maximum(m, tl.reduce(s, 1, max_of))
            p = tl.where(inside[None, :], tl.exp(s - m_new[:, None]), 0.0)
            alpha = tl.exp(m - m_new)
            total = total * alpha + tl.reduce(p, 1, sum_of)
            values = tl.load(values_at + n[:, None] * s_vl + d[None, :], mask=inside[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values)
            m = m_new
    return m, total, acc


@triton.jit
def decode_attention(q, k, v, kp, vp, row_prompt, mask, out, part, prompt_part, prompt_width, written, s_qb, s_qh,
                     s_kb, s_kh, s_kl, s_vb, s_vh, s_vl, s_mb, s_pb, s_ph, s_ob, s_oh, attend, held, scale,
                     KV_HEADS: tl.constexpr, GROUP: tl.constexpr, G_P2: tl.constexpr, DIM: tl.constexpr,
                     BLOCK: tl.constexpr, SPLITS: tl.constexpr, SHARED: tl.constexpr, WRITTEN: tl.constexpr,
                     APART: tl.constexpr):
    # One program per (row, K/V head, split of the prefix): the GROUP query heads that share the K/V head
    # attend together, so each K/V block is read once for all of them. Scores are float32 and stay
    # finite (floored at -1e30): a split whose positions are all masked (a row's left padding) ends
    # with a maximum of -1e30 and a sum of 0, and combine() weighs it by exp(-1e30 - max) = 0.
    # SHARED (with one split): decode_attention_prompt has attended over the first prompt_width positions
    # (the prompt, the same for a group of rows); this program goes on from its result over the rest.
    # WRITTEN: the prefix ends after the position `written` holds (a device scalar the sampler sets each
    # step, so one captured step serves every prefix length); `attend` is then only the buffer's length.
    # APART: the first `held` positions of a row are its prompt's, row_prompt[row] of the prompts' region
    # (kp, vp: [prompts, KV_HEADS, held, DIM]); k and v hold the row's own positions from `held` on, and
    # `written` indexes them.
    bh = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    row = bh // KV_HEADS
    head = bh % KV_HEADS
    g = tl.arange(0, G_P2)
    d = tl.arange(0, DIM)
    queries = tl.load(q + row * s_qb + (head * GROUP + g)[:, None] * s_qh + d[None, :], mask=(g < GROUP)[:, None],
                      other=0.0)
    if SHARED:
        lo = tl.load(prompt_width)
        base = prompt_part + (bh * GROUP + g) * (DIM + 2)
        m = tl.load(base + DIM, mask=g < GROUP, other=-1e30)
        total = tl.load(base + DIM + 1, mask=g < GROUP, other=0.0)
        acc = tl.load(base[:, None] + d[None, :], mask=(g < GROUP)[:, None], other=0.0)
    else:
        lo = 0
        m = tl.full([G_P2], -1e30, tl.float32)
        total = tl.full([G_P2], 0.0, tl.float32)
        acc = tl.full([G_P2, DIM], 0.0, tl.float32)
    if WRITTEN:
        attend = tl.load(written).to(tl.int32) + 1 + held
    chunk = BLOCK * ((attend - lo + SPLITS * BLOCK - 1) // (SPLITS * BLOCK))
    start = lo + split * chunk
    end = tl.minimum(start + chunk, attend)
    if APART:
        pr = tl.load(row_prompt + row).to(tl.int64)
        m, total, acc = attend_positions(queries, kp + pr * s_pb + head * s_ph, vp + pr * s_pb + head * s_ph,
                                         mask + row * s_mb, s_kl, s_vl, start, tl.minimum(end, held), scale, m, total,
                                         acc, d, BLOCK)
        # The row's own positions: its buffer row's index 0 is position `held`.
        m, total, acc = attend_positions(queries, k + row * s_kb + head * s_kh - held * s_kl,
                                         v + row * s_vb + head * s_vh - held * s_vl, mask + row * s_mb, s_kl, s_vl,
                                         tl.maximum(start, held), end, scale, m, total, acc, d, BLOCK)
    else:
        m, total, acc = attend_positions(queries, k + row * s_kb + head * s_kh, v + row * s_vb + head * s_vh,
                                         mask + row * s_mb, s_kl, s_vl, start, end, scale, m, total, acc, d, BLOCK)
    if SPLITS == 1:
        o = acc / total[:, None]
        tl.store(out + row * s_ob + (head * GROUP + g)[:, None] * s_oh + d[None, :], o.to(out.dtype.element_ty),
                 mask=(g < GROUP)[:, None])
    else:
        # part: [rows x KV_HEADS, SPLITS, G_P2, DIM + 2] float32: the unnormalised output, its max, its sum.
        base = part + ((bh * SPLITS + split) * G_P2 + g) * (DIM + 2)
        tl.store(base[:, None] + d[None, :], acc)
        tl.store(base + DIM, m)
        tl.store(base + DIM + 1, total)


@triton.jit
def decode_attention_prompt(q, k, v, kp, vp, row_prompt, mask, prompt_part, group_rows, prompt_width, s_qb, s_qh,
                            s_kb, s_kh, s_kl, s_vb, s_vh, s_vl, s_mb, s_pb, s_ph, scale, KV_HEADS: tl.constexpr,
                            GROUP: tl.constexpr, G2: tl.constexpr, ROWS: tl.constexpr, DIM: tl.constexpr,
                            BLOCK: tl.constexpr, APART: tl.constexpr):
    # One program per (row, K/V head). A row that leads a group of consecutive rows (group_rows[row] > 0:
    # a prompt's attempts, whose buffer rows hold the same copy of the prompt's K/V) attends for all of
    # them over the prompt's positions, ROWS rows x GROUP heads of queries at a time, so each K/V block
    # of the prompt is read once for the group instead of once a row; the other programs have nothing
    # to do. Each row's unnormalised output, maximum and sum go to prompt_part for decode_attention.
    # APART: the group's prompt is row_prompt[row] of the prompts' region (decode_attention's APART).
    row0 = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    count = tl.load(group_rows + row0)
    width = tl.load(prompt_width)
    if APART:
        pr = tl.load(row_prompt + row0).to(tl.int64)
        keys_at = kp + pr * s_pb + head * s_ph
        values_at = vp + pr * s_pb + head * s_ph
    else:
        keys_at = k + row0 * s_kb + head * s_kh
        values_at = v + row0 * s_vb + head * s_vh
    i = tl.arange(0, ROWS * G2)
    r = i // G2
    g = i % G2
    d = tl.arange(0, DIM)
    for r0 in range(0, count, ROWS):
        lane = (r0 + r < count) & (g < GROUP)
        rows = row0 + r0 + r
        queries = tl.load(q + rows[:, None] * s_qb + (head * GROUP + g)[:, None] * s_qh + d[None, :],
                          mask=lane[:, None], other=0.0)
        m = tl.full([ROWS * G2], -1e30, tl.float32)
        total = tl.full([ROWS * G2], 0.0, tl.float32)
        acc = tl.full([ROWS * G2, DIM], 0.0, tl.float32)
        m, total, acc = attend_positions(queries, keys_at, values_at, mask + row0 * s_mb, s_kl, s_vl, 0, width, scale,
                                         m, total, acc, d, BLOCK)
        base = prompt_part + ((rows * KV_HEADS + head) * GROUP + g) * (DIM + 2)
        tl.store(base[:, None] + d[None, :], acc, mask=lane[:, None])
        tl.store(base + DIM, m, mask=lane)
        tl.store(base + DIM + 1, total, mask=lane)


@triton.jit
def decode_attention_combine(part, out, s_ob, s_oh, KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                             G_P2: tl.constexpr, DIM: tl.constexpr, SPLITS: tl.constexpr):
    # One program per (row, K/V head): the splits' partial outputs weighed by exp(their max - the max).
    bh = tl.program_id(0).to(tl.int64)
    row = bh // KV_HEADS
    head = bh % KV_HEADS
    g = tl.arange(0, G_P2)
    d = tl.arange(0, DIM)
    first = part + (bh * SPLITS * G_P2 + g) * (DIM + 2)
    m = tl.load(first + DIM)
    for i in range(1, SPLITS):
        m = tl.maximum(m, tl.load(first + i * G_P2 * (DIM + 2) + DIM))
    total = tl.full([G_P2], 0.0, tl.float32)
    acc = tl.full([G_P2, DIM], 0.0, tl.float32)
    for i in range(SPLITS):
        base = first + i * G_P2 * (DIM + 2)
        w = tl.exp(tl.load(base + DIM) - m)
        total += tl.load(base + DIM + 1) * w
        acc += tl.load(base[:, None] + d[None, :]) * w[:, None]
    o = acc / total[:, None]
    tl.store(out + row * s_ob + (head * GROUP + g)[:, None] * s_oh + d[None, :], o.to(out.dtype.element_ty),
             mask=(g < GROUP)[:, None])
