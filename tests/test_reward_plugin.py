"""score.reward_fn: a reward function of the user's own, "package.module:function". `syncrl check`
imports it before anything runs; the score stage calls it on every completion with the problem's
row (extra fields of the data file included), its named terms reach gather's stats; a function that
raises names itself and the row in the stage's failure record."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jobs.check import check
from stages.runtime import reward_plugin
from stages.runtime.config import ConfigError, DataConfig, ScoreConfig, load_config
from stages.runtime.data import iteration_prompts, read_jsonl_problems

ROOT = Path(__file__).resolve().parents[1]

PLUGIN = '''
def reward(completion, row, cfg):
    # Rewards a completion by how many characters of the problem's "hint" field it contains (the
    # digits where the row has none).
    hint = row.get("hint", "0123456789")
    hits = sum(c in completion for c in hint)
    return {"reward": hits / len(hint) - 0.5, "hint_hits": hits, "long": len(completion) > 3}


def broken(completion, row, cfg):
    return 1.0 / 0


def plain(completion, row, cfg):
    return 2


not_a_function = 3
'''


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    folder = tmp_path / "plugins"
    folder.mkdir()
    (folder / "my_rewards.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(folder))
    sys.modules.pop("my_rewards", None)
    return folder


def test_the_setting_is_checked_before_anything_runs(plugin_dir, tmp_path):
    with pytest.raises(ConfigError, match="give it as package.module:function"):
        ScoreConfig(reward_fn="my_rewards.reward")
    cfg = lambda spec: load_config(ROOT / "configs" / "local_tiny.yaml",  # noqa: E731
                                   [f"run_dir={tmp_path / 'run'}", f"score.reward_fn={spec}"])
    assert check(cfg("my_rewards:reward"), "local") == []
    problems = "\n".join(check(cfg("no_such_module:reward"), "local"))
    assert "module 'no_such_module' could not be imported (ModuleNotFoundError" in problems
    assert "put its folder on PYTHONPATH" in problems
    assert "has no 'missing'" in "\n".join(check(cfg("my_rewards:missing"), "local"))
    assert "is a int, not a function" in "\n".join(check(cfg("my_rewards:not_a_function"), "local"))


def test_a_call_gives_the_reward_its_terms_or_names_the_row(plugin_dir):
    fn = reward_plugin.load("my_rewards:reward")
    got = reward_plugin.call(fn, "my_rewards:reward", "a1b", {"hint": "ab"}, ScoreConfig(), "row 7")
    assert got == {"reward": 0.5, "reward_terms": {"hint_hits": 2, "long": False}}
    assert reward_plugin.call(reward_plugin.load("my_rewards:plain"), "p", "x", {}, ScoreConfig(), "r") == \
        {"reward": 2.0}
    with pytest.raises(reward_plugin.RewardError, match=r"my_rewards:broken raised on row 7: ZeroDivisionError"):
        reward_plugin.call(reward_plugin.load("my_rewards:broken"), "my_rewards:broken", "x", {}, ScoreConfig(),
                           "row 7")
    with pytest.raises(reward_plugin.RewardError, match=r"returned 'yes' on row 7: return a number"):
        reward_plugin.call(lambda *a: "yes", "f", "x", {}, ScoreConfig(), "row 7")
    with pytest.raises(reward_plugin.RewardError, match=r"not numbers: note"):
        reward_plugin.call(lambda *a: {"reward": 1, "note": "x"}, "f", "x", {}, ScoreConfig(), "row 7")
    with pytest.raises(reward_plugin.RewardError, match="must be finite"):
        reward_plugin.call(lambda *a: float("nan"), "f", "x", {}, ScoreConfig(), "row 7")


def test_other_fields_of_a_row_travel_with_its_prompt(tmp_path):
    data = tmp_path / "math.jsonl"
    data.write_text(json.dumps({"question": "1+1?", "answer": "\\boxed{2}", "hint": "2", "level": 3}) + "\n")
    with pytest.raises(ConfigError, match="'custom' with score.reward_fn reading them"):
        read_jsonl_problems(data)
    problems = read_jsonl_problems(data, DataConfig(answer_format="custom"))
    assert problems == [{"question": "1+1?", "answer": "\\boxed{2}", "fields": {"hint": "2", "level": 3}}]
    cfg = load_config(ROOT / "configs" / "local_tiny.yaml", ["data.prompts_per_iteration=1"])
    items = iteration_prompts(cfg.data, problems, 0, 0)
    assert items[0]["fields"] == {"hint": "2", "level": 3}
    # Generate puts them on each of the prompt's rows, where score hands them to the function.
    from types import SimpleNamespace

    from stages.generate import completion_rows

    tokenizer = SimpleNamespace(eos_token_id=0, decode=lambda ids, skip_special_tokens: "".join(map(str, ids)))
    rows = completion_rows(tokenizer, items, SimpleNamespace(attempts=2), [[5, 6]], [[1, 2, 0], [3, 0]])
    assert [r["fields"] for r in rows] == [{"hint": "2", "level": 3}] * 2
    assert [r["completion"] for r in rows] == ["120", "30"]


def score_and_gather(run: Path, plugin_dir: Path, spec: str, stages=("score", "gather")):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin_dir), str(ROOT)])}
    procs = []
    for stage in stages:
        ranks = (0, 1) if stage == "score" else (0,)
        for rank in ranks:
            env.update(RANK=str(rank), WORLD_SIZE=str(len(ranks)), LOCAL_RANK=str(rank))
            procs.append(subprocess.run([sys.executable, "-m", f"stages.{stage}", "--run-dir", str(run), "--iteration",
                                         "0", f"score.reward_fn={spec}"], cwd=ROOT, env=env, capture_output=True,
                                        text=True, timeout=120))
    return procs


def test_the_score_stage_calls_it_and_gather_reports_its_terms(tiny_run, plugin_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tiny_run.dir, run, symlinks=True)
    procs = score_and_gather(run, plugin_dir, "my_rewards:reward")
    assert all(p.returncode == 0 for p in procs), [p.stderr[-2000:] for p in procs]
    scored = [json.loads(line) for rank in (0, 1)
              for line in (run / "iter_00000" / "score" / f"rank_{rank:05d}.jsonl").read_text().splitlines()]
    for r in scored:
        hits = sum(c in r["completion"] for c in "0123456789")
        assert r["reward"] == hits / 10 - 0.5 and r["reward_terms"]["hint_hits"] == hits
        assert isinstance(r["correct"], bool) and "formatted" in r  # GSM8K's, where the function gives none
    stats = json.loads((run / "iter_00000" / "markers" / "gather.rank_00000.done").read_text())["stats"]
    assert stats == json.loads((run / "iter_00000" / "gather" / "stats.json").read_text())
    assert stats["hint_hits_mean"] == pytest.approx(sum(r["reward_terms"]["hint_hits"] for r in scored) / len(scored))
    assert "long_mean" in stats


def test_a_reward_function_that_raises_is_named_in_the_failure_record(tiny_run, plugin_dir, tmp_path):
    from stages.runtime.paths import RunPaths

    run = tmp_path / "run"
    shutil.copytree(tiny_run.dir, run, symlinks=True)
    shard = run / "iter_00000" / "score" / "rank_00000.jsonl"
    before = shard.read_bytes()
    proc = score_and_gather(run, plugin_dir, "my_rewards:broken", stages=("score",))[0]
    assert proc.returncode != 0
    assert "score.reward_fn my_rewards:broken raised on prompt 00000-" in proc.stderr, proc.stderr[-2000:]
    record = json.loads(RunPaths(run).failure_record(0, "score", 0).read_text())
    assert "RewardError: score.reward_fn my_rewards:broken raised on prompt" in record["exception"]
    assert "ZeroDivisionError" in record["exception"] and record["stage"] == "score" and record["rank"] == 0
    assert shard.read_bytes() == before  # the scores written before stay as they were
