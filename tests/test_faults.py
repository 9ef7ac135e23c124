"""Fault injection on the real two-node SLURM cluster (and locally where SLURM adds nothing).

Each case injects a fault, then checks that the run either finishes with the same results as an
undisturbed run of the same seed or stops within a bounded time with a clear message, that no
completed stage is redone, and that no file in the run dir is half-written. Each prints its
time-to-detect and time-to-recover (run with -s to see them; docs/benchmarks.md's fault matrix comes from these).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stages.runtime.paths import STAGES
from tests.conftest import PLAIN_CHECKPOINT_RUN
from tests.slurm_fixture import (SMALL_RUN, job_log, job_state, rank_pid, run, sbatch, wait_finished, wait_for,
                                 wait_in_job)

ROOT = Path(__file__).resolve().parents[1]
JOB_TIMEOUT_S = 600


def report(case: str, detect_s: float | None, recover_s: float | None) -> None:
    fmt = lambda x: "-" if x is None else f"{x:.1f}s"  # noqa: E731
    print(f"\nFAULT {case}: time-to-detect {fmt(detect_s)}, time-to-recover {fmt(recover_s)}")


def sbatch_run(out_dir: Path, run_dir: Path, *extra: str, env: dict | None = None) -> str:
    return sbatch(out_dir, "slurm/rl_2node.sbatch", "configs/local_tiny.yaml", f"run_dir={run_dir}",
                  "iterations=1", *SMALL_RUN, *extra, env=env)


def done_markers(run_dir: Path) -> dict[str, int]:
    return {str(p.relative_to(run_dir)): p.stat().st_mtime_ns for p in run_dir.glob("iter_*/markers/*.done")}


def no_half_files(run_dir: Path) -> None:
    temps = [p for p in run_dir.rglob("*") if ".tmp" in p.name]
    assert not temps, f"half-written files left: {temps}"


def rerun_under_file_limit(run_dir: Path, iteration: int, stage: str, kib: int = 64):
    """`syncrl rerun` of one stage under `ulimit -f` (every file of its processes capped at `kib` KiB)."""
    return subprocess.run(["bash", "-c", f'ulimit -f {kib} && exec "$@"', "_", sys.executable, "-m", "jobs.cli",
                           "rerun", str(run_dir), "--iteration", str(iteration), "--stage", stage, "--launcher",
                           "local"], cwd=ROOT, capture_output=True, text=True, timeout=600)


def tree_bytes(root: Path) -> dict:
    return {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def final_weights(run_dir: Path) -> bytes:
    return (run_dir / "models" / "iter_00000" / "model.safetensors").read_bytes()


@pytest.fixture(scope="module")
def reference_run(slurm_cluster, tiny_run):
    """An undisturbed run of the same workload and seed: the results every recovered run must
    reproduce (iteration 0's). The session's tiny_run (tests/conftest.py) serves: a stage's outputs
    depend on the seed, the iteration and the rank, not on the launcher that placed the rank, so its
    iteration 0 is byte for byte that of a 1-iteration SMALL_RUN job on the cluster, and it is made
    while the cluster runs other tests."""
    return tiny_run.dir


def job_that_fails(out_dir: Path, run_dir: Path, *extra: str) -> tuple[str, float]:
    """sbatch_run, which must end FAILED with the resume hint; returns (its log, seconds to fail)."""
    t0 = time.time()
    job = sbatch_run(out_dir, run_dir, *extra)
    state = wait_finished(job, JOB_TIMEOUT_S, "the job to stop")
    detect = time.time() - t0
    log = job_log(out_dir, job)
    assert state == "FAILED", log[-3000:]
    assert "run the same command again" in log, log[-3000:]
    return log, detect


def same_results(run_dir: Path, reference: Path) -> None:
    for stage in ("generate", "score"):
        for rank in (0, 1):
            name = f"iter_00000/{stage}/rank_{rank:05d}.jsonl"
            assert (run_dir / name).read_bytes() == (reference / name).read_bytes(), name
    assert (run_dir / "iter_00000/gather/train.jsonl").read_bytes() == \
        (reference / "iter_00000/gather/train.jsonl").read_bytes()
    assert final_weights(run_dir) == final_weights(reference)


TRAIN_TIMEOUT_S = 45


@pytest.mark.slurm
@pytest.mark.slow
def test_a_generate_rank_that_exits_and_a_hung_train_rank_are_retried(reference_run, tmp_path):
    """Two faults of one run, each in its own stage: generate's rank 1 exits non-zero, and once
    generate is retried and done, train's rank 1 hangs at its first barrier. Each stage's failed
    attempt is detected (the hang within the collective timeout) and retried, and the run ends with
    the undisturbed run's results."""
    run_dir = tmp_path / "run"
    # The collective timeout: past the longest wait of a rank whose peer is slow but not hung (a retried
    # rank starts without a preload, and on two loaded cores its imports alone took over 20 s).
    job = sbatch_run(tmp_path, run_dir, f"train.timeout_s={TRAIN_TIMEOUT_S}")
    log = run_dir / "logs" / "iter_00000" / "generate" / "attempt_1" / "rank_00001.log"
    pid = wait_in_job(job, tmp_path, lambda: rank_pid(log), 300, "generate rank 1 to start", interval=0.02)
    os.kill(pid, signal.SIGTERM)  # the rank exits non-zero (143)
    t_fault = time.time()
    attempt2 = run_dir / "logs" / "iter_00000" / "generate" / "attempt_2"
    wait_for(attempt2.is_dir, 120, "the retry to start", interval=0.05)
    detect = time.time() - t_fault
    wait_for(lambda: (run_dir / "iter_00000/markers/generate.done").is_file(), 300, "generate to finish")
    report("generate rank exits non-zero", detect, time.time() - t_fault)

    log = run_dir / "logs" / "iter_00000" / "train" / "attempt_1" / "rank_00001.log"
    wait_in_job(job, tmp_path, lambda: log.is_file() and "barrier 'iteration 0 engine ready'" in log.read_text(), 300,
                "train rank 1 to reach its first barrier", interval=0.01)
    os.kill(rank_pid(log), signal.SIGSTOP)  # hangs: alive, holding its sockets, never answering
    t_fault = time.time()
    attempt2 = run_dir / "logs" / "iter_00000" / "train" / "attempt_2"
    wait_for(attempt2.is_dir, 120, "the hang to be detected and the stage retried", interval=0.1)
    detect = time.time() - t_fault
    assert wait_finished(job, JOB_TIMEOUT_S, "the job") == "COMPLETED", job_log(tmp_path, job)
    recover = time.time() - t_fault
    summary = job_log(tmp_path, job)
    assert "iteration 0 generate attempt 1 failed on rank(s) 1" in summary
    assert "iteration 0 train attempt 1 failed" in summary
    assert detect < TRAIN_TIMEOUT_S + 30  # the collective timeout plus step teardown: bounded, not forever
    same_results(run_dir, reference_run)
    no_half_files(run_dir)
    report("train rank hangs (SIGSTOP)", detect, recover)


@pytest.mark.slurm
@pytest.mark.slow
def test_usr2_before_time_limit_requeues_and_resumes(reference_run, tmp_path):
    run_dir = tmp_path / "run"
    job = sbatch_run(tmp_path, run_dir)
    wait_for(lambda: (run_dir / "iter_00000/markers/score.done").is_file(), 300, "score to finish", interval=0.05)
    before = done_markers(run_dir)
    run(["scancel", "--signal=USR2", "--batch", job], timeout=30)  # what SLURM sends 300 s before the limit
    t_fault = time.time()
    wait_for(lambda: "caught USR2" in job_log(tmp_path, job), 60, "the script to catch USR2", interval=0.1)
    detect = time.time() - t_fault
    wait_for(lambda: (run_dir / "iter_00000/markers/save.done").is_file(), JOB_TIMEOUT_S, "the requeued job")
    recover = time.time() - t_fault
    wait_finished(job, 120, "the job")
    after = done_markers(run_dir)
    assert all(after[k] == v for k, v in before.items()), "a completed stage was redone"
    assert job_log(tmp_path, job).count("(restart 1)") == 1
    same_results(run_dir, reference_run)
    report("USR2 before the time limit (requeue)", detect, recover)


@pytest.mark.slurm
@pytest.mark.slow
def test_coordinator_killed_and_restarted(reference_run, tmp_path):
    run_dir = tmp_path / "run"
    job = sbatch_run(tmp_path, run_dir)
    # Train is running once the coordinator says so (an attempt that failed while it set up before its
    # turn leaves the next one running instead).
    wait_in_job(job, tmp_path, lambda: re.search(r"iteration 0 train\s+(started early:|launching) attempt",
                                                 job_log(tmp_path, job)), 300, "train to start", interval=0.05)
    before = done_markers(run_dir)
    run(["scancel", job], timeout=30)  # the whole job, coordinator included, goes away mid-train
    t_fault = time.time()
    wait_finished(job, 60, "the cancelled job to end")
    status = run([sys.executable, "-m", "jobs.cli", "status", str(run_dir)], timeout=30).stdout
    assert re.search(r"0  train\s+interrupted", status), status
    detect = time.time() - t_fault
    job2 = sbatch_run(tmp_path, run_dir)
    assert wait_finished(job2, JOB_TIMEOUT_S, "the restarted job") == "COMPLETED"
    recover = time.time() - t_fault
    after = done_markers(run_dir)
    assert all(after[k] == v for k, v in before.items()), "a completed stage was redone"
    assert "iteration 0 gather   already done, skipping" in job_log(tmp_path, job2)
    same_results(run_dir, reference_run)
    no_half_files(run_dir)
    report("coordinator killed (scancel) and restarted", detect, recover)


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncate generate shard", "delete score shard", "alter gather output"])
def test_damaged_outputs_are_redone(reference_run, tmp_path, damage):
    run_dir = tmp_path / "run"
    shutil.copytree(reference_run, run_dir, symlinks=True)
    # The copy's frozen config names the reference run dir; a copy is a new run at a new path.
    cfg = (run_dir / "config.yaml").read_text().replace(str(reference_run), str(run_dir))
    (run_dir / "config.yaml").write_text(cfg)
    target, stage = {
        "truncate generate shard": ("iter_00000/generate/rank_00001.jsonl", "generate"),
        "delete score shard": ("iter_00000/score/rank_00000.jsonl", "score"),
        "alter gather output": ("iter_00000/gather/stats.json", "gather"),
    }[damage]
    path = run_dir / target
    if damage.startswith("truncate"):
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage.startswith("delete"):
        path.unlink()
    else:
        path.write_text(path.read_text() + " ")
    t_fault = time.time()
    status = run([sys.executable, "-m", "jobs.cli", "status", str(run_dir)], timeout=30).stdout
    assert re.search(rf"0  {stage}\s+stale", status), status
    detect = time.time() - t_fault
    before = done_markers(run_dir)
    job = sbatch_run(tmp_path, run_dir)
    assert wait_finished(job, JOB_TIMEOUT_S, "the job") == "COMPLETED", job_log(tmp_path, job)
    recover = time.time() - t_fault
    log = job_log(tmp_path, job)
    assert re.search(rf"iteration 0 {stage}\s+redoing: output {re.escape(target)}", log), log
    upstream = STAGES[:STAGES.index(stage)]
    for s in upstream:  # nothing before the damaged stage was touched
        assert done_markers(run_dir)[f"iter_00000/markers/{s}.done"] == before[f"iter_00000/markers/{s}.done"]
    same_results(run_dir, reference_run)
    report(f"marker's output damaged ({damage})", detect, recover)


def test_config_changed_between_run_and_resume_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    from jobs.check import resolve_paths
    from stages.runtime.config import dump_config, load_config
    cfg = load_config(ROOT / "configs" / "local_tiny.yaml", [f"run_dir={run_dir}"])
    resolve_paths(cfg)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "run", "configs/local_tiny.yaml", f"run_dir={run_dir}",
                           "generate.temperature=0.7"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "different config (generate.temperature: 1.0 -> 0.7)" in proc.stderr
    assert "another run_dir" in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml"]  # nothing started
    report("config changed between run and resume", time.time() - t0, None)


def copy_of_the_plain_checkpoint_run(shared, tmp_path: Path) -> tuple[Path, list[str]]:
    """A copy of the session's finished plain_checkpoint_run (tests/conftest.py) to damage, and the
    run command that resumes the copy."""
    run_dir = tmp_path / "run"
    shutil.copytree(shared.dir, run_dir)
    return run_dir, [sys.executable, "-m", "jobs.cli", "run", PLAIN_CHECKPOINT_RUN[0], f"run_dir={run_dir}",
                     *PLAIN_CHECKPOINT_RUN[1:], "--launcher", "local"]


@pytest.mark.slow
def test_disk_full_while_saving_keeps_the_published_model(plain_checkpoint_run, tmp_path):
    """Local: a file-size limit on the save process stands in for a full disk (EFBIG, like ENOSPC).
    The checkpoint is written before train's marker, so that save writes the weights itself (with
    it written after, save links in the file train wrote: tests/test_save_export.py)."""
    run_dir, cmd = copy_of_the_plain_checkpoint_run(plain_checkpoint_run, tmp_path)
    model = run_dir / "models" / "iter_00001" / "model.safetensors"
    published = model.read_bytes()
    # Save iteration 1 again under a 64 KiB file-size limit: the 280 KB export cannot be written.
    t0 = time.time()
    limited = rerun_under_file_limit(run_dir, 1, "save")
    detect = time.time() - t0
    assert limited.returncode == 1, limited.stderr[-3000:]
    assert "iteration 1 save attempt 2 failed" in limited.stderr
    assert "File too large" in limited.stderr, limited.stderr[-3000:]
    # The published model is intact and loads; nothing half-written is left beside it.
    assert model.read_bytes() == published
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(model.parent)
    no_half_files(run_dir)
    status = run([sys.executable, "-m", "jobs.cli", "status", str(run_dir)], timeout=30).stdout
    assert re.search(r"1  save\s+failed", status), status
    # With space again, the same run command finishes it, redoing only the save.
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    recover = time.time() - t0
    assert again.stderr.count("launching") == 1 and "iteration 1 save     launching" in again.stderr
    AutoModelForCausalLM.from_pretrained(model.parent)
    report("disk full while saving", detect, recover)


@pytest.mark.slow
def test_disk_full_while_train_writes_its_checkpoint_keeps_the_published_one(plain_checkpoint_run, tmp_path):
    """Local: a file-size limit on train's ranks stands in for a full disk (EFBIG, like ENOSPC).
    The run keeps two checkpoints, so redoing iteration 1's train resumes iteration 0's optimizer
    state, and writes them before train's marker (tests/test_deferred_checkpoint.py has the
    checkpoint written after it on a full disk)."""
    run_dir, cmd = copy_of_the_plain_checkpoint_run(plain_checkpoint_run, tmp_path)
    ckpt = run_dir / "checkpoints" / "iter_00001"
    published = tree_bytes(ckpt)
    weights = (run_dir / "models" / "iter_00001" / "model.safetensors").read_bytes()
    # Train iteration 1 again under a 64 KiB file-size limit: its shards (~0.4 MB each) cannot be written.
    t0 = time.time()
    limited = rerun_under_file_limit(run_dir, 1, "train")
    detect = time.time() - t0
    assert limited.returncode == 1, limited.stderr[-3000:]
    assert "iteration 1 train attempt 2 failed" in limited.stderr, limited.stderr[-3000:]
    # The published checkpoint is whole and unchanged; the partial write stayed in its staging directory.
    assert tree_bytes(ckpt) == published
    assert [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".")] == [".iter_00001.tmp"]
    # With space again, the same run command redoes train, to a bit-identical checkpoint: save's
    # inputs are unchanged, so its export stands. Nothing half-written is left.
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    recover = time.time() - t0
    assert "iteration 1 train    launching" in again.stderr and "iteration 1 save     already done" in again.stderr
    assert tree_bytes(ckpt) == published
    assert (run_dir / "models" / "iter_00001" / "model.safetensors").read_bytes() == weights
    no_half_files(run_dir)
    report("disk full while train writes its checkpoint", detect, recover)


@pytest.fixture
def small_disk(tmp_path):
    """A real filesystem of a given size (tmpfs), mounted for the test; skips where mounting is not allowed."""
    mounts = []

    def make(kib: int, where: Path | None = None) -> Path:
        where = where or tmp_path / f"disk{len(mounts)}"
        where.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={kib}k", "tmpfs", str(where)], capture_output=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
        mounts.append(where)
        return where

    yield make
    for where in mounts:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.mark.slow
def test_disk_full_at_the_start_is_one_line(small_disk):
    disk = small_disk(64)
    with open(disk / "filler", "wb", buffering=0) as f:  # take every block
        try:
            while True:
                f.write(b"x" * 4096)

        except OSError:
            pass
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "run", "configs/local_tiny.yaml", f"run_dir={disk}/run",
                           "iterations=1", *SMALL_RUN, "--launcher", "local"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    # Before it: check's warning that the run will not fit there (jobs/check.py space_warnings).
    warning, error = proc.stderr.strip().splitlines()
    assert "coordinator WARNING" in warning and "the run will hold about" in warning, proc.stderr
    assert "the disk is full" in error, proc.stderr


@pytest.mark.slow
def test_disk_full_during_train_is_recorded_as_a_failure(small_disk):
    """A 1.2 MB filesystem holds the run up to train, not train's 1.4 MB checkpoint. The checkpoint is
    written before train's marker: written after it, whether the disk fills before the marker or after
    it depends on a few bytes of logs (that case: tests/test_deferred_checkpoint.py)."""
    run_dir = small_disk(1200) / "run"
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "run", "configs/local_tiny.yaml", f"run_dir={run_dir}",
                           "iterations=1", *SMALL_RUN, "tuning.deferred_checkpoint=false", "--launcher", "local"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    detect = time.time() - t0
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "iteration 0 train attempt" in proc.stderr and "failed on rank(s)" in proc.stderr, proc.stderr[-3000:]
    assert "run the same command again" in proc.stderr
    assert "Traceback (most recent call last)" not in proc.stderr.split("coordinator")[-1]
    status = run([sys.executable, "-m", "jobs.cli", "status", str(run_dir)], timeout=30).stdout
    assert re.search(r"0  train\s+failed", status), status
    assert re.search(r"0  gather\s+done", status), status  # nothing completed is lost
    report("disk full during train", detect, None)


@pytest.mark.slurm
@pytest.mark.slow
def test_rerun_on_two_nodes_acts_on_the_copy_it_is_given(reference_run, tmp_path):
    """A copy of a finished run, its score stage rerun through slurm/rerun_stage.sbatch (srun over both
    nodes): the copy's score is redone to the same results, and nothing of the original changes."""
    # What a rerun of iteration 0's score acting on the original would change there. The original
    # (the session's tiny_run) is also read by other workers' tests, one of which runs it again,
    # every stage skipped, which leaves its W&B and report files newer.
    original = [reference_run / "iter_00000", reference_run / "logs" / "iter_00000"]
    before = {p: p.stat().st_mtime_ns for d in original for p in [d, *d.rglob("*")]}
    copy = tmp_path / "copy"
    shutil.copytree(reference_run, copy)
    marker = copy / "iter_00000" / "markers" / "score.done"
    copied = marker.stat().st_mtime_ns
    job = sbatch(tmp_path, "slurm/rerun_stage.sbatch", str(copy), "0", "score")
    assert wait_finished(job, JOB_TIMEOUT_S, "the rerun job") == "COMPLETED", job_log(tmp_path, job)
    assert marker.stat().st_mtime_ns != copied
    assert (copy / "logs" / "iter_00000" / "score" / "attempt_2").is_dir()
    for rank in (0, 1):
        name = f"iter_00000/score/rank_{rank:05d}.jsonl"
        assert (copy / name).read_bytes() == (reference_run / name).read_bytes(), name
    assert {p: p.stat().st_mtime_ns for d in original for p in [d, *d.rglob("*")]} == before  # untouched
    no_half_files(copy)


@pytest.mark.slurm
@pytest.mark.slow
def test_disk_full_during_train_on_two_nodes_is_recorded_as_a_failure(slurm_cluster, small_disk, tmp_path):
    """The run dir on a 1.2 MB filesystem, run by slurm/rl_2node.sbatch: train's ranks on n1 and n2
    hit ENOSPC writing the checkpoint. The job fails with the stage, the ranks and the resume hint in
    its log, status says train failed, and every stage before it stays done. The checkpoint is written
    before the marker: written after it, whether the disk fills before the marker (the policy file) or
    after it depends on a few bytes of logs (that case: test_deferred_checkpoint.py)."""
    run_dir = small_disk(1200) / "run"
    log, detect = job_that_fails(tmp_path, run_dir, "retry.attempts=1", "tuning.deferred_checkpoint=false")
    assert "iteration 0 train attempt" in log and "failed on rank(s)" in log, log[-3000:]
    assert "Traceback (most recent call last)" not in log.split("coordinator")[-1], log[-3000:]
    status = run([sys.executable, "-m", "jobs.cli", "status", str(run_dir)], timeout=30).stdout
    assert re.search(r"0  train\s+failed", status), status
    assert re.search(r"0  gather\s+done", status), status
    report("disk full during train (2 nodes)", detect, None)


@pytest.mark.slurm
@pytest.mark.slow
def test_node_lost_during_a_step(reference_run, tmp_path):
    """n2's slurmd and every process on it die mid-train; the job ends NODE_FAIL, requeues, waits for
    the node, and resumes at train once n2 is back."""
    run_dir = tmp_path / "run"
    # Train's rank 1 waits 60 s before its updates (tests/slow_train): the tiny update alone is over
    # before the node can be failed.
    slow = {"PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "slow_train"), str(ROOT)]),
            "SYNCRL_TEST_SLOW_TRAIN": "0:1:60"}
    job = sbatch_run(tmp_path, run_dir, env=slow)
    log = run_dir / "logs" / "iter_00000" / "train" / "attempt_1" / "rank_00001.log"
    wait_in_job(job, tmp_path, lambda: "slow_train: waiting" in (log.read_text() if log.is_file() else ""), 300,
                "train rank 1 (on n2) to start its updates", interval=0.05)
    before = done_markers(run_dir)
    cluster = ["bash", str(ROOT / "slurm" / "local_cluster.sh")]
    try:
        run([*cluster, "fail-node", "n2"], timeout=60)
        t_fault = time.time()
        # SLURM declares n2 down after SlurmdTimeout and requeues the job (or the coordinator stops it).
        wait_for(lambda: job_state(job) in ("PENDING", "REQUEUED", "REQUEUE_FED", "FAILED", "NODE_FAIL"), 180,
                 "the job to notice the lost node", interval=0.5)
        detect = time.time() - t_fault
    finally:
        run([*cluster, "revive-node", "n2"], timeout=120)
    if job_state(job) in ("FAILED", "NODE_FAIL"):
        job = sbatch_run(tmp_path, run_dir)  # the job could not requeue itself: submit it again
    assert wait_finished(job, JOB_TIMEOUT_S, "the job to finish") == "COMPLETED", job_log(tmp_path, job)
    recover = time.time() - t_fault
    after = done_markers(run_dir)
    assert all(after[k] == v for k, v in before.items()), "a completed stage was redone"
    same_results(run_dir, reference_run)
    no_half_files(run_dir)
    report("node lost (slurmd and tasks of n2 killed)", detect, recover)


def local_store_files(store: Path) -> list[Path]:
    return sorted(p for p in store.rglob("*") if p.is_file()) if store.exists() else []


# The node-local checkpoint cases run under ZeRO-2 (the weights whole in the first node's model
# states) and ZeRO-3 (every file a rank's shard; train gathers the weights into save's policy file).
ZERO_STAGES = {"zero2": [], "zero3": ["train.deepspeed_config=configs/ds_zero3_cpu.json"]}


def export_is_the_checkpoints(run_dir: Path, it: int) -> None:
    """models/iter_I holds the fp32 master weights of checkpoints/iter_I (in the export's dtype)."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    master = get_fp32_state_dict_from_zero_checkpoint(str(run_dir / "checkpoints"), tag=f"iter_{it:05d}")
    exported = load_file(run_dir / "models" / f"iter_{it:05d}" / "model.safetensors")
    assert all(torch.equal(exported[k], master[k].to(exported[k].dtype)) for k in exported), it


def whole_durable_copy(folder: Path, zero: str) -> None:
    """Every train rank's shards are in `folder`, and under ZeRO-2 the model states every node holds."""
    names = sorted(p.name for p in folder.iterdir())
    if zero == "zero2":
        assert sum("zero_pp_rank_" in n for n in names) == 2 and "mp_rank_00_model_states.pt" in names, names
    else:
        assert sum("zero_pp_rank_" in n and n.endswith("_optim_states.pt") for n in names) == 2, names
        assert sum("zero_pp_rank_" in n and n.endswith("_model_states.pt") for n in names) == 2, names


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.parametrize("zero", ZERO_STAGES)
def test_node_local_checkpoint_lost_before_resume_on_two_nodes(slurm_cluster, tmp_path, zero):
    """Train writes each node's checkpoint share to that node's own local folder (n1's, n2's); the
    persist stage copies them to the run dir. Train of iteration 1 is then redone in a new allocation
    whose nodes hold no local copy: both nodes resume iteration 0's optimizer state from the durable
    copy, and the run completes with the same weights."""
    run_dir, store = tmp_path / "run", tmp_path / "node_local"
    extra = ["iterations=2", f"train.local_checkpoint_dir={store}", "save.keep_checkpoints=2", *ZERO_STAGES[zero]]
    job = sbatch_run(tmp_path, run_dir, *extra)
    assert wait_finished(job, JOB_TIMEOUT_S, "the run") == "COMPLETED", job_log(tmp_path, job)
    weights = (run_dir / "models" / "iter_00001" / "model.safetensors").read_bytes()
    logs = sorted((run_dir / "logs" / "iter_00001" / "train" / "attempt_1").glob("rank_*.log"))
    assert len(logs) == 2
    for node, log in zip(("n1", "n2"), logs):
        text = log.read_text()
        assert re.search(rf"resumed weights and optimizer state from {re.escape(str(store))}/\S+/{node}/", text), text[-2000:]
    for it in (0, 1):  # the durable copies, whole: every rank's shard (and the model states)
        whole_durable_copy(run_dir / "checkpoints" / f"iter_{it:05d}", zero)
    if zero == "zero3":  # no node holds the weights whole: save linked in the file train gathered them into
        save_log = (run_dir / "logs" / "iter_00001" / "save" / "attempt_1" / "rank_00000.log").read_text()
        assert "exported by linking" in save_log, save_log[-2000:]
        export_is_the_checkpoints(run_dir, 1)
    assert local_store_files(store) == []  # the run's last persist emptied the nodes' folders
    # A new allocation: no node-local copy anywhere. Redo train of iteration 1 over both nodes.
    shutil.rmtree(store, ignore_errors=True)
    t0 = time.time()
    job = sbatch(tmp_path, "slurm/rerun_stage.sbatch", str(run_dir), "1", "train")
    assert wait_finished(job, JOB_TIMEOUT_S, "the rerun") == "COMPLETED", job_log(tmp_path, job)
    detect = time.time() - t0
    for log in sorted((run_dir / "logs" / "iter_00001" / "train" / "attempt_2").glob("rank_*.log")):
        text = log.read_text()
        assert "resuming from the durable copy" in text, text[-2000:]
        assert f"resumed weights and optimizer state from {run_dir / 'checkpoints'}" in text
    # The same run command redoes what reads train's new checkpoint (persist, save), to the same weights.
    job = sbatch_run(tmp_path, run_dir, *extra)
    assert wait_finished(job, JOB_TIMEOUT_S, "the run again") == "COMPLETED", job_log(tmp_path, job)
    recover = time.time() - t0
    log = job_log(tmp_path, job)
    assert "iteration 1 save     launching" in log and "iteration 1 generate already done" in log, log[-3000:]
    assert (run_dir / "models" / "iter_00001" / "model.safetensors").read_bytes() == weights
    assert local_store_files(store) == []
    no_half_files(run_dir)
    report(f"node-local checkpoint lost before resume (2 nodes, {zero})", detect, recover)


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.parametrize("zero", ZERO_STAGES)
def test_disk_full_during_the_durable_copy_on_two_nodes(reference_run, small_disk, tmp_path, zero):
    """The run dir's checkpoints/ on a 400 KB filesystem, node-local checkpoints elsewhere: persist's
    copy hits ENOSPC. The job stops naming persist, every other stage stays done, no checkpoint
    looks whole, and both nodes' local copies are kept; with space again the same command redoes
    persist alone, and the weights are those save published before persist failed (under ZeRO-2,
    the undisturbed ZeRO-2 run's)."""
    run_dir, store = tmp_path / "run", tmp_path / "node_local"
    extra = [f"train.local_checkpoint_dir={store}", "retry.attempts=1", *ZERO_STAGES[zero]]
    small_disk(400, run_dir / "checkpoints")
    t0 = time.time()
    log, detect = job_that_fails(tmp_path, run_dir, *extra)
    assert "iteration 0 persist attempt 1 failed" in log and "No space left on device" in log, log[-3000:]
    assert not (run_dir / "checkpoints" / "iter_00000").exists()
    kept = [p.relative_to(store) for p in local_store_files(store)]
    for node in ("n1", "n2"):
        assert any(p.parts[1] == node and "zero_pp_rank_" in p.name for p in kept), kept
    status = run([sys.executable, "-m", "jobs.cli", "status", str(run_dir)], timeout=30).stdout
    assert re.search(r"0  persist\s+failed", status) and re.search(r"0  save\s+done", status), status
    published = final_weights(run_dir)
    subprocess.run(["umount", "-l", str(run_dir / "checkpoints")], capture_output=True)  # space again
    job = sbatch_run(tmp_path, run_dir, *extra)
    assert wait_finished(job, JOB_TIMEOUT_S, "the run again") == "COMPLETED", job_log(tmp_path, job)
    recover = time.time() - t0
    log = job_log(tmp_path, job)
    assert "iteration 0 persist  started in the background" in log and "launching" not in log, log[-3000:]
    whole_durable_copy(run_dir / "checkpoints" / "iter_00000", zero)
    assert final_weights(run_dir) == published
    if zero == "zero2":
        same_results(run_dir, reference_run)
    assert local_store_files(store) == []
    no_half_files(run_dir)
    report(f"disk full during the durable copy (2 nodes, {zero})", detect, recover)


@pytest.mark.slurm
@pytest.mark.slow
def test_node_lost_between_durable_copies_on_two_nodes(slurm_cluster, tmp_path):
    """ZeRO-3 with a durable copy every 5 iterations over 2: iteration 0's checkpoint is on the nodes
    only. Both nodes' storage is then lost (a new allocation), and iteration 1's train is redone: no
    copy of iteration 0's checkpoint is anywhere, so the rerun fails naming the way back, and the run
    command goes back to iteration 0 (no durable copy before it) and redoes the two iterations, at most
    the iterations since the last durable copy, to the same weights."""
    run_dir, store = tmp_path / "run", tmp_path / "node_local"
    extra = ["iterations=2", f"train.local_checkpoint_dir={store}", "train.durable_every=5", *ZERO_STAGES["zero3"]]
    job = sbatch_run(tmp_path, run_dir, *extra)
    assert wait_finished(job, JOB_TIMEOUT_S, "the run") == "COMPLETED", job_log(tmp_path, job)
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["iter_00001"]  # the run's last only
    weights = [(run_dir / "models" / f"iter_{it:05d}" / "model.safetensors").read_bytes() for it in (0, 1)]
    shutil.rmtree(store, ignore_errors=True)
    t0 = time.time()
    job = sbatch(tmp_path, "slurm/rerun_stage.sbatch", str(run_dir), "1", "train")
    assert wait_finished(job, JOB_TIMEOUT_S, "the rerun") == "FAILED", job_log(tmp_path, job)
    log = job_log(tmp_path, job)
    assert "has no durable copy" in log and "it goes back to iteration 0" in log, log[-3000:]
    detect = time.time() - t0
    job = sbatch_run(tmp_path, run_dir, *extra)
    assert wait_finished(job, JOB_TIMEOUT_S, "the run again") == "COMPLETED", job_log(tmp_path, job)
    recover = time.time() - t0
    log = job_log(tmp_path, job)
    assert "going back to iteration 0, after the last durable copy" in log, log[-3000:]
    assert "iteration 0 generate already done" in log and "iteration 0 train    launching" in log, log[-3000:]
    for it, before in enumerate(weights):
        assert (run_dir / "models" / f"iter_{it:05d}" / "model.safetensors").read_bytes() == before, it
    whole_durable_copy(run_dir / "checkpoints" / "iter_00001", "zero3")
    no_half_files(run_dir)
    report("node lost between durable copies (2 nodes, zero3)", detect, recover)


@pytest.mark.slurm
@pytest.mark.slow
def test_engines_on_two_nodes_through_srun_survive_the_stages_and_a_killed_one_is_replaced(slurm_cluster, tmp_path,
                                                                                           monkeypatch):
    """generate.persistent on two nodes (vLLM's API from its stand-in, tests/test_engine.py says why):
    one engine step serves iterations 0 and 1, reloading iteration 1's policy; its task on n2 is
    killed; a new step, started with iteration 2's policy, serves iteration 2 without a reload."""
    from tests.test_engine import STANDINS, engine_figures, engine_processes

    run_dir = tmp_path / "run"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(STANDINS), os.environ.get("PYTHONPATH", "")]))
    job = sbatch(tmp_path, "slurm/rl_2node.sbatch", "configs/local_tiny.yaml", f"run_dir={run_dir}",
                 "iterations=3", "generate.backend=vllm", "generate.persistent=true", *SMALL_RUN)
    # Kill the engine on the second node once iteration 1's generate is done with it.
    wait_for((run_dir / "iter_00001" / "markers" / "generate.done").is_file, 400, "iteration 1's generate")
    victim = rank_pid(run_dir / "logs" / "iter_00000" / "engine" / "attempt_1" / "rank_00001.log")
    os.kill(victim, signal.SIGKILL)
    t_fault = time.time()
    wait_for((run_dir / "logs" / "iter_00002" / "engine" / "attempt_1").is_dir, 300, "new engines", interval=0.1)
    detect = time.time() - t_fault
    wait_for((run_dir / "iter_00002" / "markers" / "generate.done").is_file, 300, "iteration 2's generate")
    report("generation engine killed between iterations", detect, time.time() - t_fault)
    state = wait_finished(job, JOB_TIMEOUT_S, f"job {job} to finish")
    out = job_log(tmp_path, job)
    assert state == "COMPLETED", out[-3000:]
    assert "generation engines started at iteration 0 have exited" in out
    for rank, node in ((0, "n1"), (1, "n2")):
        figures = [engine_figures(run_dir, it, rank) for it in range(3)]
        assert {f["engine_node"] for f in figures} == {node}
        # Iterations 0 and 1 asked the first engine step; iteration 2 a new one, started with its policy.
        assert figures[0]["engine_pid"] == figures[1]["engine_pid"] != figures[2]["engine_pid"]
        assert [f["served"] for f in figures] == [str(run_dir / "models" / m) for m in
                                                  ("base", "iter_00000", "iter_00001")]
        # Start-up is told once per engine, with the figure read from vLLM's log line; later requests reload.
        assert figures[0]["weights_s"] == 0.25 and figures[0]["engine_start_s"] > 0 and "reload_s" not in figures[0]
        assert figures[1]["reload_s"] > 0 and "engine_start_s" not in figures[1]
        assert figures[2]["engine_start_s"] > 0 and "reload_s" not in figures[2]
        assert [f["requests_served"] for f in figures] == [1, 2, 1]
        log = (run_dir / "logs" / "iter_00000" / "engine" / "attempt_1" / f"rank_{rank:05d}.log").read_text()
        assert log.count("request: ") == 2
    assert (run_dir / "logs" / "iter_00002" / "engine" / "attempt_1" / "rank_00001.log").is_file()
    # The engine steps are gone with the run, their addresses with them.
    assert list((run_dir / "engines").iterdir()) == [] and engine_processes(run_dir) == []
