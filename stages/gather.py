"""gather: one task. Merge every score shard, compute group advantages, filter, write the train set.

Writes iter_I/gather/train.jsonl and iter_I/gather/stats.json. Never imports torch.

By hand:

    python -m stages.gather --run-dir RUN_DIR --iteration I
"""

from __future__ import annotations

import logging
import statistics

from stages.rl.advantages import build_train_set, group_rows, zero_variance
from stages.runtime import markers
from stages.runtime.markers import read_jsonl, write_json_atomic, write_jsonl_atomic
from stages.runtime.stage import StageContext, ranks_of, run_stage

log = logging.getLogger("syncrl.gather")

# What train needs of each row; the rest (question text, answers) stays in the score shards.
TRAIN_FIELDS = ("prompt_id", "sample_index", "rank", "prompt_ids", "completion_ids", "logprobs",
                "advantage", "reward", "correct")


class ShardError(RuntimeError):
    pass


def main(ctx: StageContext) -> None:
    """Merge all ranks' scored shards into the train set and iteration stats."""
    # The harness has checked that every score rank's shard is there whole (the stage table's needs).
    world = ranks_of(ctx, "score", ctx.iteration)
    rows = []
    for rank in range(world):
        rows += read_shard(ctx, rank)
    if not rows:
        raise ShardError(f"iteration {ctx.iteration}: the score shards hold no completions")
    g = ctx.cfg.gather
    kept, counts = build_train_set(rows, g.advantage, g.normalize_std, g.drop_zero_variance, g.rejection_sampling)
    stats = iteration_stats(rows, kept, counts)
    out, stats_file = ctx.paths.train_set(ctx.iteration), ctx.paths.gather_stats(ctx.iteration)
    write_jsonl_atomic(out, ({k: r[k] for k in TRAIN_FIELDS} for r in kept))
    write_json_atomic(stats_file, stats)
    ctx.summarize("iteration %d: %d completions from %d ranks, reward %.3f, accuracy %.3f, %d rows to train",
                  ctx.iteration, len(rows), world, stats["reward_mean"], stats["accuracy"], len(kept))
    ctx.write_marker([out, stats_file], extra={"rows": len(kept), "stats": stats})


def read_shard(ctx: StageContext, rank: int) -> list[dict]:
    """One rank's score shard, with the row count its marker records."""
    paths, it = ctx.paths, ctx.iteration
    shard = paths.shard(it, "score", rank)
    rows = read_jsonl(shard)
    expected = (markers.read_marker(paths, it, "score", rank) or {}).get("rows", len(rows))
    if len(rows) != expected:
        raise ShardError(f"iteration {it}: shard {shard.relative_to(paths.root)} has {len(rows)} rows, its marker "
                         f"says {expected}. Rerun: syncrl rerun {paths.root} --iteration {it} --stage score")
    return rows


def iteration_stats(rows: list[dict], kept: list[dict], counts: dict) -> dict:
    rewards = [r["reward"] for r in rows]
    lengths = [len(r["completion_ids"]) for r in rows]
    groups = group_rows(rows)
    return {
        "completions": len(rows),
        "groups": counts["groups"],
        "reward_mean": statistics.fmean(rewards),
        "reward_std": statistics.pstdev(rewards),
        "accuracy": statistics.fmean(float(r["correct"]) for r in rows),
        "formatted": statistics.fmean(float(r.get("formatted", False)) for r in rows),
        "zero_variance_groups": sum(zero_variance([r["reward"] for r in g]) for g in groups.values()) / len(groups),
        "length_mean": statistics.fmean(lengths),
        "length_max": max(lengths),
        "truncated": statistics.fmean(float(r.get("truncated", False)) for r in rows),
        "train_rows": len(kept),
        "dropped_zero_variance": counts["dropped_zero_variance"],
        "dropped_rejection": counts["dropped_rejection"],
        **reward_term_means(rows),
    }


def reward_term_means(rows: list[dict]) -> dict:
    """The mean of each named term a score.reward_fn returned (over the rows that have it)."""
    values: dict[str, list[float]] = {}
    for r in rows:
        for name, v in r.get("reward_terms", {}).items():
            values.setdefault(name, []).append(float(v))
    return {f"{name}_mean": statistics.fmean(v) for name, v in sorted(values.items())}


if __name__ == "__main__":
    run_stage("gather", main)
