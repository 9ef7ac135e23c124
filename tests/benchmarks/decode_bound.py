"""The memory-bandwidth bound of decoding a set of completions, for the generation benchmarks.

A decode step must read the weights once and the K/V of every position each live sequence attends
to. The fewest bytes any engine can move for a set of (prompt, completion) lengths, decoding them
all at once, is therefore

    steps x weight bytes + sum over new tokens of (positions before it) x K/V bytes per position

with steps = the longest completion. Divided by the device's memory bandwidth, that is the shortest
possible sampling time; new tokens over it, the bound in new tokens/s. Prefill, sampling and the
old-log-prob pass are left out, so a real stage stays below it.
"""

from __future__ import annotations

import json
from pathlib import Path

# H200 SXM HBM3e, datasheet. About 4.3e12 is measured on large copies (../shared/NOTES.md).
HBM_BYTES_PER_S = 4.8e12


def model_bytes(model_dir: Path) -> tuple[int, int]:
    """(weight bytes, K/V bytes per position) of the HF model in model_dir, from its files alone."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    weights = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    itemsize = {"float32": 4}.get(config.get("dtype") or config.get("torch_dtype"), 2)
    return weights, 2 * config["num_hidden_layers"] * heads * head_dim * itemsize


def bound(pairs: list[tuple[int, int]], weight_bytes: int, kv_per_position: int,
          bandwidth: float = HBM_BYTES_PER_S) -> dict:
    """pairs: (prompt length, completion length) per sequence."""
    steps = max((c for _, c in pairs), default=0)
    kv = sum(kv_per_position * (c * p + c * (c - 1) // 2) for p, c in pairs)
    total = steps * weight_bytes + kv
    new = sum(c for _, c in pairs)
    seconds = total / bandwidth
    return {"bytes": total, "kv_bytes": kv, "weight_bytes": steps * weight_bytes, "seconds": seconds,
            "new_tokens_per_s": new / seconds if seconds else 0.0, "bandwidth": bandwidth}
