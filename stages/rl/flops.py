"""Model FLOPs for MFU: what a dense decoder's matrix multiplies cost, independent of how they ran.

Per sequence of s tokens, one forward pass costs
    2 * N * s  +  4 * L * d * s^2
with N the parameters that multiply activations (every weight except the input embedding; the output
projection counts even when tied to the embedding), L layers and d = heads x head size: the second
term is the attention scores and their weighted sum, counted without the causal half, as the usual
PaLM-style convention does. Backward costs twice the forward, so a training step is 3x. Recomputation
(gradient checkpointing) is not model work and is not counted.
"""

from __future__ import annotations

# Dense bf16 peak FLOP/s per GPU (datasheets), by device-name fragment.
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}

FORMULA = ("MFU = model FLOPs / (seconds x GPUs x peak); per sequence of s tokens, forward = 2*N*s + 4*L*d*s^2, "
           "training = 3 x forward (+ 1 x forward of the frozen reference when kl_coef > 0)")


def peak_flops(device_name: str) -> float | None:
    return next((v for k, v in PEAK_FLOPS.items() if k in device_name), None)


def model_shape(model) -> dict:
    """N, L and d of an HF causal LM (ZeRO-3 partitioned parameters are counted whole)."""
    def numel(p):
        return getattr(p, "ds_numel", None) or p.numel()

    cfg = model.config
    embed = model.get_input_embeddings().weight
    params = sum(numel(p) for p in model.parameters())
    n = params - numel(embed)
    if getattr(cfg, "tie_word_embeddings", False):
        n += numel(embed)  # the tied output projection is still a full matmul per token
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return {"n": n, "layers": cfg.num_hidden_layers, "attn_dim": cfg.num_attention_heads * head_dim}


def forward_flops(shape: dict, seq_len: int) -> float:
    return 2.0 * shape["n"] * seq_len + 4.0 * shape["layers"] * shape["attn_dim"] * seq_len ** 2
