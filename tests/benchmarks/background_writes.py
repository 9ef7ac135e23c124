"""Benchmark: a light stage's writes beside a checkpoint being written in the background.

After its marker, train writes its checkpoint (gigabytes) while gather and save run; persist copies
node-local checkpoints while the next iteration runs. Those stages' own writes are small and synced
(gather's train set, every marker: stages/runtime/markers.py), and each sync can wait behind the
backlog of dirty pages the large write has piled up. This writes a state of --gb gigabytes in
another process, either unpaced (torch.save to a path, as DeepSpeed does; or shutil.copyfile then
fsync, as a copy did) or through stages/runtime/paced_writes.py, and meanwhile does what a light
stage does, every --every seconds: a --light-mb file through markers.write_bytes_atomic, then a
marker through markers.write_json_atomic. It prints the writer's seconds and GB/s, the light
writes' median, 90th percentile and worst seconds, and the host's peak of dirty pages, per run and
per variant (runs alternate between the variants).

    python3 tests/benchmarks/background_writes.py [--dir DIR] [--gb 8] [--light-mb 40] [--repeats 2]
        [--writer save|copy] [--variants unpaced,paced]

--dir should be on the filesystem the run dir is on (default: a folder under the current directory).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from stages.runtime import markers, paced_writes  # noqa: E402


def dirty_bytes() -> int:
    """The host's dirty page-cache bytes (0 where /proc/meminfo is not there)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("Dirty:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def write_state(folder: str, gb: float, variant: str, writer: str, started, done) -> None:
    """The background writer's process: a state of `gb` GB in host memory (a deferred checkpoint's
    snapshot), written as `variant` says."""
    import torch

    elements = int(gb * 1e9) // 4
    # Several tensors, as a ZeRO checkpoint file holds flat partitions and their moments.
    state = {f"t{i}": torch.full((elements // 4,), float(i)) for i in range(4)}
    target = Path(folder) / "state.pt"
    if writer == "copy":  # persist's case: the file is already there; the copy is what is timed
        torch.save(state, target)
        os.sync()
        source, target = target, Path(folder) / "copy.pt"
    started.set()
    t0 = time.time()
    if writer == "copy" and variant == "paced":
        paced_writes.copy_paced(source, target)
    elif writer == "copy":
        shutil.copyfile(source, target)
        with open(target, "rb+") as f:
            os.fsync(f.fileno())
    elif variant == "paced":
        with paced_writes.PacedFile(target) as f:
            torch.save(state, f)
    else:
        torch.save(state, target)
        with open(target, "rb+") as f:  # the same bytes on storage at the end, as the paced writer leaves them
            os.fsync(f.fileno())
    done.value = time.time() - t0


def light_write(folder: Path, data: bytes, i: int) -> float:
    """What a light stage writes: its output file and its marker, each synced; returns the seconds."""
    t0 = time.time()
    markers.write_bytes_atomic(folder / "light.bin", data)
    markers.write_json_atomic(folder / "marker.json", {"i": i, "end": time.time()})
    return time.time() - t0


def light_writes(folder: Path, data: bytes, every: float, stop: threading.Event, out: list) -> None:
    while not stop.is_set():
        out.append(light_write(folder, data, len(out)))
        stop.wait(every)


def run_once(base: Path, args, variant: str) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="bw-", dir=base))
    try:
        data = os.urandom(args.light_mb << 20)
        alone = [light_write(folder, data, i) for i in range(3)]
        ctx = mp.get_context("spawn")
        started, done = ctx.Event(), ctx.Value("d", 0.0)
        proc = ctx.Process(target=write_state, args=(str(folder), args.gb, variant, args.writer, started, done))
        proc.start()
        if not started.wait(600):
            raise RuntimeError("the background writer did not start within 600 s")
        stop, lat, peak = threading.Event(), [], 0
        light = threading.Thread(target=light_writes, args=(folder, data, args.every, stop, lat))
        light.start()
        while proc.is_alive():
            peak = max(peak, dirty_bytes())
            proc.join(0.1)
        stop.set()
        light.join()
        if proc.exitcode != 0:
            raise RuntimeError(f"the background writer exited with {proc.exitcode}")
        lat.sort()
        return {"writer_s": done.value, "gb_per_s": args.gb / done.value, "n": len(lat),
                "alone_median_s": statistics.median(alone), "median_s": statistics.median(lat) if lat else 0.0,
                "p90_s": lat[int(0.9 * (len(lat) - 1))] if lat else 0.0, "max_s": lat[-1] if lat else 0.0,
                "dirty_peak_gb": peak / 1e9}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=".", help="where to write (the run dir's filesystem)")
    p.add_argument("--gb", type=float, default=8.0, help="size of the background write")
    p.add_argument("--light-mb", type=int, default=40, help="size of the light stage's synced file")
    p.add_argument("--every", type=float, default=0.25, help="seconds between the light stage's writes")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--writer", choices=("save", "copy"), default="save",
                   help="save: torch.save of the state (train's write after its marker); copy: a copy of "
                        "the saved file (persist's durable copy)")
    p.add_argument("--variants", default="unpaced,paced")
    args = p.parse_args(argv)
    variants = args.variants.split(",")
    unknown = set(variants) - {"unpaced", "paced"}
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}: choose from unpaced, paced")
    base = Path(args.dir).resolve()
    base.mkdir(parents=True, exist_ok=True)
    print(f"background {args.writer} of {args.gb:g} GB in {base}; light stage: {args.light_mb} MB synced file + "
          f"marker every {args.every:g} s; chunk {paced_writes.CHUNK_BYTES >> 20} MB; "
          f"sync_file_range {'yes' if paced_writes._sync_file_range else 'no (fdatasync per chunk)'}")
    print(f"{'variant':<9} {'writer s':>9} {'GB/s':>6} {'light n':>8} {'alone':>7} {'median':>7} {'p90':>7} "
          f"{'worst':>7} {'dirty peak GB':>14}")
    results = {v: [] for v in variants}
    for _ in range(args.repeats):
        for v in variants:
            r = run_once(base, args, v)
            results[v].append(r)
            print(f"{v:<9} {r['writer_s']:>9.2f} {r['gb_per_s']:>6.2f} {r['n']:>8} {r['alone_median_s']:>7.3f} "
                  f"{r['median_s']:>7.3f} {r['p90_s']:>7.3f} {r['max_s']:>7.3f} {r['dirty_peak_gb']:>14.2f}",
                  flush=True)
    print("means:")
    for v, rs in results.items():
        m = {k: statistics.fmean(r[k] for r in rs) for k in rs[0]}
        print(f"{v:<9} {m['writer_s']:>9.2f} {m['gb_per_s']:>6.2f} {m['n']:>8.0f} {m['alone_median_s']:>7.3f} "
              f"{m['median_s']:>7.3f} {m['p90_s']:>7.3f} {m['max_s']:>7.3f} {m['dirty_peak_gb']:>14.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
