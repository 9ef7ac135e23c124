"""An iteration's rows as this rank's optimizer steps, each a list of micro-batches.

Rows are shuffled per epoch (seeded, the same on every rank) and dealt into micro-batches of
train.micro_batch_size rows: in shuffled order, or (tuning.balance_tokens) with near-equal tokens per
micro-batch. A step's time follows its tokens: ranks wait at the gradient all-reduce for the one
with the most. With tuning.max_tokens_per_micro_batch, each step's rows are regrouped by length
within a token budget.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

from stages.rl.packing import row_width


@dataclass
class OptimizerStep:
    micro_batches: list  # this rank's, each a list of rows (None: a padding row)
    normalizer: float | None = None  # loss tokens of the step on all ranks (token-budget batching)


def optimizer_steps(rows: list[dict], ctx) -> list[OptimizerStep]:
    """This rank's optimizer steps, the same count (and micro-batch count) on every rank; `ctx` is
    the stage's context (its config, iteration, rank and world size).

    Each step takes the rows today's fixed micro-batches would (micro_batches_by_rank); with
    tuning.max_tokens_per_micro_batch they are regrouped by length instead (token_budget_groups).
    Every rank holds the whole train set, so each computes every rank's grouping, and pads its own
    with empty micro-batches to the busiest rank's count, without communicating.
    """
    t = ctx.cfg.train
    budget = ctx.cfg.tuning.max_tokens_per_micro_batch
    per_step = t.micro_batch_size * t.gradient_accumulation_steps
    fixed = micro_batches_by_rank(rows, ctx, per_step * ctx.world_size)
    n_steps = len(fixed[ctx.rank]) // t.gradient_accumulation_steps
    steps = []
    for k in range(n_steps):
        window = slice(k * t.gradient_accumulation_steps, (k + 1) * t.gradient_accumulation_steps)
        if not budget:
            steps.append(OptimizerStep(fixed[ctx.rank][window]))
            continue
        step_rows = [[r for micro in fixed[rank][window] for r in micro if r is not None]
                     for rank in range(ctx.world_size)]
        groups = [token_budget_groups(rs, budget) for rs in step_rows]
        count = max(1, max(len(g) for g in groups))
        mine = groups[ctx.rank] + [[None]] * (count - len(groups[ctx.rank]))
        tokens = sum(len(r["completion_ids"]) for rs in step_rows for r in rs)
        steps.append(OptimizerStep(mine, float(max(tokens, 1))))
    return steps


# What one more micro-batch costs, in padded positions: a forward and backward of every layer,
# however few rows it holds: the fixed part of a micro-batch, measured on the reference workload as
# about a tenth of a 32-row step (docs/benchmarks.md).
MICRO_BATCH_POSITIONS = 2048


def token_budget_groups(rows: list[dict], budget: int) -> list[list[dict]]:
    """Rows grouped into micro-batches of at most `budget` padded positions each (a longer row runs
    alone), the grouping that costs least: padded positions, plus MICRO_BATCH_POSITIONS for every
    micro-batch. Rows are sorted longest first and each group is a run of that order, padded to its
    first row's length; the best cut points are found exactly (dynamic programming over the runs).
    """
    order = sorted(rows, key=row_width, reverse=True)
    widths = [row_width(r) for r in order]
    n = len(order)
    cost, cut = [0] * (n + 1), [n] * (n + 1)  # cost[i]: the least cost of grouping order[i:]
    for i in range(n - 1, -1, -1):
        fit = max(1, budget // widths[i])  # rows a group starting at i may hold
        cost[i], cut[i] = min((MICRO_BATCH_POSITIONS + (j - i) * widths[i] + cost[j], j)
                              for j in range(i + 1, min(n, i + fit) + 1))
    groups, i = [], 0
    while i < n:
        groups.append(order[i:cut[i]])
        i = cut[i]
    return groups


def micro_batches_by_rank(rows: list[dict], ctx, global_batch: int) -> list[list[list[dict | None]]]:
    """Every rank's micro-batches (index: rank), the same count on every rank (a rank that ran out
    would hang the others).

    Rows are shuffled per epoch (seeded: the same on every rank, so once serves them all) and padded
    with None up to whole global batches; None rows carry no tokens and no loss. They are dealt
    round-robin, or with tuning.balance_tokens into micro-batches of near-equal tokens
    (balanced_groups), which are then shuffled and dealt round-robin.
    """
    t = ctx.cfg.train
    out: list[list] = [[] for _ in range(ctx.world_size)]
    for epoch in range(t.epochs):
        order = list(rows)
        rng = random.Random(f"{ctx.cfg.seed}:{ctx.iteration}:{epoch}")
        rng.shuffle(order)
        padded = order + [None] * (-len(order) % global_batch)
        if ctx.cfg.tuning.balance_tokens:
            groups = balanced_groups([row_width(r) if r else 0 for r in padded], len(padded) // t.micro_batch_size,
                                     t.micro_batch_size)
            rng.shuffle(groups)  # which step runs which group: no order by composition
            micro = [[padded[i] for i in g] for g in groups]
            for rank in range(ctx.world_size):
                out[rank] += micro[rank::ctx.world_size]
            continue
        for rank in range(ctx.world_size):
            mine = padded[rank::ctx.world_size]
            out[rank] += [mine[i:i + t.micro_batch_size] for i in range(0, len(mine), t.micro_batch_size)]
    return out


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
