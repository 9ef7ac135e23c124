"""Group-relative advantages and train-set filters (torch-free: plain Python over a few thousand rows).

Rows sharing a `prompt_id` form a group (the `attempts` samples of one prompt).
"""

from __future__ import annotations

import math
from collections import defaultdict

EPS = 1e-6


def group_rows(rows: list[dict]) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        groups[r["prompt_id"]].append(r)
    return dict(groups)


def advantages(rewards: list[float], method: str, normalize_std: bool = True) -> list[float]:
    """Advantages of one group.

    grpo: reward minus the group mean, divided by the group's sample std (n-1) when normalize_std.
    rloo: reward minus the mean of the *other* samples (leave-one-out baseline).
    none: the raw reward (plain REINFORCE).
    """
    n = len(rewards)
    if method == "none":
        return list(rewards)
    mean = sum(rewards) / n
    if method == "rloo":
        if n == 1:
            return [0.0]
        return [(r - (mean * n - r) / (n - 1)) for r in rewards]
    if method == "grpo":
        centered = [r - mean for r in rewards]
        if not normalize_std or n == 1:
            return centered
        std = math.sqrt(sum(c * c for c in centered) / (n - 1))
        return [c / (std + EPS) for c in centered]
    raise ValueError(f"unknown advantage method {method!r}; use grpo, rloo or none")


def zero_variance(rewards: list[float]) -> bool:
    return max(rewards) - min(rewards) < EPS


def build_train_set(rows: list[dict], method: str, normalize_std: bool = True,
                    drop_zero_variance: bool = False, rejection_sampling: bool = False) -> tuple[list[dict], dict]:
    """Attach `advantage` to each row, apply filters; returns (kept rows, filter counts)."""
    kept, dropped_zv, dropped_rs = [], 0, 0
    groups = group_rows(rows)
    for pid in sorted(groups):
        group = sorted(groups[pid], key=lambda r: (r.get("rank", 0), r.get("sample_index", 0)))
        rewards = [float(r["reward"]) for r in group]
        if drop_zero_variance and zero_variance(rewards):
            dropped_zv += len(group)
            continue
        mean = sum(rewards) / len(rewards)
        for r, a in zip(group, advantages(rewards, method, normalize_std)):
            if rejection_sampling and not r["reward"] > mean:
                dropped_rs += 1
                continue
            kept.append({**r, "advantage": a})
    return kept, {"groups": len(groups), "dropped_zero_variance": dropped_zv, "dropped_rejection": dropped_rs}
