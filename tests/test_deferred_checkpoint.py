"""tuning.deferred_checkpoint (the default): train marks done once its checkpoint is in host memory
and the policy's weights are written for save, then writes the checkpoint beside save and the next
iteration's generate, score and gather; the next train waits for it, and a write that fails redoes
that train. Real DeepSpeed on CPU, two ranks, the local launcher; a real full disk (tmpfs)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from stages.runtime import markers
from tests.slurm_fixture import rank_pid, wait_for
from tests.test_faults import no_half_files, report, small_disk  # noqa: F401 (small_disk is a fixture)

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["data.prompts_per_iteration=8", "generate.attempts=4", "train.micro_batch_size=16", "retry.backoff_s=0.5"]


def command(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "jobs.cli", "run", "configs/local_tiny.yaml", f"run_dir={run_dir}", "iterations=2",
            *SMALL, *overrides, "--launcher", "local"]


def syncrl_run(run_dir: Path, *overrides: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(command(run_dir, *overrides), cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)


def weights(run_dir: Path, it: int) -> dict:
    from safetensors.torch import load_file

    return load_file(run_dir / "models" / f"iter_{it:05d}" / "model.safetensors")


def same_weights(a: Path, b: Path) -> None:
    for it in (0, 1):
        wa, wb = weights(a, it), weights(b, it)
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa), it


def attempts(run_dir: Path, it: int, stage: str) -> list[str]:
    return sorted(p.name for p in (run_dir / "logs" / f"iter_{it:05d}" / stage).glob("attempt_*"))


@pytest.fixture(scope="module")
def runs(tiny_run, plain_checkpoint_run):
    """The same 2-iteration run twice (tests/conftest.py): the checkpoint written after train's
    marker (the default: the session's tiny_run), and before it."""
    return tiny_run.dir, plain_checkpoint_run.dir


@pytest.mark.slow
def test_the_checkpoint_written_after_the_marker_gives_the_same_weights(runs):
    deferred, before = runs
    same_weights(deferred, before)
    for it in (0, 1):
        train = json.loads((deferred / f"iter_{it:05d}" / "markers" / "train.done").read_text())
        assert "checkpoints/iter_" not in " ".join(train["outputs"])  # not on disk when train marked done
        assert f"iter_{it:05d}/train/policy.safetensors" in train["outputs"]
        save_log = (deferred / "logs" / f"iter_{it:05d}" / "save" / "attempt_1" / "rank_00000.log").read_text()
        assert f"exported by linking {deferred}/iter_{it:05d}/train/policy.safetensors" in save_log
        save = json.loads((deferred / f"iter_{it:05d}" / "markers" / "save.done").read_text())
        assert save["export"] == "linked" and save["consolidate_s"] == 0.0
        train_log = (deferred / "logs" / f"iter_{it:05d}" / "train" / "attempt_1" / "rank_00001.log").read_text()
        assert "checkpoint written after the marker" in train_log
        assert train["deferred_checkpoint"]["written_now_gb"] == 0  # every file within the budget
        # Each rank's snapshot layout, for the next train's host memory (empty on CPU: host tensors
        # are kept, not copied).
        for rank in (0, 1):
            assert json.loads((deferred / f"iter_{it:05d}" / "train" / f"snapshot_layout.rank_{rank:05d}.json")
                              .read_text()) == []
    # The last export is train's policy file under a second name (the next save removes the first).
    assert os.path.samefile(deferred / "models" / "iter_00001" / "model.safetensors",
                            deferred / "iter_00001" / "train" / "policy.safetensors")
    assert not (deferred / "iter_00000" / "train" / "policy.safetensors").exists()
    assert (deferred / "models" / "iter_00000" / "model.safetensors").is_file()
    # The checkpoint in place is the last train's, whole (its record names the attempt), and resumable.
    record = json.loads((deferred / "checkpoints" / "iter_00001" / "syncrl-checkpoint.json").read_text())
    assert record["id"] == train["deferred_checkpoint"]["id"]
    assert sorted(record["files"]) == sorted(p.name for p in (before / "checkpoints" / "iter_00001").iterdir())
    log = (deferred / "logs" / "iter_00001" / "train" / "attempt_1" / "rank_00001.log").read_text()
    assert f"resumed weights and optimizer state from {deferred}/checkpoints/iter_00000" in log
    # Written before the marker, the checkpoint is an output of train, and save consolidates it.
    train = json.loads((before / "iter_00001" / "markers" / "train.done").read_text())
    assert "deferred_checkpoint" not in train and any(o.startswith("checkpoints/iter_00001/") for o in train["outputs"])
    # Each rank's files went through the threaded write (tuning.checkpoint_write_threads), and resume read them.
    for rank in (0, 1):
        log = (before / "logs" / "iter_00000" / "train" / "attempt_1" / f"rank_{rank:05d}.log").read_text()
        assert "_optim_states.pt: " in log and "written by 8 threads" in log, log[-2000:]
    log = (before / "logs" / "iter_00001" / "train" / "attempt_1" / "rank_00000.log").read_text()
    assert f"resumed weights and optimizer state from {before}/checkpoints/iter_00000" in log


@pytest.mark.slow
@pytest.mark.parametrize("where", ["run_dir", "node_local"])
def test_a_writer_killed_mid_write_redoes_its_train(runs, tmp_path, where):
    """Train's rank 1 of iteration 0 is killed after its marker, while it waits to write (tests/slow_write):
    the next train's turn finds the checkpoint missing, and the run redoes train 0, its save and
    iteration 1, to the weights of an undisturbed run. Node-local (train.local_checkpoint_dir), the
    persist stage waiting for that node's copy is stopped and redone too."""
    deferred, _ = runs
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "slow_write"), str(ROOT)]),
               SYNCRL_TEST_SLOW_WRITE="0:1:120")
    local = [f"train.local_checkpoint_dir={tmp_path / 'store'}"] if where == "node_local" else []
    proc = subprocess.Popen(command(run_dir, *local), cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    log = run_dir / "logs" / "iter_00000" / "train" / "attempt_1" / "rank_00001.log"
    try:
        # Killed once the coordinator counted train done (its stage marker): killed before, the rank
        # would fail an attempt that is simply retried.
        wait_for(lambda: "slow_write: waiting" in (log.read_text() if log.is_file() else "") and
                 (run_dir / "iter_00000" / "markers" / "train.done").is_file(), 300, "train 0's write")
        t0 = time.time()
        os.kill(rank_pid(log), signal.SIGKILL)
        _, stderr = proc.communicate(timeout=600)
    finally:
        proc.kill()
    recover = time.time() - t0
    assert proc.returncode == 0, stderr[-4000:]
    lost = ".*iter_00000 holds no complete checkpoint" if where == "run_dir" else \
        r"1 of 1 node\(s\) have not written their node-local copy of iteration 0's checkpoint \(written: none\)"
    assert re.search(r"iteration 0 train attempt 1 wrote its marker, then failed on rank\(s\) [0-9,]+ writing its "
                     r"checkpoint: " + lost, stderr), \
        "\n".join(line for line in stderr.splitlines() if "coordinator" in line)[-4000:]
    assert "iteration 0 train: redoing it, its save and iteration 1's stages" in stderr
    assert attempts(run_dir, 0, "train") == ["attempt_1", "attempt_2"]
    assert attempts(run_dir, 0, "generate") == ["attempt_1"]  # completed before the train: kept
    assert attempts(run_dir, 1, "generate") == ["attempt_1", "attempt_2"]
    if where == "node_local":  # the persist of the lost checkpoint, stopped while it waited, was redone
        assert attempts(run_dir, 0, "persist") == ["attempt_1", "attempt_2"]
        persist_log = (run_dir / "logs" / "iter_00000" / "persist" / "attempt_1" / "rank_00000.log").read_text()
        assert "waiting for train to write iteration 0's checkpoint on this node" in persist_log
    same_weights(run_dir, deferred)
    no_half_files(run_dir)
    report(f"train's writer killed after its marker ({where.replace('_', ' ')})", None, recover)


@pytest.mark.slow
def test_disk_full_during_the_write_after_the_marker(runs, small_disk, tmp_path):
    """checkpoints/ on a 2 MB filesystem: iteration 0's 1.4 MB checkpoint fits, iteration 1's does not
    beside it (retention removes iteration 0's only once iteration 1's is there). Each train 1
    attempt marks done and then fails writing; after retry.attempts the run stops, naming the
    cause, with every completed stage kept. With space again the same command finishes the run,
    redoing only train 1 and save 1, to the weights of an undisturbed run."""
    deferred, _ = runs
    run_dir = tmp_path / "run"
    small_disk(2048, run_dir / "checkpoints")
    t0 = time.time()
    proc = syncrl_run(run_dir)
    detect = time.time() - t0
    assert proc.returncode == 1, proc.stderr[-4000:]
    # The writes fail within a second of the marker: the coordinator may see the attempt fail before
    # it counts train done (a failed attempt, retried) or after (a lost checkpoint, train redone).
    assert "iteration 1 train attempt" in proc.stderr and "failed on rank(s)" in proc.stderr, proc.stderr[-4000:]
    assert re.search(r"No space left on device writing \S+/checkpoints/\.iter_00001\.tmp/\S+ \(0\.0 MB free",
                     proc.stderr), proc.stderr[-4000:]
    assert "run the same command again" in proc.stderr
    assert not (run_dir / "checkpoints" / "iter_00001").exists()
    # Every marker is kept as it is but those of train 1 (its failed attempts' rank markers) and of
    # what reads it (persist 1, when the loss was found after it ran).
    kept = {p: p.stat().st_mtime_ns for p in run_dir.glob("iter_0000[01]/markers/*.done")
            if not p.parent.parent.name.endswith("1") or not p.name.startswith(("train.", "save.", "persist."))}
    assert run_dir / "iter_00000" / "markers" / "save.done" in kept
    assert run_dir / "iter_00001" / "markers" / "gather.done" in kept
    assert not (run_dir / "iter_00001" / "markers" / "train.done").exists()
    subprocess.run(["mount", "-o", "remount,size=16m", str(run_dir / "checkpoints")], check=True)
    again = syncrl_run(run_dir)
    recover = time.time() - t0
    assert again.returncode == 0, again.stderr[-4000:]
    launched = re.findall(r"iteration (\d) (\w+) +launching", again.stderr)
    assert launched == [("1", "train"), ("1", "save")], again.stderr[-4000:]
    assert {p: p.stat().st_mtime_ns for p in kept} == kept
    same_weights(run_dir, deferred)
    no_half_files(run_dir)
    report("disk full while train writes its checkpoint after its marker", detect, recover)


def test_host_memory_is_prepared_by_the_previous_snapshots_layout(tmp_path):
    # deferred_checkpoint.HostPool: what a train process started early faults in before its turn.
    from stages.rl.deferred_checkpoint import HostPool

    layout = tmp_path / "snapshot_layout.rank_00000.json"
    pool = HostPool()
    pool.prepare(layout, budget_bytes=1 << 20)
    time.sleep(0.3)  # the previous train writes its layout while this one waits, atomically as train does
    markers.write_json_atomic(layout, [["bfloat16", [3, 4]], ["float32", [5]], ["float32", [5]], ["float32", [0]]])
    first = pool.take((3, 4), torch.bfloat16)
    assert first.shape == (3, 4) and first.dtype == torch.bfloat16 and not first.any()
    assert pool.take((5,), torch.float32) is not None and pool.take((5,), torch.float32) is not None
    assert pool.take((5,), torch.float32) is None  # two were listed
    assert pool.take((0,), torch.float32).numel() == 0
    assert pool.take((2, 2), torch.float32) is None  # not in the layout: the caller allocates
    assert pool.prepared_bytes == pool.taken_bytes == 3 * 4 * 2 + 2 * 5 * 4
    pool.release()
    # Over the budget: what fits, in the layout's order (the first tensor alone is over 16 bytes).
    small = HostPool()
    small.prepare(layout, budget_bytes=16)
    assert small.take((3, 4), torch.bfloat16) is None and small.prepared_bytes == 0
    part = HostPool()
    part.prepare(layout, budget_bytes=50)
    assert part.take((3, 4), torch.bfloat16) is not None and part.take((5,), torch.float32) is not None
    assert part.take((5,), torch.float32) is None and part.prepared_bytes == 3 * 4 * 2 + 5 * 4
    # No layout by the stage's turn (the previous train wrote none): the thread gives up at once.
    none = HostPool()
    none.prepare(tmp_path / "absent.json", budget_bytes=1 << 20)
    none.turn_came()
    t0 = time.time()
    assert none.take((3, 4), torch.bfloat16) is None and time.time() - t0 < 1.0
    # The previous checkpoint still being written: nothing is prepared until it is, and the budget
    # is read then (its write may take host memory the snapshot must leave to it).
    written, asked = [], []
    waiting = HostPool()
    waiting.prepare(layout, budget_bytes=lambda: asked.append(time.time()) or 1 << 20, ready=lambda: bool(written))
    time.sleep(0.3)
    assert not asked and waiting.prepared_bytes == 0
    written.append(True)
    assert waiting.take((3, 4), torch.bfloat16) is not None and len(asked) == 1
    waiting.release()


def test_the_snapshot_budget_counts_a_checkpoint_directory_in_host_memory(tmp_path, monkeypatch):
    # A file written to tmpfs takes host memory as its snapshot did: the budget is halved there, and
    # what the pool already holds for the snapshot is counted in (it is memory the snapshot has).
    from types import SimpleNamespace

    from stages.rl import deferred_checkpoint as dc

    monkeypatch.setattr(dc, "available_host_bytes", lambda: 100 << 30)
    disk = tmp_path / "run"
    ctx = SimpleNamespace(world_size=2, info=SimpleNamespace(num_nodes=1),
                          paths=SimpleNamespace(checkpoints=disk / "checkpoints"))
    in_memory = Path("/dev/shm")
    if not dc.memory_backed(in_memory):
        pytest.skip("/dev/shm is not a tmpfs on this machine")
    assert not dc.memory_backed(disk) or dc.memory_backed(tmp_path)
    if dc.memory_backed(tmp_path):
        pytest.skip("the test's temporary directory is itself on tmpfs")
    share = int((100 << 30) * dc.HOST_MEMORY_SHARE / 2)
    assert dc.snapshot_budget(ctx, ctx.paths.checkpoints) == share
    assert dc.snapshot_budget(ctx, ctx.paths.checkpoints, held=8 << 30) == share + (8 << 30)
    # The run dir's checkpoints/ a symbolic link to tmpfs, as a user may make it.
    target = Path(tempfile.mkdtemp(dir=in_memory))
    try:
        disk.mkdir()
        (disk / "checkpoints").symlink_to(target)
        assert dc.memory_backed(disk / "checkpoints") and dc.memory_backed(disk / "checkpoints" / "iter_00001")
        assert dc.snapshot_budget(ctx, ctx.paths.checkpoints) == share // 2
        assert dc.snapshot_budget(ctx, ctx.paths.checkpoints, held=8 << 30) == (share + (8 << 30)) // 2
    finally:
        shutil.rmtree(target)


def test_a_file_over_the_budget_holds_the_pieces_that_fit_and_writes_the_rest_now(tmp_path, monkeypatch):
    # On CPU a snapshot copies nothing (host tensors are kept), so no file is ever over the budget in a
    # run here: the test counts host bytes as a GPU's would be counted, to split a file as a GPU's
    # train does (test_gpu.py splits real GPU tensors). DeepSpeed's torch engine behind the threaded writer.
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from stages.rl import deferred_checkpoint as dc
    from stages.rl.serialization import ThreadedWrites

    counted = dc.state_bytes
    monkeypatch.setattr(dc, "state_bytes", lambda obj, host_too=False: counted(obj, host_too=True))
    state = {"exp_avg": torch.arange(10_000, dtype=torch.float32), "step": torch.tensor(7),
             "groups": [torch.randn(3_000)], "meta": {"lr": 0.1}}  # 40,000, 8 and 12,000 bytes
    expected = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
    path = tmp_path / "optim_states.pt"
    writes = dc.DeferredWrites(ThreadedWrites(TorchCheckpointEngine(), 2), budget_bytes=20_000, piece_bytes=4096)
    writes.save(state, str(path))
    # Four whole pieces of exp_avg fit the 20,000 bytes; the rest of it, the step and the group (whose
    # first piece no longer fits) are written now.
    (_, held), = writes.queued
    assert isinstance(held, dc.HeldPieces) and [t.numel() for t, _ in held] == [4096] * 4
    assert writes.written_now == 40_000 - 4 * 4096 + 8 + 12_000 and writes.layout == []  # host pieces: no copies
    assert writes.find("optim_states.pt") is None  # a part of a file is not a state
    early = torch.load(path)
    assert torch.equal(early["exp_avg"][4096:], expected["exp_avg"][4096:]) and early["step"] == 7
    assert not early["exp_avg"][1:4096].any()  # the held bytes are not in the file yet
    assert torch.equal(early["groups"][0], expected["groups"][0])
    writes.flush()
    loaded = torch.load(path)
    assert all(torch.equal(loaded[k], expected[k]) for k in ("exp_avg", "step"))
    assert torch.equal(loaded["groups"][0], expected["groups"][0]) and loaded["meta"] == {"lr": 0.1}
    # Less room than a piece: the whole file is written now, as before.
    whole = dc.DeferredWrites(ThreadedWrites(TorchCheckpointEngine(), 2), budget_bytes=4000, piece_bytes=4096)
    whole.save(state, str(tmp_path / "whole.pt"))
    assert not whole.queued and whole.written_now == 52_008


def test_split_pieces_hold_whole_pieces_in_file_order_while_they_fit():
    from stages.rl.deferred_checkpoint import split_pieces

    a, b, c = (torch.empty(n, dtype=torch.uint8).untyped_storage() for n in (10, 3, 7))
    held, now = split_pieces([(a, 100), (b, 200), (c, 300)], room=9, piece=4)
    assert [(s is a, start, n, at) for s, start, n, at in held] == [(True, 0, 4, 100), (True, 4, 4, 100)]
    assert [(start, n, at) for _, start, n, at in now] == [(8, 2, 100), (0, 3, 200), (0, 7, 300)]
    held, now = split_pieces([(a, 100), (c, 300)], room=20, piece=4)
    assert [(start, n) for _, start, n, _ in held] == [(0, 4), (4, 4), (8, 2), (0, 4), (4, 3)] and now == []


def test_a_file_over_the_budget_is_written_before_the_marker_and_said_so(tmp_path):
    # DeferredWrites in front of DeepSpeed's own torch engine. On CPU a snapshot holds no bytes of its
    # own (host tensors are kept), so a budget of zero takes a file and a negative one takes none.
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    from stages.rl import deferred_checkpoint as dc

    small, large = {"w": torch.ones(256)}, {"m": torch.ones(4096)}  # 1 KiB, 16 KiB of float32
    held = dc.DeferredWrites(TorchCheckpointEngine(), budget_bytes=0)
    held.save(small, str(tmp_path / "model_states.pt"))
    assert not (tmp_path / "model_states.pt").exists() and held.written_now == 0
    over = dc.DeferredWrites(TorchCheckpointEngine(), budget_bytes=-1)
    over.save(large, str(tmp_path / "optim_states.pt"))
    assert (tmp_path / "optim_states.pt").is_file() and over.written_now == 16384 and not over.queued
    held.flush()
    assert torch.equal(torch.load(tmp_path / "model_states.pt")["w"], small["w"])
    # What train's summary line says of each (the marker's deferred_checkpoint record).
    note = dc.deferral_note({"snapshot_gb": 1.0, "written_now_gb": 33.8, "written_now_s": 30.1, "budget_gb": 21.5,
                             "folder_in_memory": True})
    assert "33.80 GB written before it, in 30.1s" in note and "budget of 21.50 GB" in note and "tmpfs" in note
    assert dc.deferral_note({"snapshot_gb": 5.6, "written_now_gb": 0.0}) == \
        " (5.60 GB in host memory, written after the marker)"
