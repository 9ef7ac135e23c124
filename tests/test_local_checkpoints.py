"""Node-local checkpoints (train.local_checkpoint_dir): train writes each node's share to fast
storage, save exports from it, the persist stage makes the durable copy beside the next iteration,
and resume reads the local copy when its record matches, else the durable one. Real DeepSpeed on
CPU, two ranks, the local launcher (tests/test_faults.py has the two-node cases)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from jobs.check import check
from stages.runtime import local_checkpoints as local
from stages.runtime.config import load_config
from stages.runtime.paths import RunPaths

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["data.prompts_per_iteration=8", "generate.attempts=4", "train.micro_batch_size=16"]


def syncrl_run(run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jobs.cli", "run", "configs/local_tiny.yaml", f"run_dir={run_dir}",
                           *SMALL, *overrides, "--launcher", "local"], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def weights(run_dir: Path, it: int) -> dict:
    from safetensors.torch import load_file

    return load_file(run_dir / "models" / f"iter_{it:05d}" / "model.safetensors")


def consolidated(run_dir: Path, it: int, dtype: torch.dtype) -> dict:
    """The fp32 master weights of the durable copy, cast to the export dtype (what save would export
    from the shards)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(run_dir / "checkpoints"), tag=f"iter_{it:05d}")
    return {k: v.to(dtype) for k, v in state.items()}


def assert_export_matches_the_durable_copy(run_dir: Path, it: int) -> None:
    exported = weights(run_dir, it)
    expected = consolidated(run_dir, it, next(iter(exported.values())).dtype)
    for name, tensor in exported.items():
        assert torch.equal(tensor, expected[name]), name


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_run):
    """The same 2-iteration run twice: checkpoints in the run dir (the session's tiny_run), and node-local."""
    base = tmp_path_factory.mktemp("local_ckpt")
    fast, store = base / "fast", base / "node_local"
    proc = syncrl_run(fast, "iterations=2", f"train.local_checkpoint_dir={store}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return tiny_run.dir, fast, store


@pytest.mark.slow
def test_node_local_checkpoints_give_the_same_weights_and_a_durable_copy(runs):
    durable, fast, store = runs
    for it in (0, 1):
        a, b = weights(durable, it), weights(fast, it)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), it
    # The persist stage made the durable copy, complete and in place; retention counts it (keep 1).
    assert [p.name for p in (fast / "checkpoints").iterdir()] == ["iter_00001"]
    record = local.read_record(fast / "checkpoints" / "iter_00001")
    train = json.loads((fast / "iter_00001" / "markers" / "train.done").read_text())
    assert record["id"] == train["local_checkpoint"]["id"]
    assert local.missing_shards(record["files"], 2) == [] and local.MODEL_STATES in record["files"]
    assert_export_matches_the_durable_copy(fast, 1)
    # Train wrote to the node-local store, not the run dir, after its marker (tuning.deferred_checkpoint,
    # the default), the node leaving a note of it; after the run's last iteration the store is emptied.
    train_log = (fast / "logs" / "iter_00001" / "train" / "attempt_1" / "rank_00000.log").read_text()
    assert f"resumed weights and optimizer state from {store}" in train_log
    assert f"checkpoint written after the marker to {store}" in train_log
    assert train["deferred_checkpoint"]["id"] == record["id"] and train["deferred_checkpoint"]["nodes"] == 1
    assert local.deferred_problem(RunPaths(fast), 1) is None
    assert not any(store.iterdir()) if store.exists() else True
    persist = json.loads((fast / "iter_00001" / "markers" / "persist.done").read_text())
    assert persist["bytes"] > 0 and persist["pruned"] == ["checkpoints/iter_00000"]
    # Without the setting the persist stage only records that train wrote the run dir's copy.
    plain = json.loads((durable / "iter_00001" / "markers" / "persist.done").read_text())
    assert "nothing to persist" in plain["summary"]


@pytest.mark.slow
def test_resume_reads_the_durable_copy_when_the_local_one_is_gone(runs, tmp_path):
    _, fast, store = runs
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(fast, run_dir)
    # The copy is another run dir (another store key): its node-local store is empty, as on a new allocation.
    proc = syncrl_run(run_dir, "iterations=3", f"train.local_checkpoint_dir={store}")
    assert proc.returncode == 0, proc.stderr[-4000:]
    log = (run_dir / "logs" / "iter_00002" / "train" / "attempt_1" / "rank_00001.log").read_text()
    assert "resuming from the durable copy" in log and "holds no complete checkpoint" in log
    assert f"resumed weights and optimizer state from {run_dir / 'checkpoints'}" in log
    assert_export_matches_the_durable_copy(run_dir, 2)
    assert "iteration 1 train    already done" in proc.stderr


def test_a_checkpoint_written_after_the_marker_to_the_nodes_is_whole_once_every_node_says_so(tmp_path, monkeypatch):
    # The coordinator cannot see the nodes' storage: each node's note in the run dir, naming the train
    # attempt, says its copy is published.
    paths = RunPaths(tmp_path)
    paths.markers(3).mkdir(parents=True)
    paths.stage_dir(3, "train").mkdir(parents=True)
    (paths.markers(3) / "train.done").write_text(json.dumps({"deferred_checkpoint": {"id": "abc", "nodes": 2},
                                                             "local_checkpoint": {"id": "abc"}}))
    assert "2 of 2 node(s) have not written" in local.deferred_problem(paths, 3)
    paths.local_copy_written(3, "n2").write_text(json.dumps({"id": "old", "node": "n2"}))  # an earlier attempt's
    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    local.note_written(paths, 3, "abc")
    assert "1 of 2 node(s) have not written their node-local copy of iteration 3's checkpoint (written: n1)" in \
        local.deferred_problem(paths, 3)
    paths.local_copy_written(3, "n2").write_text(json.dumps({"id": "abc", "node": "n2"}))
    assert local.deferred_problem(paths, 3) is None


def test_durable_iterations_are_every_nth_and_the_last():
    assert [it for it in range(7) if local.durable(it, 3, 7)] == [2, 5, 6]
    assert [it for it in range(3) if local.durable(it, 1, 3)] == [0, 1, 2]


def test_the_local_record_must_name_the_attempt(tmp_path):
    folder = tmp_path / "iter_00003"
    folder.mkdir()
    (folder / local.MODEL_STATES).write_bytes(b"x" * 10)
    (folder / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"y" * 20)
    assert "holds no complete checkpoint" in local.problem(folder, "abc")
    local.write_record(folder, "abc", 3, "n1", tmp_path)
    assert local.problem(folder, "abc") is None
    assert "another train attempt" in local.problem(folder, "def")
    (folder / local.MODEL_STATES).write_bytes(b"x" * 11)
    assert "changed size" in local.problem(folder, "abc")
    assert local.carried_by(0, local.MODEL_STATES) and not local.carried_by(1, local.MODEL_STATES)
    assert local.carried_by(1, "bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt")
    assert local.missing_shards(["zero_pp_rank_0_x", "zero_pp_rank_2_x"], 3) == [1]


def test_the_store_is_keyed_by_run_dir_and_node(tmp_path, monkeypatch):
    monkeypatch.setenv("NODE_TMP", str(tmp_path / "tmp"))
    a = local.root("$NODE_TMP/syncrl", RunPaths(tmp_path / "a" / "run"), "n1")
    b = local.root("$NODE_TMP/syncrl", RunPaths(tmp_path / "b" / "run"), "n1")
    assert a.parent != b.parent and a.name == "n1" and str(a).startswith(str(tmp_path / "tmp" / "syncrl"))
    assert local.root("", RunPaths(tmp_path), "n1") is None


def test_check_names_what_local_checkpoints_cannot_do(tmp_path):
    cfg = load_config(ROOT / "configs" / "local_tiny.yaml",
                      [f"run_dir={tmp_path / 'run'}", f"train.local_checkpoint_dir={tmp_path / 'store'}",
                       "save.export_dtype=bfloat16"])
    problems = check(cfg, "local")
    assert any("set save.export_dtype: model" in p and "train.local_checkpoint_dir" in p for p in problems), problems
    cfg = load_config(ROOT / "configs" / "local_tiny.yaml", [f"run_dir={tmp_path / 'run'}", "train.durable_every=4"])
    assert any("train.durable_every is 4 but train.local_checkpoint_dir is not set" in p for p in check(cfg, "local"))


def test_check_wants_an_absolute_local_checkpoint_dir(tmp_path):
    cfg = load_config(ROOT / "configs" / "local_tiny.yaml",
                      [f"run_dir={tmp_path / 'run'}", "train.local_checkpoint_dir=relative/store"])
    assert any("must be an absolute path" in p for p in check(cfg, "local"))
