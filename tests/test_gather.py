"""gather as a real process over a hand-made run dir (it is torch-free, so this is fast)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stages.runtime import markers
from stages.runtime.config import config_hash, dump_config, load_config
from stages.runtime.paths import RunPaths

ROOT = Path(__file__).resolve().parents[1]


def make_run(tmp_path, ranks=3):
    cfg = load_config(None, [f"run_dir={tmp_path}", f"ranks={ranks}"])
    paths = RunPaths(tmp_path)
    markers.write_text_atomic(paths.config, dump_config(cfg))
    return cfg, paths


def add_score_shard(cfg, paths, rank, rewards):
    rows = [{"prompt_id": f"p{rank}", "sample_index": i, "rank": rank, "prompt_ids": [1, 2], "completion_ids": [3],
             "logprobs": [-1.0], "reward": r, "correct": r >= 1, "formatted": True, "truncated": False}
            for i, r in enumerate(rewards)]
    shard = paths.shard(0, "score", rank)
    markers.write_jsonl_atomic(shard, rows)
    inputs = markers.input_fingerprint(paths, 0, "score", "preset:tiny-llama")
    markers.write_marker(paths, 0, "score", rank, attempt=1, start=0, config_hash=config_hash(cfg), inputs=inputs,
                         outputs=markers.outputs_record([shard], paths.root), extra={"rows": len(rows)})


def gather(paths):
    # -X importtime: the whole run, exit included, must stay torch-free (checked below).
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "stages.gather", "--run-dir", str(paths.root),
                           "--iteration", "0"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    imported = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert not imported & {"torch", "transformers", "deepspeed"}, "gather imported a heavy library"
    proc.stderr = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("import time:"))
    return proc


def test_gather_merges_all_ranks(tmp_path):
    cfg, paths = make_run(tmp_path)
    for rank in range(3):
        add_score_shard(cfg, paths, rank, [1.0, 0.0, 0.0, 0.1])
    proc = gather(paths)
    assert proc.returncode == 0, proc.stderr
    stats = json.loads((paths.stage_dir(0, "gather") / "stats.json").read_text())
    assert stats["completions"] == 12 and stats["groups"] == 3
    assert stats["accuracy"] == pytest.approx(0.25) and stats["reward_mean"] == pytest.approx(0.275)
    rows = markers.read_jsonl(paths.stage_dir(0, "gather") / "train.jsonl")
    assert len(rows) == 12 and {r["rank"] for r in rows} == {0, 1, 2}
    assert markers.read_marker(paths, 0, "gather", 0)["rows"] == 12


def test_gather_names_missing_ranks(tmp_path):
    cfg, paths = make_run(tmp_path)
    add_score_shard(cfg, paths, 1, [1.0, 0.0])
    proc = gather(paths)
    assert proc.returncode == 1
    assert "the score markers of rank(s) 0,2 are missing (expected 3 ranks)" in proc.stderr
    assert "syncrl rerun" in proc.stderr
    assert markers.read_marker(paths, 0, "gather", 0) is None


def test_gather_refuses_truncated_shard(tmp_path):
    cfg, paths = make_run(tmp_path, ranks=2)
    add_score_shard(cfg, paths, 0, [1.0, 0.0])
    add_score_shard(cfg, paths, 1, [1.0, 0.0])
    shard = paths.shard(0, "score", 1)
    shard.write_bytes(shard.read_bytes()[:-20])
    proc = gather(paths)
    assert proc.returncode == 1
    assert "output iter_00000/score/rank_00001.jsonl changed size" in proc.stderr
    assert "syncrl rerun" in proc.stderr and "--stage score" in proc.stderr
