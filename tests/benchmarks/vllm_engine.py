"""Benchmark: the vLLM engine as generate.backend=vllm uses it, on the reference workload.

One process per run of this script, as a generate stage (or a persistent engine) would be:

1. start the engine (stages/rl/vllm_sampler.VllmSampler): its start-up split into vLLM's weight
   loading, torch.compile and CUDA-graph capture, and the whole constructor;
2. sample the reference workload once (--prompts x --attempts, up to --new-tokens): seconds and
   new tokens/s (up to and including end-of-sequence);
3. with --cycles N, what a persistent engine does between iterations, N times: sleep (GPU memory
   freed), wake up with the weights of a second export loaded in place, sample again. Checks that
   the reloaded engine samples the second model, not the first.

Run it twice with the same --cache and the same flags to see the compile cache's effect on the
second start-up (the flags are part of the cache's key; --cycles turns sleep mode on).

    python tests/benchmarks/vllm_engine.py --work DIR [--cache DIR] [--eager] [--cycles 2]
        [--batch-size N] [--prompts 256] [--attempts 8] [--new-tokens 512] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", required=True, help="models are created here once and reused")
    parser.add_argument("--cache", default=None, help="compile cache dir (default: none, vLLM's own)")
    parser.add_argument("--preset", default="small-llama")
    parser.add_argument("--eager", action="store_true", help="enforce_eager: no torch.compile, no CUDA graphs")
    parser.add_argument("--cycles", type=int, default=0)
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--attempts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--memory-fraction", type=float, default=0.5)
    parser.add_argument("--batch-size", type=int, default=0, help="generate.batch_size: vLLM's max_num_seqs")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    import torch

    from stages.rl.modeling import load_tokenizer
    from stages.rl.tiny_model import create_base_model
    from stages.rl.vllm_sampler import VllmSampler
    from stages.runtime.data import synthetic_problems

    work = Path(args.work)
    models = [work / "model_a", work / "model_b"]
    for seed, path in enumerate(models):
        if not (path / "config.json").is_file():
            create_base_model(path, args.preset, seed=seed)
    tok = load_tokenizer(models[0])
    prompts = [tok(p["question"], add_special_tokens=False)["input_ids"]
               for p in synthetic_problems(args.prompts, 999, seed=0)]
    g = SimpleNamespace(attempts=args.attempts, temperature=1.0, top_p=1.0, max_new_tokens=args.new_tokens,
                        gpus_per_process=1, vllm_memory_fraction=args.memory_fraction, batch_size=args.batch_size)
    out = {"eager": args.eager, "cache": args.cache, "batch_size": args.batch_size}
    sampler = VllmSampler(models[0], models[0], "bfloat16", g, seed=0,
                          cache_dir=Path(args.cache) if args.cache else None, sleep_mode=args.cycles > 0,
                          enforce_eager=args.eager)
    out["startup"] = sampler.figures()
    print("engine start-up:", json.dumps(out["startup"]), flush=True)

    def sample(label):
        t0 = time.time()
        completions = sampler.sample(prompts, g, tok.eos_token_id, seed=1)
        s = time.time() - t0
        tokens = sum(len(c) for c in completions)
        print(f"{label}: {len(completions)} sequences, {tokens} new tokens in {s:.2f}s = {tokens / s:.0f} tok/s",
              flush=True)
        return {"sample_s": s, "new_tokens": tokens, "tokens_per_s": tokens / s, "first": completions[0][:32]}

    out["first_sample"] = sample("sample (model a)")
    out["cycles"] = []
    for i in range(args.cycles):
        target = models[(i + 1) % 2]
        slept = sampler.sleep()
        free, total = torch.cuda.mem_get_info() if torch.cuda.is_available() else (0, 0)  # CPU: the stand-in
        woke = sampler.wake_up(target)
        cycle = {"sleep_s": slept, "free_gib_asleep": free / 2**30, "total_gib": total / 2**30, **woke,
                 **sample(f"cycle {i + 1} (model {target.name[-1]})")}
        print(f"cycle {i + 1}: sleep {slept:.2f}s ({free / 2**30:.1f} of {total / 2**30:.1f} GiB free asleep), "
              + ", ".join(f"{k} {v:.2f}s" for k, v in woke.items()), flush=True)
        out["cycles"].append(cycle)
    if len(out["cycles"]) >= 2:
        # Same seed and prompts: model b's samples differ from a's, and a's come back after two reloads.
        b, a_again = out["cycles"][0]["first"], out["cycles"][1]["first"]
        print("reload check: model b differs from a:", b != out["first_sample"]["first"],
              "| model a again equals a:", a_again == out["first_sample"]["first"])
        out["reload_check"] = {"b_differs": b != out["first_sample"]["first"],
                               "a_again_equal": a_again == out["first_sample"]["first"]}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
