"""Launchers start one stage attempt as processes and report each rank's exit code.

LocalLauncher runs the stage modules as local processes with the environment contract srun gives
(rank, local rank, world size, master address/port), one log file per rank. Torch-free.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

from stages.common.paths import MULTI_RANK_STAGES, RunPaths
from stages.common.stage import ATTEMPT_VAR

log = logging.getLogger("syncrl.launch")

# After one rank fails, its peers get this long to exit by themselves before they are killed (like
# srun --kill-on-bad-exit): a train peer would otherwise wait for the dead rank until its timeout.
PEER_GRACE_S = 5.0
POLL_S = 0.05


@dataclass
class LaunchResult:
    returncodes: dict[int, int]
    elapsed_s: float
    timed_out: bool = False
    hosts: dict[int, str] = field(default_factory=dict)

    @property
    def failed_ranks(self) -> list[int]:
        return sorted(r for r, c in self.returncodes.items() if c != 0)


def stage_command(paths: RunPaths, iteration: int, stage: str) -> list[str]:
    return [sys.executable, "-m", f"stages.{stage}", "--run-dir", str(paths.root), "--iteration", str(iteration)]


class LocalLauncher:
    """Runs `ranks` processes per multi-rank stage on this machine (laptops, CI)."""

    name = "local"

    def __init__(self, ranks: int):
        self.ranks = ranks

    def ntasks(self, stage: str) -> int:
        return self.ranks if stage in MULTI_RANK_STAGES else 1

    def nodes(self) -> list[str]:
        return [socket.gethostname()]

    def launch(self, paths: RunPaths, iteration: int, stage: str, attempt: int, timeout_s: float = 0) -> LaunchResult:
        n = self.ntasks(stage)
        logs = paths.logs(iteration, stage, attempt)
        logs.mkdir(parents=True, exist_ok=True)
        port = free_port()
        threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // n))
        procs = {}
        start = time.time()
        try:
            for rank in range(n):
                env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n),
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), SYNCRL_NODE_ID="0",
                           SYNCRL_NUM_NODES="1", OMP_NUM_THREADS=threads, PYTHONUNBUFFERED="1")
                env[ATTEMPT_VAR] = str(attempt)
                with open(paths.rank_log(iteration, stage, attempt, rank), "ab") as out:
                    procs[rank] = subprocess.Popen(stage_command(paths, iteration, stage), stdout=out,
                                                   stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                                   preexec_fn=_die_with_parent)
            codes, timed_out = wait_all(procs, timeout_s)
        finally:
            for p in procs.values():
                if p.poll() is None:
                    _kill(p)
        host = socket.gethostname()
        return LaunchResult(codes, time.time() - start, timed_out, {r: host for r in procs})


def wait_all(procs: dict[int, subprocess.Popen], timeout_s: float) -> tuple[dict[int, int], bool]:
    """Wait for every rank; once one fails, give the rest PEER_GRACE_S, then kill them."""
    deadline = time.monotonic() + timeout_s if timeout_s else None
    failed_at = None
    while True:
        codes = {r: p.poll() for r, p in procs.items()}
        if all(c is not None for c in codes.values()):
            return codes, False
        now = time.monotonic()
        if failed_at is None and any(c not in (None, 0) for c in codes.values()):
            failed_at = now
        if (failed_at is not None and now - failed_at > PEER_GRACE_S) or (deadline and now > deadline):
            for p in procs.values():
                if p.poll() is None:
                    _kill(p)
            codes = {r: p.wait() for r, p in procs.items()}
            return codes, failed_at is None
        time.sleep(POLL_S)


def _kill(p: subprocess.Popen) -> None:
    """End the rank and anything it started (its own session), TERM first so it can clean up."""
    for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(p.pid, sig)
        except ProcessLookupError:
            return
        try:
            p.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _die_with_parent() -> None:
    """Runs in the child before exec: if the coordinator is killed (even with -9), its ranks get SIGTERM.

    Orphaned ranks would otherwise run on beside the stage's relaunch and write into the same files.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
