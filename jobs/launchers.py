"""Launchers start one stage attempt as processes and report each rank's exit code.

LocalLauncher runs the stage modules as local processes with the environment contract srun gives
(rank, local rank, world size, master address/port), one log file per rank. Torch-free.
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from stages.runtime.dist import allocation, slurm_job_id
from stages.runtime.paths import RunPaths
from stages.runtime.pipeline import group_size, layout
from stages.runtime.stage import ATTEMPT_VAR

log = logging.getLogger("syncrl.launch")

# After one rank fails, its peers get this long to exit by themselves before they are killed (like
# srun --kill-on-bad-exit): a train peer would otherwise wait for the dead rank until its timeout.
PEER_GRACE_S = 5.0
POLL_S = 0.05
# How often a step's `done` check (its ranks' markers) runs while its processes are still there.
# The check is one listing of the iteration's marker folder, and each stage's end waits on average
# half this for it (every iteration, on the critical path): a small share of a light stage, and a
# listing every 50 ms is little load on a shared filesystem's metadata server.
DONE_POLL_S = 0.05


@dataclass
class LaunchResult:
    returncodes: dict[int, int]
    elapsed_s: float
    timed_out: bool = False
    hosts: dict[int, str] = field(default_factory=dict)
    # False when the launcher knows only one code for the whole step (srun): failed ranks are then
    # the ranks that left no marker.
    per_rank_codes: bool = True
    # Ranks still exiting when the step's `done` check said its work was complete (their exit code
    # counts as 0 here; wait on the step again for the real one).
    lingering: tuple[int, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(c == 0 for c in self.returncodes.values())

    @property
    def failed_ranks(self) -> list[int]:
        if not self.per_rank_codes:
            return []
        return sorted(r for r, c in self.returncodes.items() if c != 0)


def group_problem(name: str, n: int, group: int) -> str:
    return (f"{name} ({n}) is not a multiple of generate.gpus_per_process ({group}): each generate process "
            f"takes {group} of a node's GPUs; set {name} to {max(group, n // group * group)} or "
            f"generate.gpus_per_process to a divisor of {n}")


def stage_command(paths: RunPaths, iteration: int, stage: str, after=None) -> list[str]:
    """The stage's command line; `after` = (file, timeout_s) starts it early (it waits for the file)."""
    cmd = [sys.executable, "-m", f"stages.{stage}", "--run-dir", str(paths.root), "--iteration", str(iteration)]
    if after is not None:
        cmd += ["--after", str(after[0]), "--after-timeout", str(after[1])]
    return cmd


class LocalLauncher:
    """Runs `ranks` processes per multi-rank stage on this machine (laptops, CI)."""

    name = "local"

    def __init__(self, ranks: int, generate_group: int = 1, own_gpus: tuple[str, ...] = ()):
        """`own_gpus`: stages and services whose processes see only their own GPUs (vLLM takes the
        first visible ones), whatever their group size."""
        if ranks % generate_group:
            raise ValueError(group_problem("ranks", ranks, generate_group))
        self.ranks = ranks
        self.generate_group = generate_group
        self.own_gpus = own_gpus

    def ntasks(self, stage: str) -> int:
        return self.ranks // group_size(stage, self.generate_group) if layout(stage).every_rank else 1

    def visible_gpus(self, stage: str, rank: int) -> str | None:
        """CUDA_VISIBLE_DEVICES for a rank that spreads the model over several GPUs, or that runs
        vLLM: its own slice."""
        group = group_size(stage, self.generate_group)
        if group == 1 and stage not in self.own_gpus:
            return None  # one GPU per rank, picked by local rank (stages/rl/modeling.device_for)
        gpus = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if os.environ.get("CUDA_VISIBLE_DEVICES") \
            else [str(i) for i in range(self.ranks)]
        return ",".join(gpus[rank * group:(rank + 1) * group])

    def nodes(self) -> list[str]:
        return [socket.gethostname()]

    def start(self, paths: RunPaths, iteration: int, stage: str, attempt: int, after=None) -> "LocalStep":
        """Start the stage's ranks and return at once (see stage_command for `after`)."""
        n = self.ntasks(stage)
        logs = paths.logs(iteration, stage, attempt)
        logs.mkdir(parents=True, exist_ok=True)
        port = free_port()
        threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // n))
        step = LocalStep({})
        try:
            for rank in range(n):
                env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n),
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), SYNCRL_NODE_ID="0",
                           SYNCRL_NUM_NODES="1", OMP_NUM_THREADS=threads, PYTHONUNBUFFERED="1")
                env[ATTEMPT_VAR] = str(attempt)
                if (visible := self.visible_gpus(stage, rank)) is not None:
                    env["CUDA_VISIBLE_DEVICES"] = visible
                with open(paths.rank_log(iteration, stage, attempt, rank), "ab") as out:
                    step.procs[rank] = subprocess.Popen(stage_command(paths, iteration, stage, after), stdout=out,
                                                        stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                                        preexec_fn=_die_with_parent)
        except BaseException:
            step.cancel()
            raise
        return step


@dataclass
class LocalStep:
    """A started stage attempt on this machine."""

    procs: dict[int, subprocess.Popen]

    def running(self) -> bool:
        return all(p.poll() is None for p in self.procs.values())

    def wait(self, timeout_s: float = 0, done=None) -> LaunchResult:
        """Until every rank has exited (killing what is left at the timeout), or until `done()` is
        true with no rank failed: the ranks still exiting are then left running (`lingering`)."""
        start = time.time()
        lingering = ()
        try:
            codes, timed_out, lingering = wait_all(self.procs, timeout_s, done)
        finally:
            if not lingering:
                self.cancel()
        host = socket.gethostname()
        return LaunchResult(codes, time.time() - start, timed_out, {r: host for r in self.procs}, lingering=lingering)

    def cancel(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                _kill(p)


def wait_all(procs: dict[int, subprocess.Popen], timeout_s: float,
             done=None) -> tuple[dict[int, int], bool, tuple[int, ...]]:
    """Wait for every rank; once one fails, give the rest PEER_GRACE_S, then kill them. With `done`,
    stop waiting once it is true and no rank has failed: (codes, timed out, ranks still running)."""
    deadline = time.monotonic() + timeout_s if timeout_s else None
    failed_at = None
    next_check = 0.0
    while True:
        codes = {r: p.poll() for r, p in procs.items()}
        if all(c is not None for c in codes.values()):
            return codes, False, ()
        now = time.monotonic()
        if failed_at is None and any(c not in (None, 0) for c in codes.values()):
            failed_at = now
        if done is not None and failed_at is None and now >= next_check:
            next_check = now + DONE_POLL_S
            if done():
                return {r: 0 if c is None else c for r, c in codes.items()}, False, \
                    tuple(r for r, c in codes.items() if c is None)
        if (failed_at is not None and now - failed_at > PEER_GRACE_S) or (deadline and now > deadline):
            for p in procs.values():
                if p.poll() is None:
                    _kill(p)
            codes = {r: p.wait() for r, p in procs.items()}
            return codes, failed_at is None, ()
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
    """A port free now, below the range the kernel hands out to outgoing connections and bind(0)
    (ip_local_port_range): the ranks bind it only when they join their process group, a minute later
    for a stage started early, and a port of that range may have been handed to another connection
    by then (EADDRINUSE)."""
    low = ephemeral_ports()[0]
    if low >= 2048:
        for port in random.sample(range(max(1024, low - 12000), low), 50):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SrunLauncher:
    """Runs each stage as one `srun` job step inside the current allocation.

    Multi-rank stages get `slurm.tasks_per_node` tasks on each node (generate and score one per
    `generate.gpus_per_process` of them); persist one task per node; gather and save one task.
    MASTER_ADDR is the first host of the step's nodes; MASTER_PORT is derived from the job id,
    iteration and attempt, so a retried train step never meets the previous attempt's rendezvous,
    and lies outside the ephemeral port range (derived_port).
    """

    name = "srun"

    def __init__(self, slurm_cfg, env: dict | None = None, generate_group: int = 1):
        env = os.environ if env is None else env
        if slurm_cfg.tasks_per_node % generate_group:
            raise ValueError(group_problem("slurm.tasks_per_node", slurm_cfg.tasks_per_node, generate_group))
        self.cfg = slurm_cfg
        self.generate_group = generate_group
        self.job_id = slurm_job_id(env)
        if self.job_id is None:
            raise RuntimeError("SrunLauncher needs a SLURM allocation (SLURM_JOB_ID is not set): "
                               "run inside sbatch/salloc, or use `syncrl submit`")
        self.hosts = expand_nodelist(allocation("nodelist", env) or "")
        self.num_nodes = min(self.cfg.nodes or len(self.hosts), len(self.hosts))

    def tasks_per_node(self, stage: str) -> int:
        if not layout(stage).every_rank:
            return 1
        return self.cfg.tasks_per_node // group_size(stage, self.generate_group)

    def ntasks(self, stage: str) -> int:
        return self.num_nodes * self.tasks_per_node(stage) if self._all_nodes(stage) else 1

    def nodes(self) -> list[str]:
        return self.hosts[:self.num_nodes]

    @staticmethod
    def _all_nodes(stage: str) -> bool:
        return layout(stage).every_rank or layout(stage).every_node

    def command(self, paths: RunPaths, iteration: int, stage: str, attempt: int, after=None) -> tuple[list[str], dict]:
        multi = layout(stage).every_rank
        nodes = self.num_nodes if self._all_nodes(stage) else 1
        log_pattern = paths.logs(iteration, stage, attempt) / "rank_%5t.log"
        cmd = ["srun", f"--nodes={nodes}", f"--ntasks={self.ntasks(stage)}",
               f"--ntasks-per-node={self.tasks_per_node(stage)}",
               f"--nodelist={','.join(self.hosts[:nodes])}", "--kill-on-bad-exit=1",
               f"--job-name=syncrl-{stage}-{iteration:05d}", f"--output={log_pattern}", f"--error={log_pattern}",
               "--open-mode=append",
               # Under `syncrl submit` the coordinator itself runs in a step on the first node;
               # stage steps must be allowed to share that node's resources with it.
               "--overlap"]
        group = group_size(stage, self.generate_group)  # a grouped task takes its ranks' GPUs and CPUs
        if multi and self.cfg.gpus_per_task:
            cmd.append(f"--gpus-per-task={self.cfg.gpus_per_task * group}")
        if self.cfg.cpus_per_task:
            cmd.append(f"--cpus-per-task={self.cfg.cpus_per_task * group}")
        cmd += self.cfg.srun_args.split()
        cmd += stage_command(paths, iteration, stage, after)
        env = dict(os.environ, MASTER_ADDR=self.hosts[0], PYTHONUNBUFFERED="1",
                   MASTER_PORT=str(derived_port(self.job_id, iteration, attempt, stage)))
        env[ATTEMPT_VAR] = str(attempt)
        # srun inherits the batch step's SLURM_* layout variables; drop torchrun names that a parent
        # process may have set so the step's own SLURM_PROCID etc. decide each rank.
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
            env.pop(key, None)
        return cmd, env

    def start(self, paths: RunPaths, iteration: int, stage: str, attempt: int, after=None) -> "SrunStep":
        """Start the stage's step and return at once (see stage_command for `after`)."""
        paths.logs(iteration, stage, attempt).mkdir(parents=True, exist_ok=True)  # srun will not create it
        cmd, env = self.command(paths, iteration, stage, attempt, after)
        log.debug("launching: %s", " ".join(cmd))
        proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent,
                                stderr=subprocess.PIPE, text=True, errors="replace")
        messages: list[str] = []
        reader = threading.Thread(target=_relay_srun_messages, args=(proc.stderr, messages), daemon=True)
        reader.start()
        return SrunStep(proc, reader, messages, self.ntasks(stage))


@dataclass
class SrunStep:
    """A started `srun` step; srun reports one exit code and names failed tasks in its messages."""

    proc: subprocess.Popen
    reader: threading.Thread
    messages: list[str]
    ntasks: int

    def running(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout_s: float = 0, done=None) -> LaunchResult:
        """Until the step ends (killed at the timeout), or until `done()` is true: its tasks are
        then left to end by themselves (`lingering`: all of them, as srun reports no task's exit)."""
        start = time.time()
        proc = self.proc
        deadline = time.monotonic() + timeout_s if timeout_s else None
        code, timed_out = None, False
        try:
            while code is None:
                left = deadline - time.monotonic() if deadline else None
                if left is not None and left <= 0:
                    _kill(proc)
                    code, timed_out = proc.wait(), True
                    break
                poll = DONE_POLL_S if done is not None else None
                if left is not None:
                    poll = left if poll is None else min(poll, left)
                try:
                    code = proc.wait(poll)
                except subprocess.TimeoutExpired:
                    if done is not None and done():
                        return LaunchResult({r: 0 for r in range(self.ntasks)}, time.time() - start,
                                            per_rank_codes=False, lingering=tuple(range(self.ntasks)))
        except BaseException:
            self.cancel()
            raise
        self.reader.join(timeout=10)
        n = self.ntasks
        culprits = first_failed_tasks(self.messages)
        if code == 0 or not culprits:
            # srun reports one exit code for the step; without its per-task message the coordinator
            # names failed ranks from their missing markers.
            return LaunchResult({r: code for r in range(n)}, time.time() - start, timed_out, per_rank_codes=False)
        codes = {r: culprits.get(r, (0, ""))[0] for r in range(n)}
        hosts = {r: h for r, (_, h) in culprits.items()}
        return LaunchResult(codes, time.time() - start, timed_out, hosts=hosts)

    def cancel(self) -> None:
        if self.proc.poll() is None:
            _kill(self.proc)  # srun forwards the signal and ends the step on every node


SRUN_TASK_ERROR = re.compile(r"^srun: error: (\S+): tasks? ([\d,\-]+): (.*)$")


def _relay_srun_messages(stream, messages: list[str]) -> None:
    """Copy srun's own messages to the coordinator's log and keep them for the failure summary."""
    for line in stream:
        line = line.rstrip("\n")
        messages.append(line)
        log.warning("%s", line)


def first_failed_tasks(messages: list[str]) -> dict[int, tuple[int, str]]:
    """Ranks named by srun's first task error, the root cause: {rank: (exit code, host)}.

    With --kill-on-bad-exit srun then terminates the other tasks and reports them too; those are
    consequences, not failures, so only the first error line counts.
    """
    for line in messages:
        m = SRUN_TASK_ERROR.match(line)
        if not m:
            continue
        host, tasks, reason = m.groups()
        code_match = re.search(r"exit code (\d+)", reason)
        code = int(code_match[1]) if code_match else 128 + 9 if "Killed" in reason else 1
        return {r: (code, host) for r in _task_ids(tasks)}
    return {}


def _task_ids(spec: str) -> list[int]:
    ids = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        ids += range(int(lo), int(hi or lo) + 1)
    return ids


def derived_port(job_id: str, iteration: int, attempt: int, stage: str,
                 ephemeral: tuple[int, int] | None = None) -> int:
    """A port that differs between jobs, iterations, attempts and stages, outside the node's ephemeral
    range (`ephemeral`, else this node's): the kernel gives the local ports of outgoing connections
    from that range, and one in use there fails the rendezvous's bind, and so the attempt."""
    first, last = ephemeral or ephemeral_ports()
    if first - 20000 >= 4096:
        lo, size = 20000, first - 20000
    elif 65535 - last >= 4096:
        lo, size = last + 1, 65535 - last
    else:  # no room outside it: anywhere, as before
        lo, size = 20000, 40000
    key = f"{job_id}:{iteration}:{attempt}:{stage}".encode()
    return lo + int.from_bytes(hashlib.sha256(key).digest()[:4], "little") % size


def ephemeral_ports() -> tuple[int, int]:
    """This node's range for the local ports of outgoing connections (Linux's default elsewhere);
    the nodes of one cluster share it."""
    try:
        first, last = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(first), int(last)
    except (OSError, ValueError):
        return 32768, 60999


def expand_nodelist(nodelist: str) -> list[str]:
    """`n[1-3],gpu07` -> [n1, n2, n3, gpu07] via scontrol, which knows every SLURM nodelist form."""
    if not nodelist:
        return [socket.gethostname()]
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    return out.split()


def launcher_kind(kind: str, env=None) -> str:
    """`auto` means srun inside a SLURM allocation (SLURM_JOB_ID set and srun on PATH), else local."""
    env = os.environ if env is None else env
    if kind == "auto":
        return "srun" if allocation("job_id", env) and shutil.which("srun") else "local"
    return kind


def make_launcher(kind: str, cfg):
    group = cfg.generate.gpus_per_process
    if launcher_kind(kind) == "srun":
        return SrunLauncher(cfg.slurm, generate_group=group)
    return LocalLauncher(cfg.ranks, group, own_gpus=("generate", "engine") if cfg.generate.backend == "vllm" else ())
