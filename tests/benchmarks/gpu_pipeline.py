"""Benchmark: the whole pipeline on GPUs (configs/gpu_small.yaml: the ~0.48B small-llama preset, bf16).

Runs `syncrl run` for N iterations into a fresh run dir (or reports an existing one with --report-only),
then prints, from the completion markers:

- wall time of every stage in every iteration (the stage marker's duration_s) and the mean;
- generate: model load time, new tokens/s (tokens up to and including end-of-sequence) in total and
  per GPU, and decoded positions/s (every sequence of a generate call runs until the call's longest
  one stops, so this counts the padding steps of sequences that had already finished);
- train: start-up (process group, model load, deepspeed.initialize, checkpoint resume), update
  time, tokens/s, DeepSpeed checkpoint time, and the model FLOPs utilisation
      MFU = 6 * N * tokens / (train_s * n_gpus * peak)
  with N the non-embedding parameters of models/base (from the safetensors header), tokens the
  completion tokens the loss was taken over (train marker) and peak = 989e12 FLOP/s (H200/H100 SXM
  dense bf16, datasheet). A second figure counts every position the GPUs ran (prompt, completion and
  right padding of each micro-batch);
- save: consolidation of the ZeRO checkpoint, HF export time, exported bytes and GB/s;
- process exit: from a stage's last rank marker to the coordinator seeing its processes gone, and
  the handoff: what the coordinator waited for before letting the stages started early after it go
  (the previous train's checkpoint written after its marker, processes still exiting);
- that every exported model loads with AutoModelForCausalLM.from_pretrained, and that training
  changed the weights.

    python tests/benchmarks/gpu_pipeline.py [--iterations 3] [--run-dir DIR] [--json OUT.json] [key=value ...]
    python tests/benchmarks/gpu_pipeline.py --report-only --run-dir DIR
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from stages.runtime import pipeline, safetensors_header  # noqa: E402 (needs ROOT on the path)
from stages.runtime.paths import STAGES  # noqa: E402
from tests.benchmarks.decode_bound import PEAK_FLOPS, hbm_bandwidth, model_shape, roofline  # noqa: E402
# The vLLM engine's figures in the generate marker, as the report names them.
ENGINE_FIGURES = {"engine_start_s": "start-up, in all", "weights_s": "weights loaded", "compile_s": "torch.compile",
                  "graph_capture_s": "CUDA graphs", "init_engine_s": "profile+KV+warmup",
                  "wake_weights_s": "wake: weights", "reload_s": "load new weights", "wake_cache_s": "wake: KV cache",
                  "engine_sample_s": "sampling, engine", "sleep_s": "sleep"}


UPDATE_HOST = {"batches_s": "batches", "forward_backward_s": "forward+backward", "optimizer_step_s": "optimizer step",
               "step_records_s": "step records"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--config", default="configs/gpu_small.yaml")
    parser.add_argument("--run-dir", default=None, help="default: a fresh temporary directory")
    parser.add_argument("--launcher", default="local", choices=("auto", "local", "srun"))
    parser.add_argument("--report-only", action="store_true", help="do not run; report --run-dir as it is")
    parser.add_argument("--peak-flops", type=float, default=PEAK_FLOPS, help="per GPU, for MFU")
    parser.add_argument("--bandwidth", type=float, default=None,
                        help="HBM bytes/s per GPU, for the roofline (default: the card's, by its name)")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    parser.add_argument("--no-load-check", action="store_true", help="skip from_pretrained of the exports")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.report_only and not args.run_dir:
        parser.error("--report-only needs --run-dir")
    run_dir = Path(args.run_dir) if args.run_dir else Path(tempfile.mkdtemp(prefix="syncrl-gpu-")) / "run"
    wall = None
    if not args.report_only:
        cmd = [sys.executable, "-m", "jobs.cli", "run", args.config, f"run_dir={run_dir}",
               f"iterations={args.iterations}", *args.overrides, "--launcher", args.launcher]
        print("$", " ".join(cmd), flush=True)
        t0 = time.time()
        proc = subprocess.run(cmd, cwd=ROOT)
        wall = time.time() - t0
        if proc.returncode != 0:
            print(f"run failed with exit code {proc.returncode}; see {run_dir}/logs", file=sys.stderr)
            return proc.returncode
    figures = report(run_dir.resolve(), args.iterations, wall, args.peak_flops, hbm_bandwidth(given=args.bandwidth))
    if not args.no_load_check:
        figures["load_check"] = load_check(run_dir.resolve(), args.iterations, Path(figures["base_model"]))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")
    return 0


# --- reading the run directory ------------------------------------------------------------------


def read_json(path: Path):
    return json.loads(path.read_text())


def rank_markers(run_dir: Path, it: int, stage: str) -> list[dict]:
    d = run_dir / f"iter_{it:05d}" / "markers"
    return [read_json(p) for p in sorted(d.glob(f"{stage}.rank_*.done"))]


def safetensors_params(model_dir: Path) -> dict[str, int]:
    """Tensor name -> element count, from the safetensors headers alone (no torch, no loading)."""
    counts = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        for name, (_, shape) in (safetensors_header.layout(f) or {}).items():
            counts[name] = math.prod(shape)
    return counts


def base_model(run_dir: Path, cfg: dict) -> Path:
    """The run's base model: model.path where the run was given one, else the preset it created."""
    return Path(cfg["model"]["path"]) if cfg["model"].get("path") else run_dir / "models" / "base"


def non_embedding_params(model_dir: Path) -> tuple[int, int]:
    counts = safetensors_params(model_dir)
    total = sum(counts.values())
    embed = sum(v for k, v in counts.items() if "embed_tokens" in k or "lm_head" in k)
    return total - embed, total


def generate_positions(run_dir: Path, it: int, cfg: dict, markers: list[dict]) -> tuple[int, list]:
    """Positions the decoder ran (the compact sampler counts its own; HF generate runs each call's
    sequences until its longest stops), and each rank's (prompt, completion) lengths."""
    g = cfg["generate"]
    per_call_rows = max(1, (g["batch_size"] or 64) // g["attempts"]) * g["attempts"]
    total, pairs = 0, []
    for marker, shard in zip(markers, sorted((run_dir / f"iter_{it:05d}" / "generate").glob("rank_*.jsonl"))):
        rows = [json.loads(line) for line in shard.open()]
        pairs.append([(len(r["prompt_ids"]), len(r["completion_ids"])) for r in rows])
        counted = marker.get("sampling", {}).get("decoded_positions")
        if counted is not None:
            total += counted
            continue
        lengths = [c for _, c in pairs[-1]]
        for i in range(0, len(lengths), per_call_rows):
            call = lengths[i:i + per_call_rows]
            total += len(call) * max(call)
    return total, pairs


def roofline_shares(bounds: list[dict], markers: list[dict]) -> dict:
    """The roofline's time over the sampler's, mean over ranks: in all and per phase (where the
    marker has the compact sampler's own times)."""
    shares = {}
    for phase in ("all", "prefill", "full", "tail"):
        values = []
        for b, m in zip(bounds, markers):
            s = m.get("sampling", {})
            took = {"all": s.get("sample_s", m.get("generate_s")), "prefill": s.get("prefill_s"),
                    "full": s.get("full_s"),
                    "tail": s["decode_s"] - s["full_s"] if "decode_s" in s and "full_s" in s else None}[phase]
            bound_s = b["bound_s"] if phase == "all" else b["phases"][phase]["bound_s"]
            if took:
                values.append(bound_s / took)
        shares[phase] = fmean(values) if values else None
    return shares


def train_positions(run_dir: Path, it: int, cfg: dict, world: int) -> int | None:
    """Positions the training forward/backward ran, right padding included (train's own batching;
    with tuning.remove_padding, the rows' own lengths)."""
    try:
        from stages.rl.packing import row_width
        from stages.rl.steps import optimizer_steps
    except ImportError:
        return None
    rows = [json.loads(line) for line in (run_dir / f"iter_{it:05d}" / "gather" / "train.jsonl").open()]
    t = SimpleNamespace(**cfg["train"])
    known = {**cfg["train"], **cfg.get("tuning", {})}  # a run dir of an older syncrl kept these under train
    tuning = SimpleNamespace(max_tokens_per_micro_batch=known.get("max_tokens_per_micro_batch", 0),
                             balance_tokens=known.get("balance_tokens", False),
                             remove_padding=known.get("remove_padding", False))
    total = 0
    for rank in range(world):
        ctx = SimpleNamespace(cfg=SimpleNamespace(train=t, tuning=tuning, seed=cfg["seed"]), iteration=it, rank=rank,
                              world_size=world)
        for step in optimizer_steps(rows, ctx):
            for micro in step.micro_batches:
                real = [r for r in micro if r is not None]
                lengths = [row_width(r) for r in real]
                if lengths:
                    total += sum(lengths) if tuning.remove_padding else len(lengths) * max(lengths)
    return total


# --- the report ------------------------------------------------------------------------------------


def fmean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else float("nan")


def critical(seconds: dict) -> float:
    """Sum of the stages' seconds, leaving out the background stages (they overlap the others)."""
    return sum(v for s, v in seconds.items() if s not in pipeline.BACKGROUND_STAGES)


def report(run_dir: Path, iterations: int, wall: float | None, peak: float, bandwidth: tuple[float, str]) -> dict:
    import yaml

    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    base = base_model(run_dir, cfg)
    n_params, n_total = non_embedding_params(base)
    shape = model_shape(base)
    per_it = []
    for it in range(iterations):
        m = {s: read_json(run_dir / f"iter_{it:05d}" / "markers" / f"{s}.done") for s in STAGES}
        gen = rank_markers(run_dir, it, "generate")
        train = rank_markers(run_dir, it, "train")
        world = len(train)
        gen_tokens = sum(r["new_tokens"] for r in gen)
        gen_s = max(r["generate_s"] for r in gen)
        gen_pos, pairs = generate_positions(run_dir, it, cfg, gen)
        bounds = [roofline(p, cfg["generate"]["attempts"], shape, bandwidth=bandwidth[0]) for p in pairs]
        shared = [roofline(p, cfg["generate"]["attempts"], shape, bandwidth=bandwidth[0], shared_prompts=True)
                  for p in pairs]
        tr = train[0]
        train_s = max(r["train_s"] for r in train)
        tokens = tr["tokens"]  # all ranks (all-reduced)
        positions = train_positions(run_dir, it, cfg, world)
        flops = 6 * n_params * tokens
        stats = read_json(run_dir / f"iter_{it:05d}" / "gather" / "stats.json")
        per_it.append({
            "iteration": it,
            "wall_s": {s: m[s]["duration_s"] for s in STAGES},
            # The iteration as the clock saw it: generate's turn to save's marker (stages started early
            # overlap their imports with earlier stages; their duration_s counts from their turn).
            "iteration_s": m["save"]["end"] - m["generate"]["start"],
            # From the last rank's marker to the coordinator seeing every process gone: the next
            # stage's turn waits for it.
            "handoff_s": {s: m[s].get("handoff_s", 0.0) for s in STAGES},
            "exit_s": {s: max(0.0, m[s]["end"] - max(r["end"] for r in rank_markers(run_dir, it, s))
                              - m[s].get("handoff_s", 0.0)) for s in STAGES},
            "generate": {
                "ranks": len(gen), "rows": sum(r["rows"] for r in gen), "new_tokens": gen_tokens,
                "load_s": max(r["load_s"] for r in gen), "generate_s": gen_s,
                "tokens_per_s": gen_tokens / gen_s, "tokens_per_s_per_gpu": fmean(r["tokens_per_s"] for r in gen),
                "import_s": max(r.get("import_s", 0.0) for r in gen),
                "positions": gen_pos, "positions_per_s_per_gpu": gen_pos / gen_s / len(gen),
                # The roofline of sampling the same completions (decode_bound.py), per GPU, and each
                # rank's sampling time as a share of it, per phase (the compact sampler's own times).
                "bound_tokens_per_s_per_gpu": fmean(b["new_tokens_per_s"] for b in bounds),
                "of_roofline": roofline_shares(bounds, gen),
                # The same with each prompt's K/V read once for its attempts (as the decode kernel may).
                "of_roofline_shared_prompts": roofline_shares(shared, gen)["all"],
                "sample_s": max(r.get("sampling", {}).get("sample_s", r["generate_s"]) for r in gen),
                "logprob_pass_s": max(r.get("sampling", {}).get("logprob_pass_s", 0.0) for r in gen),
                "graph_capture_s": max(r.get("sampling", {}).get("graph_capture_s", 0.0) for r in gen),
                "decode_steps": max(r.get("sampling", {}).get("steps", 0) for r in gen),
                "spilled": sum(r.get("sampling", {}).get("spilled", 0) for r in gen),
                # generate.backend=vllm: the engine's figures (vllm_sampler.py, engine.py), slowest rank.
                "engine": {k: max(r["sampling"]["engine"].get(k, 0.0) for r in gen)
                           for k in ENGINE_FIGURES if any(k in r.get("sampling", {}).get("engine", {}) for r in gen)},
            },
            "train": {
                "ranks": world, "steps": tr["steps"], "tokens": tokens, "positions": positions,
                "startup_s": max(r["startup_s"] for r in train), "train_s": train_s,
                "first_micro_batch_s": max(r.get("first_micro_batch_s", 0.0) for r in train),
                "cuda_graphs_s": max(r.get("cuda_graphs_s", 0.0) for r in train),
                # rank 0's: where its host time in the update went (the GPU runs behind it)
                **{f"host_{k}": tr.get("update_host_s", {}).get(k) for k in UPDATE_HOST},
                "checkpoint_s": max(r["checkpoint_s"] for r in train),
                "tokens_per_s": tokens / train_s,
                "mfu": flops / (train_s * world * peak),
                "mfu_positions": (6 * n_params * positions / (train_s * world * peak)) if positions else None,
                "mfu_model": tr.get("mfu"), "import_s": max(r.get("import_s", 0.0) for r in train),
                # Started early: how long its preload ran past its turn (on the critical path).
                "preload_late_s": max(r.get("started_early_late_s", 0.0) for r in train),
                # tuning.deferred_checkpoint: the copy to host memory before the marker (snapshot_s),
                # DeepSpeed's save_checkpoint around it (engine_save_s), the policy file for save (policy_s),
                # files over the snapshot's host-memory budget written before the marker (written_now_s);
                # the write after the marker.
                **{k: max(r.get("deferred_checkpoint", {}).get(k, 0.0) for r in train)
                   for k in ("snapshot_s", "engine_save_s", "policy_s", "written_now_s")},
                "write_after_s": deferred_write_s(run_dir, it),
            },
            "startup_s": {
                # Process start to first useful work: sampling (generate), the first update (train),
                # reading the checkpoint (save).
                "generate": max(visible_import_s(r) + r["load_s"] for r in gen),
                "train": max(visible_import_s(r) + r["startup_s"] for r in train),
                "save": visible_import_s(m["save"]),
            },
            # The start-up phases (stages/runtime/logs.py Phases), in the order train ran them.
            "train_phases": {k: max(r.get("startup_phases", {}).get(k, 0.0) for r in train)
                             for k in dict.fromkeys(k for r in train for k in r.get("startup_phases", {}))},
            # Started early: the parts of the train process's life before its turn, in the order they ran.
            "train_preload": {k: max(r.get("preload_phases", {}).get(k, 0.0) for r in train)
                              for k in dict.fromkeys(k for r in train for k in r.get("preload_phases", {}))},
            "compute_s": gen_s + train_s,
            "save": {k: m["save"][k] for k in ("consolidate_s", "export_s", "bytes")}
                    | {k: m["save"].get(k) for k in ("verify_s", "export")},
            "reward_mean": stats.get("reward_mean"),
            "critical_path": critical_path(run_dir, it, m),
        })

    print(f"\nrun dir: {run_dir}")
    print(f"model: {base}, {n_params / 1e6:.1f}M non-embedding parameters ({n_total / 1e6:.1f}M in all); "
          f"{per_it[0]['train']['ranks']} GPU(s)")
    print("\nwall time per stage (s; the stage marker's duration_s, process start-up included)")
    print(f"{'iter':>4}  " + "  ".join(f"{s:>8}" for s in STAGES) + f"  {'total':>8}")
    for r in per_it:
        w = r["wall_s"]
        print(f"{r['iteration']:>4}  " + "  ".join(f"{w[s]:8.1f}" for s in STAGES) + f"  {critical(w):8.1f}")
    means = {s: fmean(r["wall_s"][s] for r in per_it) for s in STAGES}
    print(f"{'mean':>4}  " + "  ".join(f"{means[s]:8.1f}" for s in STAGES) + f"  {critical(means):8.1f}")
    if pipeline.BACKGROUND_STAGES:
        print(f"      (total: the stages on the critical path; {', '.join(pipeline.BACKGROUND_STAGES)} ran in the "
              "background, from its start to its join)")

    def col(section, key, fmt):
        vals = [r[section][key] for r in per_it]
        mean_fmt = fmt.replace("d}", ".0f}")
        return "  ".join(fmt.format(v) if v is not None else f"{'-':>9}" for v in vals) + \
            "   | mean " + (mean_fmt.format(fmean(vals)) if any(v is not None for v in vals) else "-")

    print("\ngenerate (per iteration, then mean)")
    print("  sequences            ", col("generate", "rows", "{:>9d}"))
    print("  new tokens           ", col("generate", "new_tokens", "{:>9d}"))
    print("  imports s            ", col("generate", "import_s", "{:>9.1f}"))
    print("  model load s         ", col("generate", "load_s", "{:>9.1f}"))
    print("  sampling s           ", col("generate", "generate_s", "{:>9.1f}"))
    print("  new tok/s, total     ", col("generate", "tokens_per_s", "{:>9.0f}"))
    print("  new tok/s, per GPU   ", col("generate", "tokens_per_s_per_gpu", "{:>9.0f}"))
    print("  decoded pos/s per GPU", col("generate", "positions_per_s_per_gpu", "{:>9.0f}"))
    print("  bound new tok/s, GPU ", col("generate", "bound_tokens_per_s_per_gpu", "{:>9.0f}"))
    print("  of which decoding s  ", col("generate", "sample_s", "{:>9.1f}"))
    print("    graph capture s    ", col("generate", "graph_capture_s", "{:>9.1f}"))
    print("    decode steps       ", col("generate", "decode_steps", "{:>9d}"))
    print("    spilled sequences  ", col("generate", "spilled", "{:>9d}"))
    print("  log-prob pass s      ", col("generate", "logprob_pass_s", "{:>9.1f}"))
    engine_keys = [k for k in ENGINE_FIGURES if any(k in r["generate"]["engine"] for r in per_it)]
    if engine_keys:
        print("  vLLM engine (s; - where an iteration's engine did not do it):")
        for k in engine_keys:
            print(f"    {ENGINE_FIGURES[k]:<19}", "  ".join(f"{r['generate']['engine'][k]:>9.2f}" if k in
                                                         r["generate"]["engine"] else f"{'-':>9}" for r in per_it))
    for phase in ("all", "prefill", "full", "tail"):
        print(f"    of roofline, {phase:<7}", "  ".join(
            f"{r['generate']['of_roofline'][phase]:>9.1%}" if r["generate"]["of_roofline"].get(phase) is not None
            else f"{'-':>9}" for r in per_it))
    print("    of roofline, shared ", "  ".join(
        f"{r['generate']['of_roofline_shared_prompts']:>9.1%}" if r["generate"]["of_roofline_shared_prompts"] is not None
        else f"{'-':>9}" for r in per_it), " (all, each prompt's K/V read once for its attempts)")
    print(f"  (roofline: per phase the larger of its FLOPs at {PEAK_FLOPS / 1e12:.0f} TFLOP/s and its bytes, the "
          f"weights once per pass + the K/V each token attends to, at {bandwidth[0] / 1e12:.2f} TB/s ({bandwidth[1]}); full: every "
          "sequence running, tail: after the first stopped; tests/benchmarks/decode_bound.py)")
    print("\ntrain")
    print("  optimizer steps      ", col("train", "steps", "{:>9d}"))
    print("  tokens (loss)        ", col("train", "tokens", "{:>9d}"))
    print("  positions run        ", col("train", "positions", "{:>9d}"))
    print("  imports s            ", col("train", "import_s", "{:>9.1f}"))
    print("  preload past turn s  ", col("train", "preload_late_s", "{:>9.1f}"),
          "  (started early: its imports, host memory and rehearsal still running at its turn)")
    print("  engine start-up s    ", col("train", "startup_s", "{:>9.1f}"))
    print("  update s             ", col("train", "train_s", "{:>9.1f}"))
    print("  first micro-batch s  ", col("train", "first_micro_batch_s", "{:>9.1f}"),
          "  (of the update; train.compile: the compile, or reading its cache)")
    if any(r["train"]["cuda_graphs_s"] for r in per_it):
        print("  CUDA graphs s        ", col("train", "cuda_graphs_s", "{:>9.1f}"),
              "  (of the update: tuning.train_graphs capturing the layers)")
    if all(r["train"]["host_forward_backward_s"] is not None for r in per_it):
        print("  the update's host time, rank 0 (s; the GPU runs behind the host: where the host waits for it, "
              "that part carries the GPU's time):")
        for k, label in UPDATE_HOST.items():
            print(f"    {label:<19}", col("train", f"host_{k}", "{:>9.1f}"))
    print("  checkpoint s         ", col("train", "checkpoint_s", "{:>9.1f}"))
    if any(r["train"]["snapshot_s"] for r in per_it):
        print("  DeepSpeed's save s   ", col("train", "engine_save_s", "{:>9.2f}"), "  (of the checkpoint)")
        print("   of which to host s  ", col("train", "snapshot_s", "{:>9.2f}"))
        print("  policy file s        ", col("train", "policy_s", "{:>9.2f}"),
              "  (of the checkpoint: the weights for save to link)")
        print("  written after it s   ", col("train", "write_after_s", "{:>9.1f}"), "  (beside save, generate, score, gather)")
    if any(r["train"]["written_now_s"] for r in per_it):
        print("  of which written s   ", col("train", "written_now_s", "{:>9.1f}"),
              "  (files over the snapshot's host-memory budget, written before the marker)")
    print("  tokens/s (all GPUs)  ", col("train", "tokens_per_s", "{:>9.0f}"))
    print("  MFU, loss tokens     ", col("train", "mfu", "{:>9.2%}"))
    print("  MFU, all positions   ", col("train", "mfu_positions", "{:>9.2%}"))
    print("  MFU, model FLOPs     ", col("train", "mfu_model", "{:>9.2%}"))
    print("  (model FLOPs: the train marker's, stages/rl/flops.py: forward 2*N*s + 4*L*d*s^2 per sequence, x3 "
          "for training, + a reference forward with KL)")
    print(f"  MFU = 6 * N * tokens / (train_s * n_gpus * peak), N = {n_params:,} non-embedding parameters, "
          f"peak = {peak:.3g} FLOP/s per GPU; attention-score FLOPs not counted")
    ckpt_bytes = checkpoint_bytes(run_dir)
    if ckpt_bytes:
        print("  checkpoint GB/s       ", "  ".join(f"{ckpt_bytes / 1e9 / r['train']['checkpoint_s']:>9.2f}"
                                                   for r in per_it), f"  ({ckpt_bytes / 1e9:.2f} GB per checkpoint)")
    phases = list(dict.fromkeys(k for r in per_it for k in r["train_phases"]))  # as the markers list them
    if phases:
        print("  train start-up phases, from its turn (s, slowest rank):")
        for k in phases:
            print(f"    {k:<22}", "  ".join(f"{r['train_phases'].get(k, 0.0):>9.1f}" for r in per_it))
    preload = list(dict.fromkeys(k for r in per_it for k in r["train_preload"]))  # as the markers list them
    if preload:
        print("  train preload, started early, before its turn (s, slowest rank; the host memory fills beside it):")
        for k in preload:
            print(f"    {k:<22}", "  ".join(f"{r['train_preload'][k]:>9.1f}" if k in r["train_preload"]
                                          else f"{'-':>9}" for r in per_it))
    print("\nsave")
    print("  consolidate s        ", col("save", "consolidate_s", "{:>9.1f}"))
    print("  export s             ", col("save", "export_s", "{:>9.1f}"))
    print("  verify s             ", col("save", "verify_s", "{:>9.1f}"))
    print("  exported GB          ", "  ".join(f"{r['save']['bytes'] / 1e9:>9.2f}" for r in per_it))
    print("  export (written, or train's policy file linked)",
          "  ".join(f"{r['save']['export'] or '-':>9}" for r in per_it))
    print("\nreward mean          ", "  ".join(f"{r['reward_mean']:>9.3f}" for r in per_it))
    print("\nstart-up per stage: process start (started early: its turn) to first useful work (s)")
    for stage in ("generate", "train", "save"):
        print(f"  {stage:<21}", "  ".join(f"{r['startup_s'][stage]:>9.1f}" for r in per_it))
    print("\nprocess exit: the last rank's marker to the stage's, less the handoff (s)")
    for stage in STAGES:
        print(f"  {stage:<21}", "  ".join(f"{r['exit_s'][stage]:>9.2f}" for r in per_it))
    print("handoff: the stage's marker held for what the stages started early after it wait for (s)")
    for stage in STAGES:
        print(f"  {stage:<21}", "  ".join(f"{r['handoff_s'][stage]:>9.2f}" for r in per_it))
    print("\niteration wall s (generate's turn to save's marker)",
          "  ".join(f"{r['iteration_s']:>9.1f}" for r in per_it), f"  | mean {fmean(r['iteration_s'] for r in per_it):.1f}")
    print_critical_path(per_it)
    print("\nnon-compute share of the iteration: 1 - (sampling + update) / iteration wall")
    shares = [1 - r["compute_s"] / r["iteration_s"] for r in per_it]
    print("  share                ", "  ".join(f"{x:>9.1%}" for x in shares), f"  | mean {fmean(shares):.1%}")
    stage_total = sum(sum(r["wall_s"].values()) for r in per_it)
    if wall is not None:
        print(f"\nwhole run {wall:.1f}s: stages {stage_total:.1f}s, coordinator and base-model creation "
              f"{wall - stage_total:.1f}s")
    return {"run_dir": str(run_dir), "base_model": str(base), "non_embedding_params": n_params,
            "non_compute_share": shares, "checkpoint_bytes": ckpt_bytes, "params": n_total, "peak_flops": peak,
            "hbm_bytes_per_s": bandwidth[0], "wall_s": wall, "iterations": per_it, "stage_wall_mean_s": means}


# The parts of a stage's time on the critical path, in the order they happen.
PATH_PARTS = ("start", "process group", "model load", "resume", "warm-up", "work", "checkpoint", "exit", "handoff",
              "other")
CRITICAL_STAGES = ("generate", "score", "gather", "train", "save")


def critical_path(run_dir: Path, it: int, m: dict) -> dict:
    """Where each second of the iteration went, stage by stage: from the stage's turn (the previous
    stage's marker; generate's own start) to its marker, the slowest rank's parts. start: its
    process's launch and imports, or for one started early, how late it saw its turn (its preload, or
    train's set-up before the turn, running past it); exit: from the last rank's marker to the
    stage's, less handoff: what the coordinator waited for there before letting the stages started
    early after it go (the previous train's checkpoint written after its marker, processes still
    exiting); other: the rest of the span (reading inputs, writing outputs; below zero where a process
    started early saw its turn before the coordinator did). The stages' spans add up to the iteration
    (generate's turn to save's marker)."""
    out = {}
    turn = m["generate"]["start"]
    for stage in CRITICAL_STAGES:
        ranks = rank_markers(run_dir, it, stage)
        last = max(ranks, key=lambda r: r["end"])
        span = m[stage]["end"] - turn
        parts = dict.fromkeys(PATH_PARTS, 0.0)
        parts["start"] = max(0.0, min(span, last["start"] - turn))
        parts["handoff"] = m[stage].get("handoff_s", 0.0)
        parts["exit"] = max(0.0, m[stage]["end"] - last["end"] - parts["handoff"])
        if stage == "generate":
            sampling = last.get("sampling", {})
            parts["model load"] = last.get("load_s", 0.0)
            parts["warm-up"] = sampling.get("graph_capture_s", 0.0)
            parts["work"] = last.get("generate_s", 0.0) - parts["warm-up"]
        elif stage == "train":
            phases = last.get("startup_phases", {})
            parts["process group"] = phases.get("process_group", 0.0)
            parts["model load"] = sum(phases.get(k, 0.0) for k in ("import_deepspeed", "load_models",
                                                                   "deepspeed_initialize"))
            parts["resume"] = phases.get("resume_checkpoint", 0.0)
            parts["warm-up"] = last.get("cuda_graphs_s", 0.0)
            parts["work"] = last.get("train_s", 0.0) - parts["warm-up"]
            parts["checkpoint"] = last.get("checkpoint_s", 0.0)
        else:
            parts["work"] = last["end"] - last["start"]
        parts["other"] = span - sum(parts.values())
        out[stage] = {"span_s": span, **parts}
        turn = m[stage]["end"]
    return out


def print_critical_path(per_it: list[dict]) -> None:
    print("\ncritical path, s (each stage from its turn to its marker; the stages add up to the iteration):")
    print(f"  {'stage':<9} {'part':<14}", "  ".join(f"{'it ' + str(r['iteration']):>9}" for r in per_it))
    for stage in CRITICAL_STAGES:
        print(f"  {stage:<9} {'span':<14}", "  ".join(f"{r['critical_path'][stage]['span_s']:>9.2f}" for r in per_it))
        for part in PATH_PARTS:
            if any(abs(r["critical_path"][stage][part]) >= 0.005 for r in per_it):
                print(f"  {'':<9} {part:<14}", "  ".join(f"{r['critical_path'][stage][part]:>9.2f}" for r in per_it))
    print(f"  {'all':<9} {'iteration':<14}", "  ".join(
        f"{sum(r['critical_path'][s]['span_s'] for s in CRITICAL_STAGES):>9.2f}" for r in per_it))


def visible_import_s(marker: dict) -> float:
    """Imports on the stage's critical path. A process started early imported while earlier stages
    ran: only the part of its preloading that ran past its turn counts."""
    if "started_early_waited_s" in marker:
        return marker.get("started_early_late_s", 0.0)
    return marker.get("import_s", 0.0)


def deferred_write_s(run_dir: Path, it: int) -> float:
    """Seconds train's rank 0 spent writing its checkpoint after its marker (its log says), 0 if it did not."""
    logs = sorted((run_dir / "logs" / f"iter_{it:05d}" / "train").glob("attempt_*/rank_00000.log"))
    found = re.findall(r"checkpoint written after the marker: ([0-9.]+)s of writes", logs[-1].read_text()) if logs else []
    return float(found[-1]) if found else 0.0


def checkpoint_bytes(run_dir: Path) -> int:
    """Size of the newest DeepSpeed checkpoint left (older ones are pruned; every one is the same size)."""
    tags = sorted(p for p in (run_dir / "checkpoints").glob("iter_*") if p.is_dir())
    return sum(f.stat().st_size for f in tags[-1].rglob("*") if f.is_file()) if tags else 0


def load_check(run_dir: Path, iterations: int, base: Path) -> dict:
    """Every export loads with from_pretrained; each differs from the one before it (training moved it).

    The first export also differs from models/base by bf16 rounding (training ran in bf16), so the
    step that shows training is export I against export I - 1.
    """
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    out = {}
    prev_name = "base"
    prev = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).state_dict()
    for it in range(iterations):
        path = run_dir / "models" / f"iter_{it:05d}"
        t0 = time.time()
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        load_s = time.time() - t0
        sd = model.state_dict()
        changed = sum(1 for k, v in sd.items() if k in prev and not torch.equal(v, prev[k]))
        max_diff = max(float((v - prev[k]).abs().max()) for k, v in sd.items() if k in prev)
        out[path.name] = {"load_s": load_s, "params": sum(p.numel() for p in model.parameters()),
                          "dtype": str(next(model.parameters()).dtype), "compared_with": prev_name,
                          "tensors_changed": changed, "tensors": len(sd), "max_abs_diff": max_diff}
        print(f"from_pretrained {path}: {load_s:.1f}s, {out[path.name]['params'] / 1e6:.1f}M parameters; "
              f"{changed}/{len(sd)} tensors differ from {prev_name} (max |diff| {max_diff:.2e})")
        prev, prev_name = sd, path.name
    return out


if __name__ == "__main__":
    sys.exit(main())
