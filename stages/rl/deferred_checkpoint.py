"""A DeepSpeed checkpoint written after train's marker: snapshot to host memory now, write to disk later.

DeepSpeed's save_checkpoint builds each file's state (model states, every rank's ZeRO optimizer
shard) and hands it to its checkpoint engine's save(state, path). DeferredWrites stands in for that
engine: save() copies the state's tensors to host memory and queues the file; flush() writes the
queue with the engine it replaced. Between the two, train can publish the policy weights, write its
marker and free the GPU, so the next iteration's save and generate do not wait for the
optimizer state's gigabytes to reach the disk (5-9 s of a 34 s iteration on 1 H200).

A file whose state does not fit the host-memory budget is written at once instead, as without
deferral: a snapshot must never push the node into swap or the OOM killer.
"""

from __future__ import annotations

import copy
import errno
import logging
import shutil
import time
from pathlib import Path

import torch

log = logging.getLogger("syncrl.deferred_checkpoint")

# Share of the node's available host memory the ranks of a node may hold in snapshots together.
HOST_MEMORY_SHARE = 0.5


def available_host_bytes() -> int:
    """MemAvailable of /proc/meminfo (Linux); 0 where it cannot be read (nothing is deferred)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class DeferredWrites:
    """A checkpoint engine that snapshots on save() and writes on flush(); everything else is the
    wrapped engine's (loads, directories, commits)."""

    def __init__(self, inner, budget_bytes: int):
        self.inner = inner
        self.budget = budget_bytes
        self.queued: list[tuple[str, object]] = []
        self.held = 0  # bytes of the queued snapshots
        self.written_now: list[str] = []  # files over the budget, written at save()
        self.snapshot_s = 0.0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def save(self, state_dict, path: str) -> None:
        size = state_bytes(state_dict)
        if self.held + size > self.budget:
            log.info("%s: %.2f GB does not fit the host-memory budget left (%.2f GB): written now", path, size / 1e9,
                     (self.budget - self.held) / 1e9)
            self.inner.save(state_dict, path)
            self.written_now.append(path)
            return
        t0 = time.time()
        self.queued.append((path, to_host(state_dict)))
        self.held += size
        self.snapshot_s += time.time() - t0

    def find(self, suffix: str):
        """The queued state of the file whose path ends with `suffix` (None if not queued)."""
        return next((state for path, state in self.queued if path.endswith(suffix)), None)

    def flush(self, beat=lambda: None) -> float:
        """Write the queued files in order, freeing each snapshot once written; returns the seconds."""
        t0 = time.time()
        while self.queued:
            path, state = self.queued.pop(0)
            try:
                self.inner.save(state, path)
            except BaseException as e:
                # A full disk: what was cut short goes, so the space is there for the redo.
                Path(path).unlink(missing_ok=True)
                free = shutil.disk_usage(Path(path).parent).free
                size = state_bytes(state, host_too=True)
                if isinstance(e, Exception) and free < size:
                    # torch.save's zip writer reports a full disk as "unexpected pos" (a RuntimeError).
                    raise OSError(errno.ENOSPC, f"No space left on device writing {path} ({free / 1e6:.1f} MB free, "
                                                f"{size / 1e6:.1f} MB to write)") from e
                raise
            del state
            beat()
        self.held = 0
        return time.time() - t0


def why_not(cfg, zero_stage: int) -> str | None:
    """Why train must write this run's checkpoint before its marker (None: it may defer it)."""
    if not cfg.train.deferred_checkpoint:
        return "train.deferred_checkpoint is off"
    if cfg.train.local_checkpoint_dir:
        return "train.local_checkpoint_dir is set (the persist stage makes the durable copy beside the next stages)"
    if zero_stage == 3:
        return "ZeRO stage 3 keeps no rank's weights whole, so save needs the checkpoint's shards"
    if cfg.save.export_dtype not in ("model", cfg.model.dtype):
        return (f"save.export_dtype is {cfg.save.export_dtype}, not the training dtype {cfg.model.dtype}: save "
                f"exports the fp32 master weights, which only the checkpoint holds")
    return None


def state_bytes(obj, host_too: bool = False) -> int:
    """Bytes a snapshot copies: the distinct accelerator tensors of a (nested) state (views of one
    storage counted once; host tensors are kept, not copied). host_too: every tensor's."""
    seen, total = set(), 0
    for t in _tensors(obj):
        if t.device.type == "cpu" and not host_too:
            continue
        key = _view_key(t)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def to_host(obj, memo: dict | None = None):
    """The state (dicts, lists, tuples, nested) with every accelerator tensor copied to host memory.

    Host tensors are kept as they are: train makes no step after the snapshot, so they no longer
    change. A tensor that appears twice (tied weights) is copied once and appears twice in the
    result, as torch.save keeps shared storage."""
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        if obj.device.type == "cpu":
            return obj
        key = _view_key(obj)
        if key not in memo:
            memo[key] = obj.detach().to("cpu", copy=True)
        return memo[key]
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps the dict's type (OrderedDict, defaultdict's factory)
        for k, v in obj.items():
            out[k] = to_host(v, memo)
        return out
    if type(obj) in (list, tuple):
        return type(obj)(to_host(v, memo) for v in obj)
    return obj


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _view_key(t: torch.Tensor) -> tuple:
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.storage_offset()) if t.numel() else \
        (id(t),)
