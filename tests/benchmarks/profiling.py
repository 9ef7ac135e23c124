"""torch.profiler around one piece of a benchmark: how much of the wall time the GPU was busy, and
which kernels and host-side operators took longest. Tracing slows what it traces: the benchmarks
report their own figures from untraced runs."""

from __future__ import annotations

import sys
import time


def profiled(call, device, rows: int = 20, width: int = 60):
    """Run `call()` under torch.profiler and print the report to stderr (benchmarks keep stdout for
    their result lines); returns what `call` returned."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        out = call()
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    busy, n = gpu_busy_seconds(prof)
    print(f"PROFILE wall {wall:.2f}s, GPU busy {busy:.2f}s ({busy / wall:.0%}), {n} kernels", file=sys.stderr)
    for sort in (["cuda_time_total"] if cuda else []) + ["cpu_time_total"]:
        print(prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=width), file=sys.stderr)
    return out


def gpu_busy_seconds(prof) -> tuple[float, int]:
    """The union of the traced kernels' intervals, in seconds, and the kernel count."""
    import torch

    kernels = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0.0, float("-inf")
    for a, b in kernels:  # microseconds
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy / 1e6, len(kernels)


def host_profiled(call, rows: int = 25):
    """Run `call()` under cProfile and print to stderr where the host's time went, by Python function
    (cumulative, then own time): what torch.profiler's operator table does not name, such as
    DeepSpeed's per-parameter hooks and its optimizer step's bookkeeping. Returns what `call` returned."""
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    t0 = time.perf_counter()
    out = profile.runcall(call)
    wall = time.perf_counter() - t0
    for sort in ("cumulative", "tottime"):
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats(sort).print_stats(rows)
        print(f"HOST PROFILE wall {wall:.2f}s (cProfile slows Python calls), by {sort} time:\n{text.getvalue()}",
              file=sys.stderr)
    return out
