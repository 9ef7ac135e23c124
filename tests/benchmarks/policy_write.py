"""Benchmark: the policy file train writes for save before its marker, safetensors' writer against
stages/rl/policy_file.py's threaded one.

Train writes the policy's weights (training dtype, one safetensors file) on the critical path every
iteration under the deferred checkpoint (from the snapshot in host memory) and under ZeRO-3. This
lays out a preset's parameters as host tensors (random bf16 values, the preset's names and shapes,
built on the meta device), then times, in mirrored order --repeats times, writing them into --dir
with safetensors.torch.save_file ("safetensors") and with policy_file.write_threaded at each thread
count, checks each file reads back equal to the first, and prints seconds and GB/s.

    python tests/benchmarks/policy_write.py [--preset llama3-3b-shape] [--dir /dev/shm/syncrl-policy]
        [--threads 1,4,8] [--repeats 2]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama3-3b-shape")
    ap.add_argument("--dir", default="/dev/shm/syncrl-policy")
    ap.add_argument("--threads", default="1,4,8")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from stages.rl import policy_file
    from stages.rl.tiny_model import llama_config
    from stages.runtime.presets import PRESETS

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(llama_config(PRESETS[args.preset]))
    g = torch.Generator().manual_seed(0)
    weights = {name: torch.empty(p.shape, dtype=torch.bfloat16).normal_(generator=g)
               for name, p in model.named_parameters()}
    size = sum(t.numel() * t.element_size() for t in weights.values())
    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    print(f"{args.preset}: {len(weights)} tensors, {size / 1e9:.2f} GB into {work}", flush=True)

    ways = {"safetensors": lambda path: save_file(weights, str(path), metadata={"format": "pt"})}
    for n in (int(x) for x in args.threads.split(",")):
        ways[f"threads={n}"] = lambda path, n=n: policy_file.write_threaded(weights, path, n)
    reference = None
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for rep in range(args.repeats):
        for name in (list(ways) if rep % 2 == 0 else list(ways)[::-1]):
            path = work / f"{name}.safetensors"
            t0 = time.perf_counter()
            ways[name](path)
            seconds[name].append(time.perf_counter() - t0)
            if rep == 0:
                back = load_file(path)
                reference = reference or back
                if sorted(back) != sorted(reference) or any(not torch.equal(back[k], reference[k]) for k in back):
                    raise SystemExit(f"{name}: the file reads back different")
                del back
            path.unlink()
    for name, runs in seconds.items():
        s = statistics.mean(runs)
        print(f"{name:<12} {s:6.2f} s  {size / 1e9 / s:6.2f} GB/s  (runs: {', '.join(f'{x:.2f}' for x in runs)})")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
