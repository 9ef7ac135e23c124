"""Benchmark: copying a checkpoint's GPU tensors to host memory, the ways a deferred checkpoint could.

With tuning.deferred_checkpoint, train copies its checkpoint's state (bf16 weights, fp32 master
weights, both Adam moments) to host memory before its marker; that copy is the checkpoint's cost
on the critical path. This builds tensors of the same sizes on the GPU (--gb in all: a seventh as
--params bf16 weights, the rest as three flat fp32 partitions, as ZeRO-1/2 keeps them), then times
each method into fresh host memory, freeing it between methods, and prints seconds and GB/s:

  pageable   tensor.to("cpu"): what stages/rl/deferred_checkpoint.py did until 2026-12-02
  touched    host tensors allocated and written first (torch's parallel fill, every core), then copy_
  pinned     page-locked host tensors (cudaHostAlloc), then copy_
  staged     stages/rl/deferred_checkpoint.copy_to_host: through two --chunk-mb page-locked buffers,
             each chunk's device copy overlapping the host copy of the one before, into touched host
             tensors
  locked     stages/rl/deferred_checkpoint.copy_to_host into a HostPool page-locked by the tensors'
             layout (what a train process started early prepares before its turn; the preparation is
             timed apart, as "prepared")
  device     a copy on the GPU itself (what holding the state on the GPU until the write saves)

Host allocations of torch honour THP_MEM_ALLOC_ENABLE=1 (transparent huge pages), read once per
process: run the script with and without it to see what 4 KB page faults cost.

    python tests/benchmarks/snapshot_copy.py [--gb 6.66] [--methods pageable,touched,pinned,staged,locked,device]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def build(gb: float, params: int, device):
    import torch

    total = int(gb * 1e9)
    weights = total // 7 // 2  # bf16 elements
    sizes = [weights // params] * params
    flats = [total * 2 // 7 // 4] * 3  # fp32 elements each
    return ([torch.randn(n, dtype=torch.bfloat16, device=device) for n in sizes]
            + [torch.randn(n, dtype=torch.float32, device=device) for n in flats])


def pageable(tensors):
    return [t.to("cpu") for t in tensors]


def touched(tensors):
    import torch

    out = [torch.empty(t.shape, dtype=t.dtype).fill_(0) for t in tensors]
    for o, t in zip(out, tensors):
        o.copy_(t)
    return out


def pinned(tensors):
    import torch

    out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for o, t in zip(out, tensors):
        o.copy_(t, non_blocking=True)
    torch.cuda.synchronize()
    return out


def staged(tensors, chunk_bytes: int):
    from stages.rl import deferred_checkpoint

    deferred_checkpoint.STAGING_BYTES = chunk_bytes
    return deferred_checkpoint.copy_to_host(tensors)


def locked(tensors, chunk_bytes: int, done: list):
    import tempfile

    import torch

    from stages.rl import deferred_checkpoint as dc

    dc.STAGING_BYTES = chunk_bytes  # for any tensor CUDA would not lock
    layout = [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]
    pool = dc.HostPool()
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "layout.json"
        path.write_text(json.dumps(layout))
        t0 = time.perf_counter()
        pool.prepare(path, budget_bytes=1 << 62, cuda_device=torch.cuda.current_device())
        pool.wait()
    print(f"  prepared {pool.prepared_bytes / 1e9:.2f} GB ({pool.locked_bytes / 1e9:.2f} GB page-locked) in "
          f"{time.perf_counter() - t0:.2f} s", flush=True)
    t0 = time.perf_counter()
    out = dc.copy_to_host(tensors, pool)
    done.append(time.perf_counter() - t0)
    done.append(pool.close)  # once the copies are dropped
    return out


def device_copy(tensors):
    import torch

    out = [t.clone() for t in tensors]
    torch.cuda.synchronize()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gb", type=float, default=6.66, help="bytes in all (the 0.48B preset's checkpoint: 6.66)")
    parser.add_argument("--params", type=int, default=218, help="weight tensors")
    parser.add_argument("--methods", default="pageable,touched,pinned,staged,locked,device")
    parser.add_argument("--chunk-mb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("snapshot_copy.py copies from a GPU: none is visible")
    methods = {"pageable": pageable, "touched": touched, "pinned": pinned, "device": device_copy,
               "staged": lambda ts: staged(ts, args.chunk_mb << 20),
               "locked": lambda ts: locked(ts, args.chunk_mb << 20, after)}
    unknown = set(args.methods.split(",")) - set(methods)
    if unknown:
        raise SystemExit(f"--methods: unknown {', '.join(sorted(unknown))}; choose from {', '.join(methods)}")
    tensors = build(args.gb, args.params, torch.device("cuda"))
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    torch.cuda.synchronize()
    thp = os.environ.get("THP_MEM_ALLOC_ENABLE", "0")
    print(f"{nbytes / 1e9:.2f} GB in {len(tensors)} tensors; {torch.get_num_threads()} CPU threads; "
          f"THP_MEM_ALLOC_ENABLE={thp}", flush=True)
    results = []
    after = []  # locked: the copy's own seconds, then what frees its memory
    for name in args.methods.split(","):
        for r in range(args.repeats):
            t0 = time.perf_counter()
            out = methods[name](tensors)
            seconds = time.perf_counter() - t0
            if after:
                seconds = after.pop(0)
            if r == 0:
                ok = all(torch.equal(o.cpu() if o.is_cuda else o, t.cpu()) for o, t in zip(out[-2:], tensors[-2:]))
                if not ok:
                    raise SystemExit(f"{name}: the copy differs from the GPU tensors")
            del out
            while after:
                after.pop()()
            gc.collect()
            torch.cuda.empty_cache()
            results.append({"method": name, "repeat": r, "seconds": seconds, "gb_per_s": nbytes / seconds / 1e9,
                            "thp": thp})
            print(f"{name:<9} {seconds:6.2f} s  {nbytes / seconds / 1e9:6.2f} GB/s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
