"""Peak memory of this process: host RSS always, GPU allocator figures when the stage used CUDA.

Torch is only consulted if the stage already imported it, so torch-free stages stay torch-free.
"""

from __future__ import annotations

import logging
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


def release_cached_memory() -> None:
    """Between generation batches and before saving: hand freed blocks back (fragmentation, peers)."""
    import gc

    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
