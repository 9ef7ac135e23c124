"""Benchmark: generation speed of the generate stage's sampling call, per KV-cache mode, against plain HF generate.

Modes, all on the same model, prompts, batch and sampling settings, in one process:
- eager: plain `model.generate` (growing cache, no extras): the baseline;
- dynamic, static, compiled: syncrl's own `stages.generate.sample_batch` with that `generate.cache`
  (it also computes the sampled tokens' log-probs).
Each mode runs in a fresh process, as a generate stage would: a first (cold) call, which also pays
CUDA start-up, allocator growth and any compiling, then --repeats warm calls. Prints new tokens/s
(up to end-of-sequence), decoded positions/s (sequences x the call's longest completion: every
sequence of a call runs that many steps) and each mode's ratio to eager.

    python tests/benchmarks/generate_cache.py [--preset small-llama] [--prompts 64] [--attempts 8]
                                              [--new-tokens 256] [--repeats 3] [--modes eager,dynamic,static,compiled]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small-llama")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--attempts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default="eager,dynamic,static,compiled")
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # MODE:MODEL_DIR, one mode's process
    args = parser.parse_args()
    if args.child:
        mode, model_dir = args.child.split(":", 1)
        print("RESULT " + json.dumps(run_mode(args, mode, Path(model_dir))), flush=True)
        return 0

    from stages.common.tiny_model import create_base_model

    model_dir = create_base_model(Path(tempfile.mkdtemp(prefix="syncrl-gen-")) / "base", args.preset)
    print(f"{args.preset}, {args.dtype}: {args.prompts} prompts x {args.attempts} samples = "
          f"{args.prompts * args.attempts} sequences per call, up to {args.new_tokens} new tokens; "
          f"one process per mode", flush=True)
    results = {}
    for i, mode in enumerate(args.modes.split(",")):
        child = [sys.executable, __file__, *sys.argv[1:], "--child", f"{mode}:{model_dir}"]
        proc = subprocess.run(child, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            print(f"  {mode}: failed (exit {proc.returncode})\n{proc.stderr[-2000:]}", flush=True)
            continue
        # A mode named twice shows what a second process gains from caches the first left (compiled code).
        label = mode if mode not in results else f"{mode}#{i}"
        r = results[label] = json.loads(lines[-1][len("RESULT "):])
        print(f"  {label:<11} process start to first call done {r['first_call_done_s']:6.1f}s; "
              f"cold call {r['cold_s']:6.2f}s {r['cold_new_per_s']:8.0f} new tok/s | warm {r['warm_s']:6.2f}s "
              f"{r['warm_new_per_s']:8.0f} new tok/s {r['warm_positions_per_s']:9.0f} positions/s", flush=True)
    base = results.get("eager")
    if base:
        for mode, r in results.items():
            warm = r["warm_positions_per_s"] / base["warm_positions_per_s"]
            print(f"{mode:<11} / eager: warm positions/s {warm:5.2f}x, "
                  f"cold call {base['cold_s'] / r['cold_s']:5.2f}x faster")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


def run_mode(args, mode: str, model_dir: Path) -> dict:
    t_start = time.perf_counter()
    import torch

    from stages.common.config import DataConfig, GenerateConfig
    from stages.common.data import iteration_prompts, synthetic_problems
    from stages.common.modeling import device_for, load_policy, load_tokenizer
    from stages.generate import sample_batch

    device = device_for(0)
    tokenizer = load_tokenizer(model_dir)
    model = load_policy(model_dir, args.dtype, device).eval()
    items = iteration_prompts(DataConfig(prompts_per_iteration=args.prompts), synthetic_problems(1000, 4, 0), 0, 0)

    def plain_generate():
        enc = tokenizer([it["prompt"] for it in items], return_tensors="pt", padding=True, padding_side="left",
                        add_special_tokens=False).to(device)
        with torch.no_grad():
            out = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, max_new_tokens=args.new_tokens,
                                 num_return_sequences=args.attempts, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
        completions = out[:, enc["input_ids"].shape[1]:].tolist()
        lengths = [c.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in c else len(c) for c in completions]
        return lengths, len(completions) * len(completions[0])

    def syncrl_generate():
        g = GenerateConfig(attempts=args.attempts, max_new_tokens=args.new_tokens,
                           batch_size=args.prompts * args.attempts, cache=mode)
        rows = sample_batch(model, tokenizer, items, g, device)
        lengths = [len(r["completion_ids"]) for r in rows]
        return lengths, len(rows) * max(lengths)

    runs = []
    for i in range(args.repeats + 1):  # the first call is the cold one
        torch.manual_seed(i)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        lengths, positions = plain_generate() if mode == "eager" else syncrl_generate()
        if device.type == "cuda":
            torch.cuda.synchronize()
        runs.append((time.perf_counter() - t0, sum(lengths), positions))
        if i == 0:
            first_done = time.perf_counter() - t_start
    (cold_s, cold_new, _), warm = runs[0], runs[1:]
    warm_s = sum(t for t, _, _ in warm)
    return {"first_call_done_s": first_done, "cold_s": cold_s, "cold_new_per_s": cold_new / cold_s,
            "warm_new_per_s": sum(n for _, n, _ in warm) / warm_s,
            "warm_positions_per_s": sum(p for _, _, p in warm) / warm_s, "warm_s": warm_s / len(warm)}


if __name__ == "__main__":
    sys.exit(main())
