"""The roofline of sampling a set of completions, for the generation benchmarks.

Each phase of sampling is bound by the larger of two times:

- compute: its matrix FLOPs at the GPU's dense bf16 rate. Per token, 2 x parameters for the
  projections, plus 4 x layers x query heads x head size x (positions it attends to) for the
  attention's scores and weighted sum;
- memory: its bytes at the HBM bandwidth. The weights once per forward pass, plus the K/V of every
  position each token attends to (written once, read by every later token of its sequence).

Phases, as an engine decoding every sequence at once would run them:

- prefill: one pass over each prompt once (a prompt's attempts share it);
- full: the decode steps while every sequence is still running (up to the shortest completion);
- tail: the steps after that, with fewer and fewer sequences live.

A decode step is bound by max(compute, memory) for the sequences live at that step; the phase's
bound is the sum over its steps. That bound lets the attention's K/V reads hide under the projections'
FLOPs. A step that runs its projections and then its attention, each kernel on its own roof, is bound
instead by max(projection FLOPs, weight bytes) + max(attention FLOPs, K/V bytes): `serial_s`, the
bound of a sampler that does not overlap the two (the compact sampler's decode steps run them in
turn). The old-log-prob pass and sampling itself are left out, so a real stage stays below the bound.
`bound` is the memory time alone (the figure earlier entries of docs/benchmarks.md give).
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

# HBM bandwidth by card, datasheets (SXM unless named), matched in this order against the card's name:
# a roofline at another card's bandwidth misstates the share. The H200's ~4.3e12 is measured on large
# copies (../shared/NOTES.md).
HBM_BY_CARD = {"H200": 4.8e12, "H100 PCIe": 2.0e12, "H100 NVL": 3.9e12, "H100": 3.35e12, "A100": 2.0e12}
# Where the card is unknown (no GPU here, or a card not in the table): the H200's, the lent machine's.
HBM_BYTES_PER_S = HBM_BY_CARD["H200"]
# H100/H200 SXM dense bf16 (stages/rl/flops.py's PEAK_FLOPS).
PEAK_FLOPS = 989e12


def card_name() -> str:
    """The first GPU's name from nvidia-smi, without a CUDA context in this process ("" where none)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else ""


def hbm_bandwidth(name: str | None = None, given: float | None = None) -> tuple[float, str]:
    """The HBM bandwidth of card `name` (default: this machine's first GPU), and what it is taken for;
    `given` (a benchmark's --bandwidth) instead where set."""
    if given:
        return given, "--bandwidth"
    name = card_name() if name is None else name
    for key, value in HBM_BY_CARD.items():
        if key in name:
            return value, key
    return HBM_BYTES_PER_S, f"H200, for {name or 'no GPU'}"


@dataclass(frozen=True)
class Shape:
    """What the roofline needs of a model: parameters, bytes, and the attention's dimensions."""
    params: int
    weight_bytes: int
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    itemsize: int

    @property
    def kv_per_position(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.itemsize


def model_shape(model_dir: Path) -> Shape:
    """The Shape of the HF model in model_dir, from its files alone."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    weights = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))
    q_heads = config["num_attention_heads"]
    itemsize = {"float32": 4}.get(config.get("dtype") or config.get("torch_dtype"), 2)
    return Shape(params=weights // itemsize, weight_bytes=weights, layers=config["num_hidden_layers"],
                 q_heads=q_heads, kv_heads=config.get("num_key_value_heads") or q_heads,
                 head_dim=config.get("head_dim") or config["hidden_size"] // q_heads, itemsize=itemsize)


def bound(pairs: list[tuple[int, int]], weight_bytes: int, kv_per_position: int,
          bandwidth: float = HBM_BYTES_PER_S) -> dict:
    """The memory time alone of decoding `pairs` (prompt length, completion length per sequence) all
    at once: the weights once per step, the K/V each new token attends to."""
    steps = max((c for _, c in pairs), default=0)
    kv = sum(kv_per_position * (c * p + c * (c - 1) // 2) for p, c in pairs)
    total = steps * weight_bytes + kv
    new = sum(c for _, c in pairs)
    seconds = total / bandwidth
    return {"bytes": total, "kv_bytes": kv, "weight_bytes": steps * weight_bytes, "seconds": seconds,
            "new_tokens_per_s": new / seconds if seconds else 0.0, "bandwidth": bandwidth}


def roofline(pairs: list[tuple[int, int]], attempts: int, shape: Shape, peak_flops: float = PEAK_FLOPS,
             bandwidth: float = HBM_BYTES_PER_S, shared_prompts: bool = False) -> dict:
    """Per phase (prefill, full, tail) and in all: compute seconds, memory seconds, the bound
    (seconds), the decode steps and whether compute or memory binds most of them. `pairs` are in
    prompt order, `attempts` consecutive sequences per prompt (as generate's rows are). Each decode
    step reads every live sequence's prompt K/V; with shared_prompts, each prompt's once for all of
    its live attempts (what a sampler that shares them could reach at best)."""
    attn = 4 * shape.layers * shape.q_heads * shape.head_dim  # FLOPs per (token, position attended)
    kv = shape.kv_per_position
    prompts = [p for p, _ in pairs[::attempts]]
    # Prefill: causal attention over each prompt (position i attends to i + 1 positions).
    projections, attention = 2 * shape.params * sum(prompts), sum(attn * p * (p + 1) // 2 for p in prompts)
    written = kv * sum(prompts)  # the weights are read once, each prompt's K/V written
    serial = (max(projections / peak_flops, shape.weight_bytes / bandwidth)
              + max(attention / peak_flops, written / bandwidth))
    phases = {"prefill": _phase((projections + attention) / peak_flops, (shape.weight_bytes + written) / bandwidth,
                                serial, 1 if prompts else 0, 0)}
    # Decode step k (k = 1 .. longest - 1; the first new token comes from the prefill's logits) runs
    # the sequences with more than k new tokens, each attending to its prompt and k tokens.
    by_length = sorted(range(len(pairs)), key=lambda j: pairs[j][1], reverse=True)
    shortest = min((c for _, c in pairs), default=0)
    longest = pairs[by_length[0]][1] if by_length else 0
    live, prefix, i = 0, 0, 0  # live sequences at step k, and the sum of their prompt lengths
    read, live_prompts = 0, set()  # the prompt positions a step reads, with shared_prompts
    acc = {"full": [0.0, 0.0, 0.0, 0, 0, 0.0], "tail": [0.0, 0.0, 0.0, 0, 0, 0.0]}
    for k in range(longest - 1, 0, -1):  # from the last step back, adding sequences as they become live
        while i < len(by_length) and pairs[by_length[i]][1] > k:
            j = by_length[i]
            live += 1
            prefix += pairs[j][0]
            if j // attempts not in live_prompts:
                live_prompts.add(j // attempts)
                read += pairs[j][0]
            i += 1
        attended = prefix + live * (k + 1)
        projections, weights = 2 * shape.params * live / peak_flops, shape.weight_bytes / bandwidth
        attention = attn * attended / peak_flops
        kv_read = kv * ((read if shared_prompts else prefix) + live * (k + 1)) / bandwidth
        compute, mem = projections + attention, weights + kv_read
        a = acc["full" if k < shortest else "tail"]
        a[0] += compute
        a[1] += mem
        a[2] += max(compute, mem)
        a[3] += 1
        a[4] += compute > mem
        a[5] += max(projections, weights) + max(attention, kv_read)
    for name, (compute, mem, b, steps, compute_bound, serial) in acc.items():
        phases[name] = _phase(compute, mem, serial, steps, compute_bound, b)
    total = sum(ph["bound_s"] for ph in phases.values())
    new = sum(c for _, c in pairs)
    return {"phases": phases, "bound_s": total, "new_tokens_per_s": new / total if total else 0.0,
            "serial_s": sum(ph["serial_s"] for ph in phases.values()), "peak_flops": peak_flops,
            "bandwidth": bandwidth}


def _phase(compute_s: float, memory_s: float, serial_s: float, steps: int, compute_bound: int,
           bound_s: float | None = None) -> dict:
    if bound_s is None:
        bound_s = max(compute_s, memory_s)
        compute_bound = int(compute_s > memory_s) if steps else 0
    return {"compute_s": compute_s, "memory_s": memory_s, "bound_s": bound_s, "steps": steps,
            "compute_bound_steps": compute_bound, "serial_s": serial_s}
