"""Benchmark: the built-in synthetic task under RL, end to end through `syncrl run`.

Prints the mean reward and accuracy of the first and last iterations (and every one between), the
wall time of every stage averaged over iterations, and the coordinator's own overhead.

    python tests/benchmarks/reward_curve.py [--iterations 12] [--run-dir DIR] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from stages.runtime.paths import STAGES  # noqa: E402 (needs ROOT on the path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--config", default="configs/local_tiny.yaml")
    parser.add_argument("--run-dir", default=None, help="default: a fresh temporary directory")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="syncrl-bench-")) / "run"
    cmd = [sys.executable, "-m", "jobs.cli", "run", args.config, f"run_dir={run_dir}",
           f"iterations={args.iterations}", *args.overrides]
    print("$", " ".join(cmd), flush=True)
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=ROOT)
    wall = time.time() - t0
    if proc.returncode != 0:
        print(f"run failed with exit code {proc.returncode}; see {run_dir}/logs", file=sys.stderr)
        return proc.returncode
    report(run_dir, args.iterations, wall)
    return 0


def report(run_dir: Path, iterations: int, wall: float) -> None:
    rows, times = [], {s: [] for s in STAGES}
    for it in range(iterations):
        markers = run_dir / f"iter_{it:05d}" / "markers"
        stats = json.loads((run_dir / f"iter_{it:05d}" / "gather" / "stats.json").read_text())
        rows.append((it, stats["reward_mean"], stats["accuracy"], stats["formatted"], stats["length_mean"]))
        for s in STAGES:
            times[s].append(json.loads((markers / f"{s}.done").read_text())["duration_s"])
    print(f"\nrun dir: {run_dir}\n")
    print(f"{'iter':>4}  {'reward':>7}  {'accuracy':>8}  {'formatted':>9}  {'length':>6}")
    for it, reward, acc, fmt, length in rows:
        print(f"{it:>4}  {reward:>7.3f}  {acc:>8.3f}  {fmt:>9.3f}  {length:>6.2f}")
    first, last = rows[0], rows[-1]
    print(f"\nfirst iteration: reward {first[1]:.3f}, accuracy {first[2]:.3f}")
    print(f"last iteration:  reward {last[1]:.3f}, accuracy {last[2]:.3f}")
    print(f"change over the run: reward {last[1] - first[1]:+.3f}, accuracy {last[2] - first[2]:+.3f} "
          f"({last[2] / max(first[2], 1e-9):.1f}x)\n")
    print("wall time per stage (mean over iterations, seconds):")
    stage_total = 0.0
    for s in STAGES:
        mean = statistics.fmean(times[s])
        stage_total += sum(times[s])
        print(f"  {s:<9}{mean:6.2f}  (min {min(times[s]):.2f}, max {max(times[s]):.2f})")
    print(f"iteration mean: {wall / iterations:.2f}s; whole run {wall:.1f}s "
          f"(stages {stage_total:.1f}s, coordinator and base-model setup {wall - stage_total:.1f}s)")


if __name__ == "__main__":
    sys.exit(main())
