"""Benchmark: the save stage's export of the policy train wrote before its marker, both ways.

With tuning.deferred_checkpoint (the default) train writes the policy's weights as one safetensors
file before its marker, and the next generate waits for save's export. This writes such a file for
a built-in preset (in --dtype), then times, --repeats times each, in one process:

  written   stages/save.write_weights: the file read, the model written through save_pretrained,
            reloaded and compared tensor by tensor (what save did until 2026-12-02, and still does
            when train wrote no such file)
  linked    stages/save.link_export: the architecture built on the meta device, the file's header
            checked against it, the file hard-linked in, config and tokenizer written

and prints seconds per part. Each run exports into a fresh folder under --dir, removed after.

    python tests/benchmarks/save_export.py [--preset small-llama] [--dtype bfloat16] [--dir /tmp/syncrl-save]
        [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small-llama")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    ap.add_argument("--dir", default="/tmp/syncrl-save")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from safetensors.torch import load_file, save_file
    from transformers.utils import logging as hf_logging

    from stages.rl.tiny_model import create_base_model
    from stages.save import SAFE_WEIGHTS_NAME, link_export, write_weights

    hf_logging.disable_progress_bar()
    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    t0 = time.time()
    base = create_base_model(work / "base", args.preset, dtype=args.dtype)
    policy = work / "policy.safetensors"
    save_file(load_file(base / SAFE_WEIGHTS_NAME), str(policy), metadata={"format": "pt"})
    size = policy.stat().st_size
    print(f"{args.preset} in {args.dtype}: {size / 1e9:.2f} GB of weights ({time.time() - t0:.1f}s to create)")

    def written(out):
        t = time.time()
        state = load_file(policy)  # save's read of train's file (its "consolidate")
        read_s = time.time() - t
        return {"read_s": read_s, **write_weights(state, base, args.dtype, out, base)}

    def linked(out):
        return {"read_s": 0.0, **link_export(policy, base, args.dtype, out, base)}

    rows = []
    print(f"\n{'method':<8} {'run':>3} {'read s':>7} {'export s':>9} {'verify s':>9} {'total s':>8}")
    for name, fn in (("written", written), ("linked", linked)):
        for r in range(args.repeats):
            out = work / f"{name}_{r}"
            t = time.time()
            seconds = fn(out)
            total = time.time() - t
            shutil.rmtree(out)
            rows.append({"method": name, "run": r, "total_s": total, **seconds})
            print(f"{name:<8} {r:>3} {seconds['read_s']:>7.2f} {seconds['export_s']:>9.2f} {seconds['verify_s']:>9.2f}"
                  f" {total:>8.2f}")
    means = {m: statistics.fmean(r["total_s"] for r in rows if r["method"] == m) for m in ("written", "linked")}
    print(f"\nmean: written {means['written']:.2f}s, linked {means['linked']:.2f}s "
          f"({means['written'] / max(means['linked'], 1e-9):.0f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps({"preset": args.preset, "dtype": args.dtype, "bytes": size,
                                               "rows": rows, "mean_s": means}, indent=1))
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
