"""Larger Llama-shaped models for the training benchmarks, built from a config in place (random
weights, nothing on disk): under ZeRO-3 each rank builds only its shard.

The block dimensions are those of published models (Llama 3 8B and 70B, Qwen2.5 14B and 32B); the
vocabulary is syncrl's character tokenizer, so the parameters are almost all in the blocks.
"""

from __future__ import annotations

from stages.runtime.presets import PRESETS

SHAPES = {
    "llama-8b": PRESETS["llama3-8b-shape"],
    "qwen-14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                     num_key_value_heads=8, max_position_embeddings=8192),
    "qwen-32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                     num_key_value_heads=8, max_position_embeddings=8192),
    "llama-70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                      num_key_value_heads=8, max_position_embeddings=8192),
}

# Not a model to scale to: small-llama's 24 layers and 219 parameters at a width of 80, every
# operation and Python call of a train step with hardly any arithmetic (a CPU stand-in for an update
# bound by the host's dispatch, as small-llama's is on an H200).
HOST_BOUND = {
    "small-llama-host": dict(hidden_size=80, intermediate_size=216, num_hidden_layers=24, num_attention_heads=20,
                             num_key_value_heads=20, max_position_embeddings=4096),
}

# Bytes per parameter that ZeRO-3 partitions over the GPUs with mixed precision and Adam: bf16
# weights and gradients (2 + 2), fp32 master weights and the two Adam moments (4 + 4 + 4).
ZERO3_BYTES_PER_PARAM = 16
# Share of each GPU's memory left to the model states; the rest holds activations, the gathered
# layers' full weights and the allocator's slack.
MODEL_STATE_SHARE = 0.7


def block_params(dims: dict) -> int:
    """Parameters of the transformer blocks (attention and MLP matrices; norms are negligible)."""
    d, inter, layers = dims["hidden_size"], dims["intermediate_size"], dims["num_hidden_layers"]
    kv = d * dims["num_key_value_heads"] // dims["num_attention_heads"]
    return layers * (2 * d * d + 2 * d * kv + 3 * d * inter)


def largest_fitting(gpus: int, gpu_bytes: int) -> str:
    """The largest shape whose ZeRO-3 model states fit MODEL_STATE_SHARE of `gpus` GPUs' memory."""
    budget = MODEL_STATE_SHARE * gpus * gpu_bytes
    fitting = [name for name, dims in SHAPES.items() if ZERO3_BYTES_PER_PARAM * block_params(dims) <= budget]
    if not fitting:
        raise SystemExit(f"no benchmark shape fits ZeRO-3 on {gpus} GPUs of {gpu_bytes / 2**30:.0f} GiB")
    return max(fitting, key=lambda name: block_params(SHAPES[name]))
