"""The cluster path end to end on the real two-node SLURM cluster (slurm/local_cluster.sh).

sbatch of the shipped script, a train rank killed with SIGKILL and retried, `syncrl tail -f` on a
running step, `syncrl rerun` through rerun_stage.sbatch, and `syncrl submit` with a requeue.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from stages.runtime.paths import STAGES
from tests.slurm_fixture import (SMALL_RUN, job_log, job_state, rank_pid, run, sbatch, wait_finished, wait_for,
                                 wait_in_job)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
JOB_TIMEOUT_S = 600


def wait_job(job_id: str) -> str:
    return wait_finished(job_id, JOB_TIMEOUT_S, f"job {job_id} to finish")


class TailReader:
    """`syncrl tail -f` in the background, recording when each line arrived."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "jobs.cli", "tail", *args, "-f"], cwd=ROOT,
                                     stdout=subprocess.PIPE, text=True)
        self.lines: list[tuple[float, str]] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout)
        self.thread.join(5)
        return code


def line_written(arrived: float, line: str) -> float | None:
    """When a rank wrote a line (its wall-clock prefix, on the day it arrived); None for other lines."""
    m = re.match(r"^\[n\d+:r\d+\] (\d\d):(\d\d):(\d\d)\.(\d{3}) ", line)
    if not m:
        return None
    t = time.localtime(arrived)
    return time.mktime(t[:3] + (int(m[1]), int(m[2]), int(m[3])) + t[6:]) + int(m[4]) / 1000


def test_sbatch_two_nodes_with_retry_tail_and_rerun(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    job = sbatch(tmp_path, "slurm/rl_2node.sbatch", "configs/local_tiny.yaml", f"run_dir={run_dir}", "iterations=2",
                 *SMALL_RUN)

    # Fault: SIGKILL train rank 1 (on n2) of iteration 0 as soon as it has started.
    victim_log = run_dir / "logs" / "iter_00000" / "train" / "attempt_1" / "rank_00001.log"
    pid = wait_in_job(job, tmp_path, lambda: rank_pid(victim_log), 300, "train rank 1 to start", interval=0.05)
    os.kill(pid, signal.SIGKILL)
    t_fault = time.time()
    wait_for((run_dir / "logs" / "iter_00000" / "train" / "attempt_2").is_dir, 120, "the retry", interval=0.05)
    detect = time.time() - t_fault
    wait_for((run_dir / "iter_00000" / "markers" / "train.done").is_file, 300, "train to finish", interval=0.05)
    print(f"\nFAULT kill -9 one train rank: time-to-detect {detect:.1f}s, "
          f"time-to-recover {time.time() - t_fault:.1f}s")

    # Follow iteration 1's train step while it runs.
    train1 = run_dir / "logs" / "iter_00001" / "train" / "attempt_1"
    wait_for(train1.is_dir, 400, "iteration 1 train to start", interval=0.05)
    tail = TailReader(str(run_dir), "--iteration", "1", "--stage", "train")

    assert wait_job(job) == "COMPLETED", job_log(tmp_path, job)
    assert tail.wait(60) == 0
    text = "\n".join(line for _, line in tail.lines)
    assert "[n0:r0]" in text and "[n1:r1]" in text, text
    assert "host=n1" in text and "host=n2" in text
    # How closely tail follows: the lines written once it printed its first. Those written before
    # measure its own start-up (seconds on a loaded machine) instead.
    ready = tail.lines[0][0]
    latencies = [arrived - written for arrived, line in tail.lines
                 if (written := line_written(arrived, line)) is not None and written >= ready]
    assert latencies and max(latencies) < 3.0, latencies

    for it in (0, 1):
        for stage in STAGES:
            assert (run_dir / f"iter_{it:05d}" / "markers" / f"{stage}.done").is_file(), (it, stage)
        for stage in ("generate", "train"):
            attempt = 2 if (it, stage) == (0, "train") else 1
            logs = run_dir / "logs" / f"iter_{it:05d}" / stage / f"attempt_{attempt}"
            assert "host=n1" in (logs / "rank_00000.log").read_text()
            assert "host=n2" in (logs / "rank_00001.log").read_text()
    train_log = (run_dir / "logs" / "iter_00001" / "train" / "attempt_1" / "rank_00001.log").read_text()
    assert "world=2 master=n1:" in train_log  # one process group spanning both nodes
    train0 = json.loads((run_dir / "iter_00000" / "markers" / "train.done").read_text())
    assert train0["attempts"] == 2 and train0["hosts"] == ["n1", "n2"]

    log = job_log(tmp_path, job)
    assert "iteration 0 train attempt 1 failed on rank(s) 1" in log, log
    assert "srun: error: n2: task 1: Killed" in log
    assert re.search(r"iteration 1 done in [\d.]+s \(coordinator overhead [\d.]+s\)", log)

    status = run([sys.executable, "-m", "jobs.cli", "status", str(run_dir)], timeout=30).stdout
    train_row = next(line for line in status.splitlines() if line.split()[:2] == ["0", "train"])
    assert train_row.split()[2:5:2] == ["done", "2"], status

    # Rerun one stage in a new allocation: only it runs again.
    before = {p: p.stat().st_mtime_ns for p in run_dir.glob("iter_*/markers/*.done")}
    rerun = sbatch(tmp_path, "slurm/rerun_stage.sbatch", str(run_dir), "1", "score")
    assert wait_job(rerun) == "COMPLETED", job_log(tmp_path, rerun)
    changed = sorted(str(p.relative_to(run_dir)) for p in run_dir.glob("iter_*/markers/*.done")
                     if p.stat().st_mtime_ns != before.get(p))
    assert changed == ["iter_00001/markers/score.done", "iter_00001/markers/score.rank_00000.done",
                       "iter_00001/markers/score.rank_00001.done"], changed
    assert (run_dir / "logs" / "iter_00001" / "score" / "attempt_2").is_dir()
    # Scoring is deterministic: the same outputs, so nothing downstream went stale.
    status = run([sys.executable, "-m", "jobs.cli", "status", str(run_dir)], timeout=30).stdout
    assert "12/12 stages done" in status, status


def test_submit_then_requeue_resumes_at_first_incomplete_stage(slurm_cluster, tmp_path):
    run_dir = tmp_path / "run"
    proc = run([sys.executable, "-m", "jobs.cli", "submit", "configs/local_tiny.yaml", f"run_dir={run_dir}",
                "iterations=1", *SMALL_RUN], timeout=120)
    job = re.search(r"submitted job (\d+)", proc.stdout)[1]
    score_done = run_dir / "iter_00000" / "markers" / "score.done"
    wait_for(score_done.is_file, 300, "score to finish", interval=0.05)
    done_before = {p.name: p.stat().st_mtime_ns for p in (run_dir / "iter_00000" / "markers").glob("*.done")}
    run(["scontrol", "requeue", job], timeout=30)

    save_done = run_dir / "iter_00000" / "markers" / "save.done"
    wait_for(save_done.is_file, JOB_TIMEOUT_S, "the requeued job to finish the iteration", interval=0.5)
    wait_for(lambda: job_state(job) == "COMPLETED", 120, f"job {job} to complete", interval=0.5)
    for name, mtime in done_before.items():
        assert (run_dir / "iter_00000" / "markers" / name).stat().st_mtime_ns == mtime, f"{name} was redone"
    for stage in ("generate", "score"):
        assert not (run_dir / "logs" / "iter_00000" / stage / "attempt_2").exists()
    restart = (run_dir / "submitit" / job / f"{job}_0_log.err").read_text()
    assert restart.count("launcher srun") == 2  # the coordinator started twice
    assert "iteration 0 score    already done, skipping" in restart
