"""Benchmark: the generate stage's sampling call with a growing (dynamic) vs a preallocated (static) KV cache.

Both run syncrl's own `stages.generate.sample_batch` in one process, on the same model, prompts,
batch and sampling settings, warm (after a full-size warm-up call) and cold (the first call, as a
fresh generate stage process sees it). Prints new tokens/s, decoded positions/s and the ratio of
static to dynamic.

    python tests/benchmarks/generate_cache.py [--preset small-llama] [--prompts 64] [--attempts 8]
                                              [--new-tokens 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
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
    args = parser.parse_args()

    import torch

    from stages.common.config import DataConfig, GenerateConfig
    from stages.common.data import iteration_prompts, synthetic_problems
    from stages.common.modeling import device_for, load_policy, load_tokenizer
    from stages.common.tiny_model import create_base_model
    from stages.generate import sample_batch

    device = device_for(0)
    model_dir = create_base_model(Path(tempfile.mkdtemp(prefix="syncrl-gen-")) / "base", args.preset)
    tokenizer = load_tokenizer(model_dir)
    model = load_policy(model_dir, args.dtype, device).eval()
    items = iteration_prompts(DataConfig(prompts_per_iteration=args.prompts), synthetic_problems(1000, 4, 0), 0, 0)
    print(f"{args.preset} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f}M params, {args.dtype}) on "
          f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}: {args.prompts} prompts x "
          f"{args.attempts} samples = {args.prompts * args.attempts} sequences, up to {args.new_tokens} new tokens")

    results = {}
    for cache in ("dynamic", "static"):
        g = GenerateConfig(attempts=args.attempts, max_new_tokens=args.new_tokens, batch_size=args.prompts * args.attempts,
                           cache=cache)
        runs = []
        for i in range(args.repeats + 1):  # the first call is the cold one
            torch.manual_seed(i)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            rows = sample_batch(model, tokenizer, items, g, device)
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            new = sum(len(r["completion_ids"]) for r in rows)
            steps = max(len(r["completion_ids"]) for r in rows)
            runs.append((dt, new, steps * len(rows)))
        cold, warm = runs[0], runs[1:]
        warm_tps = sum(n for _, n, _ in warm) / sum(t for t, _, _ in warm)
        warm_pos = sum(p for _, _, p in warm) / sum(t for t, _, _ in warm)
        results[cache] = (cold[1] / cold[0], warm_tps)
        print(f"  {cache:<8} cold: {cold[0]:6.2f}s {cold[1] / cold[0]:9.0f} new tok/s | warm (mean of {args.repeats}): "
              f"{warm_tps:9.0f} new tok/s, {warm_pos:9.0f} decoded positions/s")
    print(f"static / dynamic: cold {results['static'][0] / results['dynamic'][0]:.2f}x, "
          f"warm {results['static'][1] / results['dynamic'][1]:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
