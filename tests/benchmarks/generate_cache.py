"""Benchmark: the generate stage's sampling, per generate.cache mode, on the reference workload.

Every mode runs in a fresh process, as a generate stage runs it: load the model (with the stage's
tuning: fused RMSNorm unless the mode says `fused_rms_norm=false`), then one call of
`stages.generate.sample_rows` over all of a rank's prompts (which also runs the old-log-prob pass),
then --repeats more calls in the same process (what a longer-lived process would see, compiled code
and captured graphs included). Modes are generate.cache values, optionally with generate.* or tuning.* settings after a
colon: `compact`, `compact:decode_graphs=false`, `static:batch_size=512` (HF generate in calls of 512,
what the stage did before), `compiled:batch_size=512`, `paged`, `dynamic:batch_size=512`; and `vllm`
(generate.backend=vllm, where vLLM is installed: the engine's start-up apart from the call; with
`vllm:persistent=true` each later call follows a sleep and a wake-up with the weights reloaded).

Prints per mode: the first call's wall time, new tokens/s (up to end-of-sequence), decoded
positions/s (rows that decode steps ran, finished rows included), the sampling and log-prob-pass
split, the memory-bandwidth bound for the same completions, and the roofline per phase (prefill, all
sequences running, the tail) against the compact sampler's own times (tests/benchmarks/decode_bound.py),
and in all with each prompt's K/V read once for its attempts.
With --step-times, also the compact sampler's decode steps grouped by the rows they ran: wall time
per step against that step's memory bound (weights plus the K/V of the attended prefix), and its
line per call (prompt width, steps, prefill time).

    python tests/benchmarks/generate_cache.py [--preset small-llama] [--prompts 256] [--attempts 8]
        [--new-tokens 512] [--repeats 0] [--modes compact,static:batch_size=512] [--step-times]
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.benchmarks.decode_bound import PEAK_FLOPS, bound, hbm_bandwidth, model_shape, roofline  # noqa: E402

DEFAULT_MODES = "compact,compact:decode_graphs=false,static:batch_size=512"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small-llama")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--attempts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=0, help="calls after the first, in the same process")
    parser.add_argument("--modes", default=DEFAULT_MODES)
    parser.add_argument("--bandwidth", type=float, default=None,
                        help="HBM bytes/s, for the bound (default: the card's, by its name)")
    parser.add_argument("--peak-flops", type=float, default=PEAK_FLOPS, help="dense bf16 FLOP/s, for the roofline")
    parser.add_argument("--json", default=None)
    parser.add_argument("--data-source", default="synthetic",
                        help="data.source: a JSONL file of problems (GSM8K's test.jsonl, say) or the synthetic task")
    parser.add_argument("--prompt-template", default=None, help="data.prompt_template (default: the config's)")
    parser.add_argument("--matmul-below", type=int, default=None,
                        help="decode steps attending to fewer positions use the batched-products attention "
                             "(decoding.MATMUL_ATTENTION_BELOW), the longer ones SDPA")
    parser.add_argument("--profile", action="store_true",
                        help="trace each mode's first call (torch.profiler) and print where its time went; "
                             "the tracing slows the call, so its figures are not the mode's")
    parser.add_argument("--step-times", action="store_true",
                        help="time every decode step of the compact sampler (from one step's forward to the next: "
                             "the loop syncs once a step) and print them by rows decoded, against each step's "
                             "memory bound; no sync is added")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # MODE@MODEL_DIR, one mode's process
    args = parser.parse_args()
    args.bandwidth, card = hbm_bandwidth(given=args.bandwidth)
    if args.child:
        mode, model_dir = args.child.split("@", 1)
        print("RESULT " + json.dumps(run_mode(args, mode, Path(model_dir))), flush=True)
        return 0

    from jobs.base_model import create_base_model

    # Written by a child process, as a run's is: built here, a large preset's weights would stay in this
    # process's GPU memory (the allocator's cache) while each mode's process samples, which would size
    # its K/V buffer (or vLLM's) from what was left.
    work = Path(tempfile.mkdtemp(prefix="syncrl-gen-"))
    atexit.register(shutil.rmtree, work, True)  # a large preset's weights would fill the disk run after run
    model_dir = create_base_model(work / "base", args.preset, 0, dtype=args.dtype)
    shape = model_shape(model_dir)
    weights, kv = shape.weight_bytes, shape.kv_per_position
    print(f"{args.preset}, {args.dtype}, {args.data_source} problems: {args.prompts} prompts x {args.attempts} samples = "
          f"{args.prompts * args.attempts} sequences, up to {args.new_tokens} new tokens; one process per mode; "
          f"bound at {args.bandwidth / 1e12:.2f} TB/s ({card})", flush=True)
    print(f"{'mode':<28} {'first call':>10} {'new tok/s':>10} {'pos/s':>10} {'sampling':>9} {'logprob':>8} "
          f"{'bound tok/s':>11} {'of bound':>8} {'warm tok/s':>10}")
    results = {}
    for mode in args.modes.split(","):
        # The bandwidth as found here: each mode's process need not ask nvidia-smi again.
        child = [sys.executable, __file__, *sys.argv[1:], "--bandwidth", str(args.bandwidth), "--child",
                 f"{mode}@{model_dir}"]
        proc = subprocess.run(child, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        for line in proc.stderr.splitlines():
            if line.startswith("STEPS ") or "decoding call" in line:
                print(line, flush=True)
        if args.profile:
            print(proc.stderr[proc.stderr.find("PROFILE"):] if "PROFILE" in proc.stderr else proc.stderr[-3000:])
        if proc.returncode != 0 or not lines:
            print(f"{mode:<28} failed (exit {proc.returncode})\n{proc.stderr[-3000:]}", flush=True)
            continue
        r = json.loads(lines[-1][len("RESULT "):])
        pairs = r.pop("pairs")
        b = bound(pairs, weights, kv, args.bandwidth)
        r["bound"] = b
        r["roofline"] = roofline(pairs, args.attempts, shape, args.peak_flops, args.bandwidth)
        r["roofline_shared_prompts"] = roofline(pairs, args.attempts, shape, args.peak_flops, args.bandwidth,
                                                shared_prompts=True)
        results[mode] = r
        cold = r["calls"][0]
        warm = r["calls"][1:]
        warm_tps = sum(c["new_tokens"] for c in warm) / sum(c["s"] for c in warm) if warm else None
        print(f"{mode:<28} {cold['s']:>9.1f}s {cold['new_tokens'] / cold['s']:>10.0f} "
              f"{cold['positions'] / cold['s']:>10.0f} {fmt_s(cold['sample_s']):>9} "
              f"{fmt_s(cold['logprob_pass_s']):>8} {b['new_tokens_per_s']:>11.0f} "
              f"{cold['new_tokens'] / cold['s'] / b['new_tokens_per_s']:>8.1%} "
              f"{warm_tps if warm_tps else float('nan'):>10.0f}", flush=True)
        for i, call in enumerate(r["calls"]):
            if "engine" in call:
                print(f"{'':<28} call {i}: {call['s']:.2f}s, {call['new_tokens'] / call['s']:.0f} new tok/s"
                      + (" after " if call["engine"] else "")
                      + ", ".join(f"{k} {v:.2f}s" for k, v in call["engine"].items()), flush=True)
        if mode.startswith("vllm"):
            # The first call's roofline in new tokens/s, against which a later call's rate is set too.
            rf = r["roofline"]["bound_s"]
            rf_tps = cold["new_tokens"] / rf
            print(f"{'':<28} roofline: all {rf:.3g}s ({rf_tps:.0f} new tok/s), {rf / cold['s']:.1%} of the first "
                  f"call, {warm_tps / rf_tps if warm_tps else float('nan'):.1%} of a later one; one after the other "
                  f"{r['roofline']['serial_s']:.3g}s; GPU memory in use {r['peak_gib']:.1f} GiB", flush=True)
        if cold.get("stats"):
            s = cold["stats"]
            print(f"{'':<28} calls {s.get('calls')} in {s.get('rounds')} round(s), {s.get('spilled')} spilled, "
                  f"{s.get('widenings')} widenings, "
                  f"rows {s.get('rows')}, steps {s.get('steps')}, compactions "
                  f"{s.get('compactions')}, graphs {s.get('graphs')} ({s.get('graph_capture_s', 0):.2f}s to capture), "
                  f"prefill {s.get('prefill_s', 0):.2f}s; peak GPU {r['peak_gib']:.1f} GiB; "
                  f"process start to first call done {r['first_call_done_s']:.1f}s", flush=True)
            print(f"{'':<28} {roofline_line(r['roofline'], s, cold['sample_s'])}", flush=True)
            if cold["sample_s"]:
                shared = r["roofline_shared_prompts"]["bound_s"]
                print(f"{'':<28} roofline with each prompt's K/V read once for its attempts (as the decode kernel "
                      f"may): all {shared:.3g}s, {shared / cold['sample_s']:.1%} of sampling", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


def run_mode(args, mode: str, model_dir: Path) -> dict:
    t_start = time.perf_counter()
    import logging

    import torch

    # The sampler's line per call (its width, steps, prefill), for the parent to print.
    logging.getLogger("syncrl.generate").addHandler(logging.StreamHandler(sys.stderr))
    logging.getLogger("syncrl.generate").setLevel(logging.INFO)

    import yaml

    from stages.runtime.config import DataConfig, GenerateConfig, TuningConfig
    from stages.runtime.data import iteration_prompts, load_problems
    from stages.rl.modeling import device_for, load_policy, load_tokenizer
    from stages.generate import sample_rows
    from stages.rl import prompts

    if args.matmul_below is not None:
        from stages.rl import decoding

        decoding.MATMUL_ATTENTION_BELOW = args.matmul_below
    cache, _, rest = mode.partition(":")
    overrides = {k: yaml.safe_load(v) for k, v in (kv.split("=", 1) for kv in rest.split(";") if kv)} if rest else {}
    tuning_keys = {f.name for f in dataclasses.fields(TuningConfig)}
    vllm = cache == "vllm"
    g = GenerateConfig(attempts=args.attempts, max_new_tokens=args.new_tokens,
                       **({"backend": "vllm"} if vllm else {"cache": cache}),
                       **{k: v for k, v in overrides.items() if k not in tuning_keys})
    tuning = TuningConfig(**{k: v for k, v in overrides.items() if k in tuning_keys})
    device = device_for(0)
    tokenizer = load_tokenizer(model_dir)
    # synthetic_size: the synthetic draw this benchmark has always made, so its figures stay comparable.
    data = DataConfig(prompts_per_iteration=args.prompts, source=args.data_source, split="test", synthetic_size=1000,
                      **({"prompt_template": args.prompt_template} if args.prompt_template else {}))
    items = iteration_prompts(data, load_problems(data, 0), 0, 0)
    prompts.encode(tokenizer, items, data, model_dir)
    if vllm:
        return run_vllm(args, g, items, tokenizer.eos_token_id, model_dir, t_start)
    # The model as the generate stage loads it, with the mode's tuning (HF's RMSNorm: fused_rms_norm=false).
    model = load_policy(model_dir, args.dtype, device, fused_norms=tuning.fused_rms_norm,
                        fused_layers=tuning.fused_layers).eval()
    steps = watch_steps(args.bandwidth) if args.step_times else None
    calls, pairs = [], []
    for i in range(args.repeats + 1):  # the first call is the one a stage makes
        torch.manual_seed(i)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if args.profile and i == 0:
            from tests.benchmarks.profiling import profiled

            rows, stats = profiled(lambda: sample_rows(model, tokenizer, items, g, device, tuning=tuning), device)
        else:
            rows, stats = sample_rows(model, tokenizer, items, g, device, tuning=tuning)
        if device.type == "cuda":
            torch.cuda.synchronize()
        s = time.perf_counter() - t0
        lengths = [len(r["completion_ids"]) for r in rows]
        positions = stats.get("decoded_positions") or hf_positions(lengths, g)
        calls.append({"s": s, "new_tokens": sum(lengths), "positions": positions, "stats": stats,
                      "sample_s": stats.get("sample_s"), "logprob_pass_s": stats.get("logprob_pass_s")})
        if i == 0:
            first_done = time.perf_counter() - t_start
            pairs = [(len(r["prompt_ids"]), len(r["completion_ids"])) for r in rows]
            if steps is not None:
                print(steps.table(), file=sys.stderr, flush=True)
                steps.records.clear()
    peak = torch.cuda.max_memory_reserved() / 2**30 if device.type == "cuda" else 0.0
    return {"first_call_done_s": first_done, "calls": calls, "pairs": pairs, "peak_gib": peak}


def run_vllm(args, g, items: list[dict], eos_token_id: int, model_dir: Path, t_start: float) -> dict:
    """Mode `vllm[:persistent=true;...]`: the engine generate.backend=vllm starts (stages/rl/vllm_sampler.py),
    on the same prompts. Per generate, a stage pays the engine's start and its first call; a persistent
    engine pays, each iteration, a sleep and a wake-up with the new weights loaded in place (here the
    same export again) before the call: with persistent=true the second call comes after one, and any
    later calls after that call (whether a slower call after a wake-up is the wake-up's alone). The
    modes of one run share vLLM's cache (its compiled graphs), as a run's engines do."""
    import torch

    from stages.rl.vllm_sampler import VllmSampler

    sampler = VllmSampler(model_dir, model_dir, args.dtype, g, seed=0,
                          cache_dir=model_dir.parent / "vllm-cache", sleep_mode=g.persistent)
    startup = sampler.figures()
    print(f"engine start-up: {json.dumps(startup)}", file=sys.stderr, flush=True)
    prompt_ids = [it["prompt_ids"] for it in items]
    calls, pairs = [], []
    for i in range(args.repeats + 1):
        cycle = {}
        if i == 1 and g.persistent:
            cycle = {"sleep_s": sampler.sleep(), **sampler.wake_up(model_dir)}
        t0 = time.perf_counter()  # the engine's generate returns its completions, nothing left queued
        completions = sampler.sample(prompt_ids, g, eos_token_id, seed=i)
        s = time.perf_counter() - t0
        lengths = [len(c) for c in completions]
        calls.append({"s": s, "new_tokens": sum(lengths), "positions": sum(lengths), "sample_s": s,
                      "logprob_pass_s": None, "stats": None, "engine": startup if i == 0 else cycle})
        if i == 0:
            first_done = time.perf_counter() - t_start
            pairs = [(len(prompt_ids[k // g.attempts]), n) for k, n in enumerate(lengths)]
    # The engine takes its share of the card up front (the stand-in for vLLM, on CPU: none).
    free, total = torch.cuda.mem_get_info() if torch.cuda.is_available() else (0, 0)
    peak = (total - free) / 2**30
    return {"first_call_done_s": first_done, "calls": calls, "pairs": pairs, "peak_gib": peak}


class StepWatch:
    """Each decode step's rows, attended prefix and wall time, taken from the compact sampler's own
    forward calls: the interval from one step's forward to the next is that step's wall (the loop's
    per-step sync sits between them), its bound the weights plus the K/V it reads."""

    def __init__(self):
        self.records: list[tuple[float, int, float, int]] = []  # (start, rows, bound s, call)

    def table(self) -> str:
        from collections import defaultdict

        # A step whose forward captured a graph is timed with its capture (rows -1); the last step of a
        # call has no next forward in the same call and is left out.
        rows = defaultdict(lambda: [0, 0.0, 0.0])
        for (t, b, bnd, call), (t_next, *_, call_next) in zip(self.records, self.records[1:]):
            if call_next != call:
                continue
            r = rows[b]
            r[0] += 1
            r[1] += t_next - t
            r[2] += bnd
        lines = [f"STEPS {'rows':>6} {'steps':>6} {'wall s':>8} {'ms/step':>8} {'bound ms':>8} {'share':>6}"]
        for b in sorted(rows, reverse=True):
            n, wall, bnd = rows[b]
            lines.append(f"STEPS {b:>6} {n:>6} {wall:>8.2f} {wall / n * 1e3:>8.2f} {bnd / n * 1e3:>8.3f} "
                         f"{bnd / wall:>6.1%}")
        return "\n".join(lines)


def watch_steps(bandwidth: float) -> StepWatch:
    """Wrap the compact sampler's decode forward (from outside it) to record every step."""
    from stages.rl import decoding

    watch = StepWatch()
    forward = decoding.CompactDecoder._forward

    def timed(self, b, attend):
        bnd = (self.weight_bytes + b * attend * self.kv_per_position) / bandwidth
        watch.records.append((time.perf_counter(), b, bnd, self.stats.calls))
        before = self.stats.graphs
        forward(self, b, attend)
        if self.stats.graphs != before:  # this step captured a graph: its wall is not a step's
            watch.records[-1] = (watch.records[-1][0], -1, 0.0, self.stats.calls)

    decoding.CompactDecoder._forward = timed
    return watch


def roofline_line(rf: dict, stats: dict, sample_s: float | None) -> str:
    """The roofline per phase against the sampler's own times (the compact sampler's stats)."""
    ph = rf["phases"]
    measured = {"prefill": stats.get("prefill_s"), "full": stats.get("full_s"),
                "tail": (stats["decode_s"] - stats["full_s"]) if "decode_s" in stats else None}
    parts = []
    for name in ("prefill", "full", "tail"):
        m, bnd = measured[name], ph[name]["bound_s"]
        share = f", {bnd / m:.0%} of it" if m else ""
        bound_by = "compute" if ph[name]["compute_bound_steps"] * 2 > ph[name]["steps"] else "memory"
        parts.append(f"{name} {bnd:.3g}s ({bound_by}; sampler {'-' if m is None else f'{m:.3g}s'}{share})")
    whole = (f"; all {rf['bound_s']:.3g}s, {rf['bound_s'] / sample_s:.1%} of sampling; with each step's "
             f"projections and attention one after the other {rf['serial_s']:.3g}s, "
             f"{rf['serial_s'] / sample_s:.1%}") if sample_s else ""
    return "roofline: " + ", ".join(parts) + whole


def fmt_s(x) -> str:
    return "-" if x is None else f"{x:.1f}s"


def hf_positions(lengths: list[int], g) -> int:
    """HF generate runs every sequence of a call until the call's longest one stops."""
    per_call = max(1, (g.batch_size or 64) // g.attempts) * g.attempts
    return sum(len(lengths[i:i + per_call]) * max(lengths[i:i + per_call]) for i in range(0, len(lengths), per_call))


if __name__ == "__main__":
    sys.exit(main())
