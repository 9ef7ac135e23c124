"""score: correctness of each completion's final answer against the reference (read as
data.answer_format says) plus format terms, for this rank's generate shard, or the user's own
reward function (score.reward_fn).

Reads iter_I/generate/rank_K.jsonl, writes iter_I/score/rank_K.jsonl (the same rows plus reward
fields). CPU only; never imports torch, so it starts in a fraction of a second.

By hand, for each rank K of generate (`RANK=K WORLD_SIZE=N` or under srun):

    RANK=K WORLD_SIZE=N python -m stages.score --run-dir RUN_DIR --iteration I
"""

from __future__ import annotations

import logging

from stages.runtime.answer import boxed_text, extract_answer, is_correct, normalize_number, reference_answer
from stages.runtime import reward_plugin
from stages.runtime.config import ScoreConfig
from stages.runtime.markers import read_jsonl, write_jsonl_atomic
from stages.runtime.stage import StageContext, run_stage

__all__ = ["extract_answer", "is_correct", "normalize_number", "reference_answer", "reward_fields", "main"]

log = logging.getLogger("syncrl.score")


def main(ctx: StageContext) -> None:
    """Score this rank's completions."""
    rows = read_jsonl(ctx.paths.shard(ctx.iteration, "generate", ctx.rank))
    cfg = ctx.cfg.score
    fn = reward_plugin.load(cfg.reward_fn) if cfg.reward_fn else None
    fmt = ctx.cfg.data.answer_format
    for row in rows:
        reference = reference_answer(row["answer"], fmt) if fmt != "custom" else None
        fields = reward_fields(row["completion"], reference, row.get("truncated", False), cfg)
        if fn is not None:
            problem = {**row.get("fields", {}), "question": row["question"], "answer": row["answer"]}
            where = f"prompt {row['prompt_id']} attempt {row['sample_index']} (question {row['question'][:80]!r})"
            fields = {k: v for k, v in fields.items() if k in reward_plugin.GSM8K_FIELDS}
            fields.update(reward_plugin.call(fn, cfg.reward_fn, row["completion"], problem, cfg, where))
        row.update(fields)
    out = ctx.paths.shard(ctx.iteration, "score", ctx.rank)
    n = write_jsonl_atomic(out, rows)
    correct = sum(r["correct"] for r in rows)
    ctx.summarize("scored %d completions: %d correct, mean reward %.3f", n, correct,
                  sum(r["reward"] for r in rows) / max(n, 1))
    ctx.write_marker([out], extra={"rows": n, "correct": correct})


def reward_fields(completion: str, reference: str | None, truncated: bool, cfg: ScoreConfig) -> dict:
    """The built-in reward's fields; `reference` None: no answer syncrl can read (data.answer_format:
    custom), so never correct."""
    # The final answer: a number, or the body of a last \boxed{} that is not one ("\frac{1}{2}").
    pred = extract_answer(completion)
    if pred is None:
        pred = boxed_text(completion) or None
    correct = pred is not None and reference is not None and is_correct(completion, reference)
    has_marker = "####" in completion and pred is not None
    reward = (cfg.correct_reward * correct + cfg.format_reward * (pred is not None)
              + cfg.marker_reward * has_marker - cfg.truncation_penalty * bool(truncated))
    return {"pred": pred, "correct": bool(correct), "formatted": pred is not None, "reward": float(reward)}


if __name__ == "__main__":
    run_stage("score", main)
