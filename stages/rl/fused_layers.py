"""Fewer, larger kernels in the decoder layers' attention and MLP (tuning.fused_layers).

A train step spends a large share of its layers' GPU time outside matrix products and attention
(docs/benchmarks.md): HF's rotary embedding is ten elementwise kernels a layer forward (five
for each of queries and keys, on transposed views that do not vectorize) and more backward, and
SiLU-times-up three more, each reading and writing a full activation (docs/benchmarks.md). Here:
  - q, k and v come from one matrix product with the three weights concatenated (the activations are
    read once; backward, one product for the input's gradient instead of three and two sums);
  - one Triton kernel rotates q and k and lays q, k and v out contiguous, as the attention takes them,
    and one writes the three gradients back into the product's layout;
  - gate and up likewise come from one product, and one kernel each way computes SiLU(gate) * up and
    its two gradients, in float32, from the product's output alone.
The parameters, their names and the checkpoint stay HF's. Where the weights lie back to back in one
buffer, as DeepSpeed's ZeRO 1-2 lays a module's parameters out in the order they were registered
(q, k, v; gate, up), the concatenation is a view of that buffer; fuse_layers lays out a model it
routes the same way (joined_layout). Either way its backward hands each weight its own slice.

The fused forward runs where the kernels run (CUDA, or Triton's interpreter on the host for the
tests: TRITON_INTERPRET=1 set before the first use), for a whole-sequence pass (training and log-prob
passes) and for the compact sampler's prefill and decode steps, whose cache takes the rotated K and V
as they come; a cache of HF's takes HF's own forward. ZeRO-3 gathers a module's
weights when that module is called, which the concatenation bypasses: fuse_layers leaves a
partitioned model alone.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import sys
import types

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# Attention classes whose forward is Llama's (q/k/v/o projections, biases or not, the rotary embedding
# from position_embeddings, no norm on q or k) and MLP classes computing down(act(gate(x)) * up(x)).
ATTENTION = {"LlamaAttention", "Qwen2Attention", "MistralAttention"}
MLP = {"LlamaMLP", "Qwen2MLP", "MistralMLP"}
SILU = {"silu", "swish"}


def fuse_layers(model) -> int:
    """Route the forward of `model`'s attention and MLP modules of ATTENTION and MLP through the fused
    one (HF's where it does not apply); returns how many modules. Needs Triton where the model runs
    on CUDA."""
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        log.info("tuning.fused_layers: the model is partitioned (ZeRO-3), its layers run HF's forward")
        return 0
    if any(p.is_cuda for p in model.parameters()) and importlib.util.find_spec("triton") is None:
        raise RuntimeError("tuning.fused_layers needs Triton on a GPU (it comes with torch's CUDA wheels: "
                           "pip install triton), or set tuning.fused_layers=false")
    n = 0
    for module in model.modules():
        name = type(module).__name__
        if name in ATTENTION and hasattr(module, "q_proj"):
            module.forward = types.MethodType(_attention_forward, module)
            joined_layout([module.q_proj, module.k_proj, module.v_proj])
            n += 1
        elif name in MLP and getattr(module.config, "hidden_act", None) in SILU:
            module.forward = types.MethodType(_mlp_forward, module)
            joined_layout([module.gate_proj, module.up_proj])
            n += 1
    return n


def joined_layout(linears: list) -> None:
    """Lay the weights (and biases) of `linears` back to back in one storage, in this order, so that
    joined() takes a view of them instead of copying them at every forward: a model loaded from its
    files holds each apart, and generate's decode steps would copy the MLP's gate and up weights at
    every step, more bytes than the step reads otherwise. Each keeps its values; DeepSpeed's ZeRO 1-2
    later move them into a buffer of their own, in the same order."""
    for attr in ("weight", "bias"):
        params = [getattr(m, attr) for m in linears]
        if params[0] is None or adjacent([p.data for p in params]):
            continue
        with torch.no_grad():
            buffer = torch.cat([p.data for p in params])
        for p, part in zip(params, buffer.split([p.shape[0] for p in params])):
            p.data = part


def _runs_here(x: torch.Tensor) -> bool:
    k = kernels()
    return k is not None and (x.is_cuda or k.INTERPRETED)


CACHE_KEYS = ("cache", "past_key_values", "past_key_value")


def _attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, *args, **kwargs):
    cache = next((kwargs[k] for k in CACHE_KEYS if kwargs.get(k) is not None), None)
    # A cache of HF's takes HF's forward; the compact sampler's (stages/rl/decoding.py, RowCache) takes
    # the rotated K and V as they come, so its prefill and decode steps run the fused layers too.
    own_cache = cache is None or getattr(cache, "takes_fused_layers", False)
    if args or not own_cache or position_embeddings is None or not _runs_here(hidden_states):
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, *args, **kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k not in CACHE_KEYS}
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    heads, kv_heads = self.q_proj.out_features // self.head_dim, self.k_proj.out_features // self.head_dim
    projections = (self.q_proj, self.k_proj, self.v_proj)
    bias = joined([p.bias for p in projections]) if self.q_proj.bias is not None else None
    qkv = F.linear(hidden_states, joined([p.weight for p in projections]), bias)
    cos, sin = position_embeddings
    q, k, v = RotaryQKV.apply(qkv, cos, sin, heads, kv_heads, self.head_dim)  # each [B, T, heads, D]
    k, v = k.transpose(1, 2), v.transpose(1, 2)
    if cache is not None:
        k, v = cache.update(k, v, self.layer_idx)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, None)
    if attention is None:
        from transformers.models.llama.modeling_llama import eager_attention_forward as attention
    if getattr(self, "sliding_window", None) is not None:
        kwargs["sliding_window"] = self.sliding_window
    out, weights = attention(self, q.transpose(1, 2), k, v, attention_mask,
                             dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling,
                             **kwargs)
    return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights


def _mlp_forward(self, x):
    if not _runs_here(x):
        return type(self).forward(self, x)
    bias = joined([self.gate_proj.bias, self.up_proj.bias]) if self.gate_proj.bias is not None else None
    gate_up = F.linear(x, joined([self.gate_proj.weight, self.up_proj.weight]), bias)
    return self.down_proj(SwiGLU.apply(gate_up))


def joined(tensors: list) -> torch.Tensor:
    """torch.cat(tensors) (along the first dimension): a view where they lie back to back in one
    storage, else a copy."""
    return _Adjacent.apply(*tensors) if adjacent(tensors) else torch.cat(tensors)


def adjacent(tensors: list) -> bool:
    """Whether `tensors` (contiguous, of one dtype and the same trailing shape) lie back to back in
    one storage, in this order."""
    first = tensors[0]
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for t in tensors:
        if (not t.is_contiguous() or t.dtype != first.dtype or t.shape[1:] != first.shape[1:]
                or t.untyped_storage().data_ptr() != storage or t.storage_offset() != offset):
            return False
        offset += t.numel()
    return True


class _Adjacent(torch.autograd.Function):
    """Adjacent tensors as the one tensor they span; its gradient split back into theirs."""

    @staticmethod
    def forward(ctx, *tensors):
        ctx.rows = [t.shape[0] for t in tensors]
        first = tensors[0]
        return first.as_strided((sum(ctx.rows), *first.shape[1:]), first.stride(), first.storage_offset())

    @staticmethod
    def backward(ctx, grad):
        return grad.split(ctx.rows)


class RotaryQKV(torch.autograd.Function):
    """[B, T, (H + 2 Hkv) D] -> q [B, T, H, D] and k [B, T, Hkv, D] rotated (HF's q * cos +
    rotate_half(q) * sin, cos and sin [B, T, D]) and v [B, T, Hkv, D], each contiguous."""

    @staticmethod
    def forward(ctx, qkv, cos, sin, heads: int, kv_heads: int, dim: int):
        qkv = qkv.contiguous()
        b, t = qkv.shape[:2]
        q = qkv.new_empty(b, t, heads, dim)
        k, v = qkv.new_empty(b, t, kv_heads, dim), qkv.new_empty(b, t, kv_heads, dim)
        cos, sin = _rows(cos, b, t), _rows(sin, b, t)
        _launch_rotary(qkv, q, k, v, cos, sin, heads, kv_heads, dim, backward=False)
        ctx.save_for_backward(cos, sin)
        ctx.shape = heads, kv_heads, dim
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        heads, kv_heads, dim = ctx.shape
        b, t = cos.shape[:2]
        # An output nobody used has no gradient: zeros of its shape.
        dq, dk, dv = (cos.new_zeros(b, t, n, dim) if g is None else g.contiguous()
                      for g, n in ((dq, heads), (dk, kv_heads), (dv, kv_heads)))
        dqkv = dq.new_empty(b, t, (heads + 2 * kv_heads) * dim)
        _launch_rotary(dqkv, dq, dk, dv, cos, sin, heads, kv_heads, dim, backward=True)
        return dqkv, None, None, None, None, None


def _rows(x: torch.Tensor, b: int, t: int) -> torch.Tensor:
    """cos or sin as a contiguous [B, T, D] (HF's rotary module gives [1 or B, T, D])."""
    return x.expand(b, t, x.shape[-1]).contiguous()


def _launch_rotary(qkv, q, k, v, cos, sin, heads, kv_heads, dim, backward: bool):
    if dim % 2:
        raise ValueError(f"tuning.fused_layers: the rotary embedding rotates halves of each head; this model's head "
                         f"size is {dim}: set tuning.fused_layers=false")
    rows = qkv.shape[0] * qkv.shape[1]
    kernels().rotary[(rows,)](qkv, q, k, v, cos, sin, HEADS=heads, KV_HEADS=kv_heads,
                              HEADS_P2=_pow2(heads), KV_P2=_pow2(kv_heads), HALF=dim // 2, HALF_P2=_pow2(dim // 2),
                              BACKWARD=backward)


class SwiGLU(torch.autograd.Function):
    """[..., 2I] (gate, then up) -> SiLU(gate) * up [..., I], computed in float32."""

    @staticmethod
    def forward(ctx, gate_up):
        gate_up = gate_up.contiguous()
        width = gate_up.shape[-1] // 2
        out = gate_up.new_empty(*gate_up.shape[:-1], width)
        _launch_swiglu(gate_up, out, None, width)
        ctx.save_for_backward(gate_up)
        return out

    @staticmethod
    def backward(ctx, grad):
        (gate_up,) = ctx.saved_tensors
        d_gate_up = torch.empty_like(gate_up)
        _launch_swiglu(gate_up, grad.contiguous(), d_gate_up, gate_up.shape[-1] // 2)
        return d_gate_up


def _launch_swiglu(gate_up, out_or_grad, d_gate_up, width: int):
    rows = gate_up.numel() // (2 * width)
    block = min(1024, _pow2(width))
    k = kernels()
    if d_gate_up is None:
        k.swiglu[(rows, -(-width // block))](gate_up, out_or_grad, width, BLOCK=block)
    else:
        k.swiglu_backward[(rows, -(-width // block))](gate_up, out_or_grad, d_gate_up, width, BLOCK=block)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.cache
def kernels():
    """stages/rl/fused_kernels.py, imported at first use and anew after kernels.cache_clear() (Triton
    reads TRITON_INTERPRET as it defines a kernel); None where Triton is not installed."""
    if importlib.util.find_spec("triton") is None:
        return None
    sys.modules.pop("stages.rl.fused_kernels", None)
    return importlib.import_module("stages.rl.fused_kernels")
