"""Peak memory of this process: host RSS always, GPU allocator figures when the stage used CUDA.

Torch is only consulted if the stage already imported it, so torch-free stages stay torch-free.
"""

from __future__ import annotations

import gc
import logging
import os
import resource
import sys

log = logging.getLogger(__name__)

# Warn when the allocator has reserved more than this share of the device: the next larger batch
# or longer sequence is likely to run out of memory.
RESERVED_WARN_FRACTION = 0.92


def memory_report() -> dict:
    report = {"host_rss_peak_gib": host_rss_peak_bytes() / 2**30}
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return report
    total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    stats = torch.cuda.memory_stats()
    allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    report.update({
        "gpu_peak_allocated_gib": allocated / 2**30,
        "gpu_peak_reserved_gib": reserved / 2**30,
        "gpu_peak_allocated_pct": 100 * allocated / total,
        "gpu_peak_reserved_pct": 100 * reserved / total,
        "gpu_alloc_retries": stats.get("num_alloc_retries", 0),
        "gpu_ooms": stats.get("num_ooms", 0),
    })
    if reserved > RESERVED_WARN_FRACTION * total:
        log.warning("GPU memory reserved peaked at %.1f%% of the device: close to running out",
                    report["gpu_peak_reserved_pct"])
    return report


def host_rss_peak_bytes() -> int:
    """This process's peak resident memory. VmHWM belongs to the address space, so it starts afresh at
    exec; getrusage's ru_maxrss would carry over the launching parent's peak."""
    peak = _proc_kib("/proc/self/status", "VmHWM:")
    return peak * 1024 if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# Share of the node's available host memory the ranks of a node may hold in deferred checkpoints'
# snapshots together (stages/rl/deferred_checkpoint.py): a snapshot must never push the node into swap
# or the OOM killer.
HOST_MEMORY_SHARE = 0.5


def snapshot_budget_bytes(available: int, ranks_per_node: int, in_memory: bool, held: int = 0) -> int:
    """Host memory one rank's snapshot may hold: HOST_MEMORY_SHARE of the node's `available` memory,
    shared by its ranks, plus `held` (what is already prepared for it); half that where the checkpoint
    folder is `in_memory` (tmpfs), as each file written there takes its snapshot's size again."""
    budget = available * HOST_MEMORY_SHARE / max(1, ranks_per_node) + held
    return int(budget / (2 if in_memory else 1))


def memory_backed(path) -> bool:
    """Whether `path` (or where it will be: its symbolic links followed) is on a filesystem held in
    host memory (tmpfs, ramfs), by the longest mount point of /proc/mounts that contains it."""
    target = os.path.realpath(path)
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split()[1:3] for line in f.read().splitlines() if len(line.split()) > 2]
    except OSError:
        return False
    best, kind = "", ""
    for point, fstype in mounts:
        point = point.replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fstype
    return kind in ("tmpfs", "ramfs")


def available_host_bytes() -> int:
    """The node's MemAvailable (Linux); 0 where it cannot be read."""
    return (_proc_kib("/proc/meminfo", "MemAvailable:") or 0) * 1024


def _proc_kib(path: str, field: str) -> int | None:
    """A "<field> <n> kB" line of a /proc file, in KiB (None if absent or unreadable)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def freeze_loaded_objects() -> None:
    """Collect once, then leave every object alive now out of later collections (gc.freeze).

    A stage started early calls it when its preload is done, off the critical path: the objects of
    torch's, DeepSpeed's and transformers' modules live as long as the process, yet each full
    collection in the stage's turn (release_cached_memory, more than once per iteration) walks them
    all again, seconds in all on a slow host. Objects alive now are still freed when their last reference goes; only
    cycles among them that die later are never collected."""
    gc.collect()
    gc.freeze()


def release_cached_memory() -> None:
    """Between generation batches and before saving: hand freed blocks back (fragmentation, peers)."""
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def free_tensors_reached(root, device) -> int:
    """Give back the memory of every tensor on `device` that `root` reaches through containers and
    objects' attributes (not through classes, modules or functions); returns the bytes freed.

    For an object the process is done with but cannot drop: a ZeRO-3 engine stays reachable after
    its destroy() and a collection (DeepSpeed 0.19 keeps references to it: its module, for one, on a
    module-level stack), and with it the model, its gradients and the optimizer state. Every tensor
    it reaches is unusable afterwards."""
    import types

    import torch

    skip = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.CodeType,
            types.FrameType, str, bytes, int, float)
    seen, stack, freed = set(), [root], 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.device.type == device.type and device.index in (None, obj.device.index):
                storage = obj.untyped_storage()
                if storage.resizable():  # not memory it does not own (a mapped file, another library's)
                    freed += storage.nbytes()
                    storage.resize_(0)
            # A parameter's own attributes (ZeRO-3's partition, ds_tensor) and its gradient.
            stack.extend(vars(obj).values())
            if obj.is_leaf and obj.grad is not None:  # a non-leaf's .grad is None, with a warning
                stack.append(obj.grad)
            continue
        stack.extend(gc.get_referents(obj))
    return freed
