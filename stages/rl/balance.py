"""Rows dealt into micro-batches of equal row counts and near-equal token counts (train.balance_tokens).

A step's time follows its tokens: ranks wait at the gradient all-reduce for the one with the most,
and captured CUDA graphs (train.cuda_graphs) run every micro-batch padded to the largest. Randomly
dealt 32-row micro-batches of the reference workload ranged from 3.5k to 6.6k tokens: 24% of the
positions the graphs ran were padding (docs/benchmarks.md).
"""

from __future__ import annotations

import heapq


def balanced_groups(widths: list[int], groups: int, size: int) -> list[list[int]]:
    """Indices 0..len(widths)-1 dealt into `groups` groups of `size` each (len(widths) must be
    groups * size), the summed widths of the groups near equal: longest first, each to the group with
    the least so far that has room. Rows of equal width keep their given order (the caller's shuffle
    decides which goes where); within a group, indices are in the order they were dealt."""
    if len(widths) != groups * size:
        raise ValueError(f"{len(widths)} rows do not fill {groups} groups of {size}")
    out: list[list[int]] = [[] for _ in range(groups)]
    heap = [(0, g) for g in range(groups)]  # (tokens so far, group) of the groups with room
    for i in sorted(range(len(widths)), key=lambda i: -widths[i]):
        total, g = heapq.heappop(heap)
        out[g].append(i)
        if len(out[g]) < size:
            heapq.heappush(heap, (total + widths[i], g))
    return out
