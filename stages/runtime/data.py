"""Problems (`question`, `answer`: GSM8K's ends in `#### N`) and each iteration's prompts. A row's
other fields travel with its prompt (`fields`) to the score stage's reward function.

Sources: a local JSONL file, a `datasets` hub name where one is reachable, or the built-in synthetic
arithmetic task. Torch-free.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from stages.runtime.config import ConfigError, DataConfig, read_text_file


def load_problems(cfg: DataConfig, seed: int, gsm8k_answers: bool = True) -> list[dict]:
    """The run's problems; `gsm8k_answers`: each answer must end in `#### N` (the built-in reward
    reads it; a score.reward_fn reads the answer its own way)."""
    if cfg.source == "synthetic":
        return synthetic_problems(cfg.synthetic_size, cfg.synthetic_max_operand, seed)
    path = Path(cfg.source)
    if path.suffix in (".jsonl", ".json") or path.exists():
        return read_jsonl_problems(path, gsm8k_answers)
    return _hub_problems(cfg.source, cfg.split)


def iteration_prompts(cfg: DataConfig, problems: list[dict], seed: int, iteration: int) -> list[dict]:
    """This iteration's prompts, the same on every rank and every rerun (seeded by seed and iteration).

    Each item: prompt_id (unique in the run), question, answer, prompt (the templated text), and
    fields (the row's other fields, where it has any).
    Draws without replacement within an iteration; an iteration may reuse problems of earlier ones.
    """
    rng = random.Random(seed * 1_000_003 + iteration)
    n = cfg.prompts_per_iteration
    order = []
    while len(order) < n:  # a dataset smaller than one iteration is cycled through
        order += rng.sample(range(len(problems)), len(problems))
    items = []
    for i, idx in enumerate(order[:n]):
        p = problems[idx]
        items.append({
            "prompt_id": f"{iteration:05d}-{i:05d}",
            "problem_index": idx,
            "question": p["question"],
            "answer": p["answer"],
            "prompt": cfg.prompt_template.format(question=p["question"]),
            **({"fields": p["fields"]} if p.get("fields") else {}),
        })
    return items


def shard(items: list, rank: int, world_size: int) -> list:
    """Rank `rank`'s share: strided, so shard sizes differ by at most one."""
    return items[rank::world_size]


def synthetic_problems(size: int, max_operand: int, seed: int) -> list[dict]:
    """`a+b=` problems with small operands: a from-scratch tiny model can learn them under RL."""
    rng = random.Random(seed)
    out = []
    for _ in range(size):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        out.append({"question": f"{a}+{b}=", "answer": f"{a}+{b}={a + b}\n#### {a + b}"})
    return out


def read_jsonl_problems(path: Path, gsm8k_answers: bool = True) -> list[dict]:
    if not path.is_file():
        raise ConfigError(f"data.source {path} not found: give a GSM8K-format JSONL file, a hub name, or 'synthetic'")
    problems = []
    for lineno, line in enumerate(read_text_file(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{lineno}: not valid JSON ({e.msg}); one JSON object per line") from None
        if not isinstance(row, dict) or not isinstance(row.get("question"), str) \
                or not isinstance(row.get("answer"), str):
            raise ConfigError(f"{path}:{lineno}: each row needs string fields 'question' and 'answer'")
        if gsm8k_answers and "####" not in row["answer"]:
            raise ConfigError(f"{path}:{lineno}: 'answer' must end with '#### <number>' (GSM8K format), or "
                              "score.reward_fn must name a reward function that reads it")
        extra = {k: v for k, v in row.items() if k not in ("question", "answer")}
        problems.append({"question": row["question"], "answer": row["answer"], **({"fields": extra} if extra else {})})
    if not problems:
        raise ConfigError(f"data.source {path} is empty: it holds no problems; give a GSM8K-format JSONL file, "
                          "one {\"question\": ..., \"answer\": ...} object per line")
    return problems


def _hub_problems(name: str, split: str) -> list[dict]:
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"data.source {name!r} is neither a file nor 'synthetic', and the `datasets` package is not "
            "installed to fetch it from the hub: pip install datasets, or give a local JSONL path") from None
    config = "main" if name.endswith("gsm8k") else None
    ds = datasets.load_dataset(name, config, split=split)
    return [{"question": r["question"], "answer": r["answer"]} for r in ds]
