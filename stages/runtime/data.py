"""Problems and each iteration's prompts. A problem is a data row's question and reference answer
(the fields data.question_field and data.answer_field name, the answer in data.answer_format); the
row's other fields travel with its prompt (`fields`) to the score stage's reward function.

Sources: a local JSONL file, a `datasets` hub name where one is reachable, or the built-in synthetic
arithmetic task. Torch-free.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from stages.runtime.answer import reference_answer
from stages.runtime.config import ConfigError, DataConfig, read_text_file

# What to do when data.chat_template is on and the tokenizer has no template (check and generate say it).
CHAT_TEMPLATE_FIX = ("use an instruct model's tokenizer (model.path or model.tokenizer), or set data.chat_template=false "
                     "and write the model's prompt format in data.prompt_template")

# What a row's answer field must hold, per data.answer_format, in an error's words.
FORMAT_NEEDS = {
    "gsm8k": "a worked solution ending with '#### <answer>' (GSM8K format)",
    "boxed": "a solution with its answer in \\boxed{...}",
    "plain": "the answer itself, not empty",
}


def load_problems(cfg: DataConfig, seed: int) -> list[dict]:
    """The run's problems: {"question", "answer", and "fields" where the row has others}."""
    if cfg.source == "synthetic":
        return synthetic_problems(cfg.synthetic_size, cfg.synthetic_max_operand, seed)
    path = Path(cfg.source)
    if path.suffix in (".jsonl", ".json") or path.exists():
        return read_jsonl_problems(path, cfg)
    return _hub_problems(cfg)


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


def read_jsonl_problems(path: Path, cfg: DataConfig | None = None) -> list[dict]:
    """The problems of a JSONL file, every row checked as `cfg` (its field names and answer format)
    reads it; an error names the file and line."""
    cfg = cfg or DataConfig()
    if not path.is_file():
        raise ConfigError(f"data.source {path} not found: give a JSONL file, a hub name, or 'synthetic'")
    problems = []
    for lineno, line in enumerate(read_text_file(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{lineno}: not valid JSON ({e.msg}); one JSON object per line") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{path}:{lineno}: a row must be a JSON object, got {type(row).__name__}")
        problems.append(problem(row, cfg, f"{path}:{lineno}"))
    if not problems:
        raise ConfigError(f"data.source {path} is empty: it holds no problems; give a JSONL file, one "
                          f'{{"{cfg.question_field}": ..., "{cfg.answer_field}": ...}} object per line')
    return problems


def problem(row: dict, cfg: DataConfig, where: str) -> dict:
    """One data row as a problem; `where` names the row for an error."""
    q, a = cfg.question_field, cfg.answer_field
    missing = [k for k in (q, a) if not isinstance(row.get(k), str)]
    if missing:
        others = ", ".join(sorted(k for k in row if k not in (q, a))[:8]) or "none"
        raise ConfigError(f"{where}: no string field {' or '.join(map(repr, missing))} (data.question_field is "
                          f"{q!r}, data.answer_field {a!r}; the row's other fields: {others}): name the row's "
                          "fields in those settings")
    fmt = cfg.answer_format
    if fmt != "custom" and reference_answer(row[a], fmt) is None:
        raise ConfigError(f"{where}: {a!r} must be {FORMAT_NEEDS[fmt]} (data.answer_format {fmt!r}): choose the "
                          "format the file's answers are in ('gsm8k', 'boxed', 'plain'), or 'custom' with "
                          f"score.reward_fn reading them; got {row[a][-80:]!r}")
    extra = {k: v for k, v in row.items() if k not in (q, a)}
    return {"question": row[q], "answer": row[a], **({"fields": extra} if extra else {})}


def _hub_problems(cfg: DataConfig) -> list[dict]:
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            f"data.source {cfg.source!r} is neither a file nor 'synthetic', and the `datasets` package is not "
            "installed to fetch it from the hub: pip install datasets, or give a local JSONL path") from None
    config = "main" if cfg.source.endswith("gsm8k") else None
    ds = datasets.load_dataset(cfg.source, config, split=cfg.split)
    return [problem(dict(r), cfg, f"{cfg.source} ({cfg.split}) row {i}") for i, r in enumerate(ds)]
