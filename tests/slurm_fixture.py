"""Session fixture ``slurm_cluster``: a real two-node SLURM cluster (n1, n2) on this machine.

Import it from conftest.py (``from tests.slurm_fixture import slurm_cluster``) or load this module as a
plugin (``pytest -p tests.slurm_fixture``). If ``sinfo`` already shows n1 and n2 up, the running
cluster is used as is; otherwise ``bash slurm/local_cluster.sh start`` is run once per session. The
cluster is left running afterwards (starting it again costs ~1-10 s; stop it with
``bash slurm/local_cluster.sh stop``).

Tests are skipped when the machine cannot host the cluster (the script exits 3: not root, no
apt-get, packages not installable); any other failure of the script fails the tests loudly, because
it means the script itself is broken.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
CLUSTER_SCRIPT = REPO_ROOT / "slurm" / "local_cluster.sh"
NODES = ("n1", "n2")
PARTITION = "debug"
# local_cluster.sh's exit code for "this machine cannot host the cluster".
EXIT_UNAVAILABLE = 3
# Compact sinfo states in which a node accepts work (a trailing "*" means not responding).
USABLE_STATES = {"idle", "mix", "alloc", "comp"}
# First start may apt-get install (~20 s measured); allow slow mirrors.
START_TIMEOUT_S = 600


@dataclass(frozen=True)
class SlurmCluster:
    nodes: tuple[str, ...]
    partition: str
    started_by_fixture: bool


def node_states(timeout: float = 15) -> dict[str, str]:
    """Compact sinfo state of each of our nodes; empty when SLURM is absent or not answering."""
    if shutil.which("sinfo") is None:
        return {}
    try:
        proc = subprocess.run(
            ["sinfo", "-h", "-N", "-n", ",".join(NODES), "-o", "%N %t"],
            capture_output=True, text=True, timeout=timeout,
        )
    except (subprocess.TimeoutExpired, OSError):
        return {}
    if proc.returncode != 0:
        return {}
    return dict(line.split(None, 1) for line in proc.stdout.splitlines() if len(line.split()) == 2)


def nodes_up() -> bool:
    states = node_states()
    return all(states.get(node) in USABLE_STATES for node in NODES)


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


@pytest.fixture(scope="session")
def slurm_cluster() -> SlurmCluster:
    if nodes_up():
        return SlurmCluster(NODES, PARTITION, started_by_fixture=False)
    if not sys.platform.startswith("linux") or shutil.which("bash") is None:
        pytest.skip("local SLURM cluster needs Linux with bash")
    if not CLUSTER_SCRIPT.is_file():
        pytest.fail(f"{CLUSTER_SCRIPT} is missing")
    try:
        proc = subprocess.run(
            ["bash", str(CLUSTER_SCRIPT), "start"],
            capture_output=True, text=True, timeout=START_TIMEOUT_S, cwd=REPO_ROOT,
        )
    except subprocess.TimeoutExpired as exc:
        stderr = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr
        pytest.fail(f"local_cluster.sh start did not finish within {START_TIMEOUT_S}s:\n{_tail(stderr or '')}")
    output = _tail(proc.stdout + proc.stderr)
    if proc.returncode == EXIT_UNAVAILABLE:
        pytest.skip(f"local SLURM cluster unavailable on this machine: {output}")
    if proc.returncode != 0:
        pytest.fail(f"local_cluster.sh start failed (rc={proc.returncode}):\n{output}")
    if not nodes_up():
        pytest.fail(f"local_cluster.sh start succeeded but nodes are not up: {node_states()}\n{output}")
    return SlurmCluster(NODES, PARTITION, started_by_fixture=True)


# Helpers shared by the tests that drive the cluster.

def run(cmd: list[str], timeout: float, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{shlex.join(cmd)} -> rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def job_state(job_id: str) -> str:
    """JobState from scontrol (finished jobs stay visible for MinJobAge=300 s)."""
    out = run(["scontrol", "show", "job", "-o", job_id], timeout=15, check=False).stdout
    for field in out.split():
        if field.startswith("JobState="):
            return field.split("=", 1)[1]
    return "UNKNOWN"


def wait_for(predicate, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def pid_gone(pid: int) -> bool:
    """True once the process is gone; a zombie counts as gone (PID 1 here reaps orphans slowly)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


# Helpers for tests that run syncrl's own sbatch scripts.

# The smallest real run: 8 prompts x 4 samples per iteration, quick retries.
# start_early=always: the 2-core test machine would not start stages early on its own (auto).
SMALL_RUN = ["start_early=always", "data.prompts_per_iteration=8", "generate.attempts=4", "train.micro_batch_size=16",
             "retry.backoff_s=0.5"]
FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def sbatch(out_dir: Path, *args: str, env: dict | None = None) -> str:
    """Submit from the repository root, job log to OUT_DIR/job-<id>.out; returns the job id. `env`:
    variables the job gets beside this process's."""
    # SYNCRL_PYTHON: the interpreter that has syncrl installed (the system python3 may not).
    env = dict(os.environ, SYNCRL_PYTHON=sys.executable, **(env or {}))
    proc = subprocess.run(["sbatch", "--parsable", f"--output={out_dir}/job-%j.out", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def finished(job_id: str) -> str | None:
    """The job's final state, or None while it is pending or running."""
    state = job_state(job_id)
    return state if state in FINAL_STATES else None


def wait_finished(job_id: str, timeout: float, what: str) -> str:
    """The job's final state, once it has one. Polled twice a second, not at wait_for's pace: each
    poll is an scontrol call, and the job's own processes need the machine's cores."""
    return wait_for(lambda: finished(job_id), timeout, what, interval=0.5)


def job_log(out_dir: Path, job_id: str) -> str:
    log = out_dir / f"job-{job_id}.out"
    return log.read_text() if log.is_file() else ""


def wait_in_job(job_id: str, out_dir: Path, predicate, timeout: float, what: str, interval: float = 0.1):
    """wait_for, for something a running job must bring about: fails at once if the job ends first,
    and either way the failure carries the job's log and its run's rank logs (a CI run keeps no files)."""
    next_poll = 0.0

    def came_about():
        nonlocal next_poll
        if (value := predicate()) or time.monotonic() < next_poll:
            return value
        next_poll = time.monotonic() + 0.5  # scontrol twice a second at most (see wait_finished)
        if (state := finished(job_id)) is None or (value := predicate()):  # it may have come just before the end
            return value
        raise AssertionError(f"job {job_id} ended {state} before {what}")

    try:
        return wait_for(came_about, timeout, what, interval)
    except AssertionError as e:  # the job's end, or wait_for's timeout
        raise AssertionError(f"{e}\n{job_story(out_dir, job_id)}") from None


def job_story(out_dir: Path, job_id: str, lines: int = 40) -> str:
    """The job's log and the last lines of each rank log under the run dirs in out_dir."""
    parts = [f"--- job {job_id} ({job_state(job_id)}), its log's last {lines} lines:",
             _tail(job_log(out_dir, job_id), lines)]
    for log in sorted(out_dir.glob("*/logs/iter_*/*/attempt_*/rank_*.log")):
        parts += [f"--- {log.relative_to(out_dir)}:", _tail(log.read_text(errors="replace"), 12)]
    return "\n".join(parts)


def rank_pid(log: Path) -> int | None:
    """The pid a stage rank logs on its first line."""
    m = re.search(r"pid=(\d+)", log.read_text()) if log.is_file() else None
    return int(m[1]) if m else None
