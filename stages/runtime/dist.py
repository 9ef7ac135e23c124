"""The one module that knows SLURM and torchrun variable names.

`dist_info()` reads the rank layout from whichever launcher started us (srun, torchrun, or syncrl's
LocalLauncher, which sets the torchrun names), with a single-process fallback. Process-group setup
imports torch lazily, so torch-free stages can use the rest of this module.
"""

from __future__ import annotations

import datetime
import logging
import math
import os
import socket
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

# field -> (torchrun/local name, SLURM name). The torchrun name wins when both are set, because
# torchrun (or the LocalLauncher) inside an allocation knows the real process layout.
ENV_TABLE = {
    "rank": ("RANK", "SLURM_PROCID"),
    "local_rank": ("LOCAL_RANK", "SLURM_LOCALID"),
    "world_size": ("WORLD_SIZE", "SLURM_NTASKS"),
    "node_id": ("SYNCRL_NODE_ID", "SLURM_NODEID"),
    "num_nodes": ("SYNCRL_NUM_NODES", "SLURM_STEP_NUM_NODES"),
}
JOB_ID_VAR = "SLURM_JOB_ID"
# The node's name as SLURM knows it: on a cluster of one host (the test cluster) nodes share a
# hostname, so their node-local files are told apart by this name.
NODE_NAME_VAR = "SLURMD_NODENAME"
# The allocation as SLURM describes it to the batch step: field -> the variables that may carry it,
# first set wins. The coordinator, `syncrl check` and the launchers read SLURM only through here.
ALLOCATION_TABLE = {
    "job_id": (JOB_ID_VAR,),
    "num_nodes": ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"),
    "nodelist": ("SLURM_JOB_NODELIST",),
    "cpus_on_node": ("SLURM_CPUS_ON_NODE",),
    "gpus_on_node": ("SLURM_GPUS_ON_NODE",),
}


def allocation(field: str, env=None) -> str | None:
    """One field of ALLOCATION_TABLE from `env` (default: this process's environment); None when unset."""
    env = os.environ if env is None else env
    return next((env[v] for v in ALLOCATION_TABLE[field] if env.get(v)), None)


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    node_id: int = 0
    num_nodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    host: str = ""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def tag(self) -> str:
        """Log prefix: `n<node>:r<rank>`."""
        return f"n{self.node_id}:r{self.rank}"


def dist_info(env: dict | None = None) -> DistInfo:
    env = os.environ if env is None else env
    values = {}
    for name, keys in ENV_TABLE.items():
        for key in keys:
            if env.get(key, "") != "":
                values[name] = int(env[key])
                break
    return DistInfo(
        **values,
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(env.get("MASTER_PORT", "29500")),
        host=socket.gethostname(),
    )


def node_name(env: dict | None = None) -> str:
    """This node's name: SLURM's name for it inside a step, else the hostname."""
    env = os.environ if env is None else env
    return env.get(NODE_NAME_VAR) or socket.gethostname()


def slurm_job_id(env: dict | None = None) -> str | None:
    env = os.environ if env is None else env
    return env.get(JOB_ID_VAR) or None


def init_process_group(info: DistInfo, backend: str, timeout_s: int) -> None:
    """Join the stage's process group with a bounded timeout (a missing rank fails, never hangs)."""
    import torch.distributed as tdist

    if info.world_size == 1 or tdist.is_initialized():
        return
    log.info("joining process group: backend=%s world=%d master=%s:%d timeout=%ds",
             backend, info.world_size, info.master_addr, info.master_port, timeout_s)
    kwargs = {}
    if backend == "nccl":
        import torch

        # Binds the communicator to this rank's GPU up front instead of NCCL guessing it from the rank.
        kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
    tdist.init_process_group(
        backend=backend,
        init_method=f"tcp://{info.master_addr}:{info.master_port}",
        rank=info.rank,
        world_size=info.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **kwargs,
    )


def destroy_process_group() -> None:
    import sys

    if "torch" not in sys.modules:
        return  # torch-free stages (score, gather) never made a group; importing torch here costs seconds
    import torch.distributed as tdist

    if tdist.is_available() and tdist.is_initialized():
        t0 = time.time()
        tdist.destroy_process_group()
        # Part of the process's exit, which the next stage's turn waits for.
        log.info("process group closed in %.2fs", time.time() - t0)


def pick_backend(requested: str) -> str:
    if requested != "auto":
        return requested
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def communication_env(attempt: int, socket_ifname: str = "", env: dict | None = None) -> dict:
    """The NCCL/gloo settings a training step runs with; a value the user exported wins, except the
    interface named in the config (the config is the more specific instruction).

    Returns what was set, for the log.
    """
    env = os.environ if env is None else env
    defaults = {
        # A rank that dies or times out must fail its peers' collectives, not hang them.
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        # Tracebacks of the collective in flight when the watchdog fires.
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        # A retry is when NCCL's own account of what went wrong is worth its log volume.
        "NCCL_DEBUG": "INFO" if attempt > 1 else "WARN",
    }
    changed = {}
    for key, value in defaults.items():
        if key not in env:
            env[key] = changed[key] = value
    if socket_ifname:
        for key in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
            if env.get(key) not in (None, socket_ifname):
                log.warning("overriding %s=%s with %s from train.socket_ifname", key, env[key], socket_ifname)
            env[key] = changed[key] = socket_ifname
    for key, value in changed.items():
        log.info("environment: %s=%s", key, value)
    return changed


def export_torch_env(info: DistInfo) -> None:
    """Set the torchrun variable names from `info`, for libraries (DeepSpeed) that read only those.

    Under srun only the SLURM names exist; every value that replaces a different one is logged.
    """
    wanted = {"RANK": info.rank, "LOCAL_RANK": info.local_rank, "WORLD_SIZE": info.world_size,
              "MASTER_ADDR": info.master_addr, "MASTER_PORT": info.master_port}
    for key, value in wanted.items():
        old = os.environ.get(key)
        if old is not None and old != str(value):
            log.warning("overriding %s=%s with %s", key, old, value)
        os.environ[key] = str(value)


class BarrierTimeout(RuntimeError):
    """Some ranks did not reach a barrier in time; the message names them."""


def barrier(name: str, timeout_s: float) -> None:
    """A bounded barrier over the stage's process group that names the ranks that did not arrive.

    Uses gloo's monitored_barrier (a gloo side group when the main backend is NCCL, whose own
    barrier can only hang or time out without saying who is missing).
    """
    import torch.distributed as tdist

    if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() == 1:
        return
    group = _gloo_group()
    log.info("barrier '%s' (timeout %.0fs)", name, timeout_s)
    try:
        tdist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)
    except RuntimeError as e:
        raise BarrierTimeout(f"barrier '{name}': {e} (waited {timeout_s:.0f}s)") from None


def agree(value):
    """Rank 0's `value`, on every rank of the stage's process group (`value` itself without one)."""
    import torch.distributed as tdist

    if not (tdist.is_available() and tdist.is_initialized()) or tdist.get_world_size() == 1:
        return value
    box = [value]
    tdist.broadcast_object_list(box, src=0, group=_gloo_group())
    return box[0]


_GLOO_GROUP = None


def _gloo_group():
    global _GLOO_GROUP
    import torch.distributed as tdist

    if tdist.get_backend() == "gloo":
        return None  # the default group already is gloo
    if _GLOO_GROUP is None:
        _GLOO_GROUP = tdist.new_group(backend="gloo")
    return _GLOO_GROUP


class ProgressWatchdog:
    """Ends this rank when no progress is reported for `timeout_s`, so no wait is unbounded.

    Process-group timeouts do not cover everything: groups that libraries create themselves (DeepSpeed's
    data-parallel groups) get torch's 30-minute default, and a peer that is stopped rather than dead
    never closes its sockets. The stage calls beat() at every step and phase; when beats stop, this
    thread reports the phase it was stuck in and exits the process with status 3 (the launcher then
    stops the peers and the coordinator retries the stage).
    """

    EXIT_CODE = 3

    def __init__(self, timeout_s: float, on_timeout=None):
        import threading

        self._time = time.monotonic
        self.timeout_s = timeout_s
        self.on_timeout = on_timeout
        self.phase = "start"
        self.last = self._time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="syncrl-watchdog", daemon=True)
        self._thread.start()

    def beat(self, phase: str | None = None) -> None:
        self.last = self._time()
        if phase:
            self.phase = phase

    def rest(self) -> None:
        """No limit until the next beat: for a wait that has a bound of its own."""
        self.last = math.inf

    def stop(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        interval = min(5.0, max(0.1, self.timeout_s / 10))
        while not self._stop.wait(interval):
            idle = self._time() - self.last
            if idle > self.timeout_s:
                msg = (f"no progress for {idle:.0f}s (limit {self.timeout_s:.0f}s) in phase '{self.phase}': a peer "
                       "rank is probably hung or dead; exiting so the stage can be retried")
                log.error(msg)
                if self.on_timeout:
                    try:
                        self.on_timeout(msg)
                    except Exception:  # noqa: BLE001 - exiting matters more than the record
                        log.exception("failure record not written")
                for h in logging.getLogger().handlers:
                    h.flush()
                os._exit(self.EXIT_CODE)
