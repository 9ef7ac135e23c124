"""The Triton kernels of stages/rl/fused_layers.py: the rotary embedding with q, k and v laid out for
the attention, and SiLU(gate) * up, each forward and backward. Imported through
fused_layers.kernels() only (Triton is not needed elsewhere)."""

import os

import triton
import triton.language as tl

# Set when the kernels were defined under Triton's interpreter (on the host, for the tests). The
# kernels call no function of triton.language's own @jit library (tl.sigmoid and the like): those are
# interpreted only when Triton itself was imported with TRITON_INTERPRET set.
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
