"""Benchmark: the train stage's update step alone, at a fixed sequence length, across DeepSpeed setups.

Runs syncrl's own micro-step (stages.rl.batches.collate + stages.train.micro_step: forward, PPO-clip loss, backward,
then engine.step) on synthetic rollouts of exactly --seq tokens (128 prompt + the rest completion),
one optimizer step per micro-batch, for each variant given, in one process group. Prints per variant:
seconds per step, tokens/s over all GPUs, model FLOPs utilisation (formula printed, see
stages/rl/flops.py), the 6*N-only figure for comparison, and peak GPU memory.

A variant is colon-separated: zN (ZeRO stage N, with configs/ds_zero3_multinode.json for 3 and
configs/ds_zero2_gpu.json with its stage set to N below), mB (micro-batch per GPU), and optionally
gc (gradient checkpointing),
kl (frozen reference forward with kl_coef 0.05), compile (DeepSpeed's engine.compile), fused
(torch's fused RMSNorm instead of HF's forward, tuning.fused_rms_norm), foreach (torch's multi-tensor
AdamW instead of the fused one that configs/ds_zero2_gpu.json asks for with `"fused": true`),
packed (each micro-batch's rows as one sequence, tuning.remove_padding), serial (ZeRO's
overlap_comm off: fewer operations per parameter in the backward),
layers (each decoder layer compiled with Inductor, dynamic shapes: train.compile's way under ZeRO
0-2, stages/rl/modeling.compile_layers), nocheck (bf16.check_grad_overflow off: no per-parameter
inf/NaN pass in the optimizer step), graphs (each decoder layer's forward and backward replayed
as a CUDA graph, every micro-batch packed to the largest's shape: tuning.train_graphs; with packed),
nonorm (ZeRO's compute_grad_norm off, no clipping: what any gradient norm costs the optimizer step;
a bound, not a setting train offers) and flatnorm (the norm and clipping on the flat fp32 partition
instead of DeepSpeed's per-parameter norm: tuning.grad_norm=flat), kernels (the attention's q/k/v and
the MLP's gate/up each one matrix product, the rotary embedding and SiLU-times-up Triton kernels:
tuning.fused_layers) and onebucket (ZeRO's reduce_bucket_size at 5e8, above small-llama's parameters: one
bucket flush, and one device sync, per backward instead of one per 2e8 elements), and contiguous
or scattered (ZeRO's contiguous_gradients on or off; configs/ds_zero2_gpu.json has it off: on, each
gradient is copied into a bucket buffer as it comes, instead of flattened and copied back around
the reduction), and offload (the optimizer's state and step on the host, DeepSpeed's CPU
Adam: configs/ds_zero2_cpuadam.json for z2, configs/ds_zero3_offload.json for z3), and records
(each step's loss and metrics read on the host after its step, as train does:
stages/rl/step_records.py), and balance (the rows dealt into
micro-batches of near-equal tokens, tuning.balance_tokens: with --mixed), and rehearse (the
rehearsal of stages/rl/rehearsal.py run before the model is loaded: compare the first step's time in
a fresh process, one variant per process), and leaf (ZeRO-3's zero_optimization.leaf_module set to the
decoder layer's class: one parameter-gathering hook pair per layer instead of one per submodule),
and persist (ZeRO-3's stage3_param_persistence_threshold above every parameter's size: nothing is
partitioned, so no hook gathers; a bound for one rank, not a setting for a sharded run).
--mixed gives each row a completion of random length (as sampling does) instead of --seq tokens.
--split times each step's forward and backward apart from its optimizer step (a device sync
between the two), so what the step itself costs is printed. --host-profile prints rank 0's Python
functions by time over the timed steps (cProfile): where the host's dispatch goes when the GPU
waits for it.

    python -m torch.distributed.run --nproc-per-node 2 tests/benchmarks/train_mfu.py \\
        [--preset small-llama | --shape llama-8b] [--seq 1024] [--steps 10] [--variants z2:m8,z2:m16,z2:m32,z3:m16]

--preset loads a built-in model from --model-dir (creating it there first); --shape builds one of
tests/benchmarks/shapes.py from its config in place, random weights, partitioned as it is built
under ZeRO-3 (nothing on disk, no full copy on any rank).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

DS_CONFIGS = {2: "configs/ds_zero2_gpu.json", 3: "configs/ds_zero3_multinode.json"}
# The offload variants: the optimizer's state and step on the host (DeepSpeed's CPU Adam).
OFFLOAD_CONFIGS = {2: "configs/ds_zero2_cpuadam.json", 3: "configs/ds_zero3_offload.json"}


def parse_variant(text: str) -> dict:
    v = {"zero": 2, "micro": 8, "gc": False, "kl": False, "compile": False, "fused": False, "foreach": False,
         "packed": False, "serial": False, "layers": False, "nocheck": False, "graphs": False,
         "nonorm": False, "flatnorm": False, "kernels": False, "onebucket": False,
         "offload": False, "records": False, "balance": False, "rehearse": False, "leaf": False,
         "persist": False, "contiguous_gradients": None, "name": text}
    for part in text.split(":"):
        if part[0] == "z":
            v["zero"] = int(part[1:])
        elif part[0] == "m":
            v["micro"] = int(part[1:])
        elif part in ("gc", "kl", "compile", "fused", "foreach", "packed", "serial", "layers", "nocheck", "graphs",
                      "nonorm", "flatnorm", "kernels", "onebucket", "offload", "records", "balance", "rehearse",
                      "leaf", "persist"):
            v[part] = True
        elif part in ("scattered", "contiguous"):  # ZeRO's contiguous_gradients off / on (else the JSON's)
            v["contiguous_gradients"] = part == "contiguous"
        else:
            raise SystemExit(f"unknown variant part {part!r} in {text!r}")
    if v["graphs"] and not v["packed"]:
        raise SystemExit(f"{text}: graphs captures packed micro-batches; add :packed")
    return v


def synthetic_rows(n: int, seq: int, vocab: int, seed: int, micro: int = 1, vary: int = 0,
                   mixed: bool = False) -> list[dict]:
    """n rows of `seq` tokens; with vary, micro-batch i's rows are 8 * (i % vary) tokens shorter (each
    micro-batch a new width, as the train stage's are); mixed, each row's completion 1 to seq - 128
    tokens, uniformly."""
    rng = random.Random(seed)
    rows = []
    for k in range(n):
        prompt = [rng.randrange(4, vocab) for _ in range(128)]
        width = seq - (8 * ((k // micro) % vary) if vary else 0)
        if mixed:
            width = 128 + rng.randint(1, seq - 128)
        completion = [rng.randrange(4, vocab) for _ in range(width - 128)]
        rows.append({"prompt_ids": prompt, "completion_ids": completion,
                     "logprobs": [-rng.random() * 3 for _ in completion], "advantage": rng.choice([-1.0, 1.0])})
    return rows


def build_in_place(name: str, ds: dict, dtype: str):
    """A model of tests/benchmarks/shapes.py (or a built-in preset) from its config; under ZeRO-3
    transformers builds it inside deepspeed.zero.Init while `ds` is registered, so each rank holds
    only its partition."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    sys.path.insert(0, str(Path(__file__).parent))
    from shapes import HOST_BOUND, SHAPES

    from stages.rl.tiny_model import PRESETS, llama_config

    shapes = {**PRESETS, **SHAPES, **HOST_BOUND}  # the built-in presets too: the same path, small enough for CPU
    if name not in shapes:
        raise SystemExit(f"--shape {name!r}: choose one of {', '.join(shapes)}")
    # A ZeRO-3 variant's registration may outlive its model: a later ZeRO-2 build must not partition.
    unset_hf_deepspeed_config()
    keep = HfDeepSpeedConfig(ds) if ds.get("zero_optimization", {}).get("stage") == 3 else None
    model = AutoModelForCausalLM.from_config(llama_config(shapes[name]), dtype=getattr(torch, dtype))
    if keep is not None and not all(hasattr(p, "ds_id") for p in model.parameters()):
        raise SystemExit(f"--shape {name}: the model was not partitioned as it was built (zero.Init did not apply)")
    model._syncrl_ds_config = keep  # transformers holds it weakly: keep it as long as the model
    return model


def join_process_group():
    """The process group as train sets it up, from torchrun's variables or for one process (DeepSpeed
    then makes the group itself); returns (rank, world size, this rank's device)."""
    import deepspeed

    from stages.runtime import dist
    from stages.rl.modeling import device_for
    from stages.train import _skip_cpu_inference_op

    info = dist.dist_info()
    device = device_for(info.local_rank)
    dist.export_torch_env(info)
    backend = dist.pick_backend("auto")
    dist.init_process_group(info, backend, timeout_s=600)
    _skip_cpu_inference_op(deepspeed)
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
    return info.rank, info.world_size, device


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small-llama")
    parser.add_argument("--shape", default=None, help="a larger model of tests/benchmarks/shapes.py, built in place")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps per variant")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--vary", type=int, default=0,
                        help="cycle the micro-batches' widths over this many values, 8 tokens apart")
    parser.add_argument("--mixed", action="store_true",
                        help="completions of random lengths (1 to seq - 128 tokens) instead of all --seq")
    parser.add_argument("--variants", default="z2:m8,z2:m16,z2:m32,z3:m16")
    parser.add_argument("--model-dir", default="/tmp/syncrl-bench/base")
    parser.add_argument("--json", default=None)
    parser.add_argument("--split", action="store_true",
                        help="time forward+backward and the optimizer step apart (a device sync between)")
    parser.add_argument("--profile", action="store_true",
                        help="trace each variant's timed steps (torch.profiler, on stderr); slows them")
    parser.add_argument("--profile-rows", type=int, default=20,
                        help="--profile's tables: this many operators and kernels each")
    parser.add_argument("--host-profile", action="store_true",
                        help="profile each variant's timed steps by Python function on rank 0 (cProfile, on "
                             "stderr): where the host's dispatch time goes; slows them")
    args = parser.parse_args()

    import deepspeed
    import torch
    import torch.distributed as tdist

    from stages.rl import cuda_graphs, flops, grad_norm, packing, rehearsal, step_records, steps
    from stages.rl.modeling import compile_layers, load_policy
    from stages.rl.tiny_model import create_base_model
    from stages.rl.batches import collate
    from stages.train import micro_step

    rank, world, device = join_process_group()
    model_dir = Path(args.model_dir)
    if args.shape is None and rank == 0 and not model_dir.is_dir():
        create_base_model(model_dir, args.preset)
    tdist.barrier()
    peak = flops.peak_flops(torch.cuda.get_device_name()) if device.type == "cuda" else None
    results = []
    for spec in args.variants.split(","):
        v = parse_variant(spec)
        configs = OFFLOAD_CONFIGS if v["offload"] else DS_CONFIGS
        ds = json.loads((ROOT / configs.get(v["zero"], configs[2])).read_text())
        ds["zero_optimization"]["stage"] = v["zero"]
        ds.update(train_micro_batch_size_per_gpu=v["micro"], gradient_accumulation_steps=1,
                  train_batch_size=v["micro"] * world, gradient_clipping=1.0)
        ds["optimizer"]["params"].update(lr=1e-6, weight_decay=0.0)
        if v["foreach"]:
            ds["optimizer"]["params"]["fused"] = False
        if v["serial"]:
            ds["zero_optimization"]["overlap_comm"] = False
        if v["onebucket"]:  # small-llama's gradients in one reduction bucket: one flush (and device sync) a step
            ds["zero_optimization"]["reduce_bucket_size"] = 5e8
        if v["leaf"]:
            ds["zero_optimization"]["leaf_module"] = {"classes": ["LlamaDecoderLayer"]}
        if v["persist"]:
            ds["zero_optimization"]["stage3_param_persistence_threshold"] = 1e12
        if v["contiguous_gradients"] is not None:
            ds["zero_optimization"]["contiguous_gradients"] = v["contiguous_gradients"]
        if v["nocheck"]:
            ds.setdefault("bf16", {})["check_grad_overflow"] = False
        if v["nonorm"] or v["flatnorm"]:  # DeepSpeed's own norm and clipping off
            ds = grad_norm.deepspeed_settings(ds)
        if device.type != "cuda":
            ds.pop("bf16", None)
        dtype = "bfloat16" if device.type == "cuda" else "float32"
        if v["rehearse"]:
            from transformers import AutoConfig

            from stages.runtime.config import TuningConfig

            rehearsal.rehearse(AutoConfig.from_pretrained(model_dir), getattr(torch, dtype),
                               TuningConfig(fused_rms_norm=v["fused"], fused_layers=v["kernels"],
                                            remove_padding=v["packed"]),
                               SimpleNamespace(kl_coef=0.0, clip_eps=0.2, max_grad_norm=1.0), 1.0, device)
        if args.shape is not None:
            if v["kl"]:
                raise SystemExit("--shape: the kl variants need a reference replica per rank; use --preset")
            ref, model = None, build_in_place(args.shape, ds, dtype)
        else:
            fused = v["fused"]
            ref = load_policy(model_dir, dtype, device, fused_norms=fused, fused_layers=v["kernels"]).eval() \
                .requires_grad_(False) if v["kl"] else None
            model = load_policy(model_dir, dtype, fused_norms=fused, fused_layers=v["kernels"])
        if v["gc"]:
            model.gradient_checkpointing_enable()
        if v["packed"]:
            for m in (model, ref):
                if m is not None:
                    packing.use_packed_attention(m)
        engine, *_ = deepspeed.initialize(model=model, config=ds, model_parameters=model.parameters())
        flat_norm = grad_norm.FlatGradNorm(engine, 1.0) if v["flatnorm"] else None
        if v["compile"]:
            engine.compile()
        if v["layers"]:
            compile_layers(engine.module, "inductor")
            if ref is not None:
                compile_layers(ref, "inductor")
        shape = flops.model_shape(engine.module)
        train_cfg = SimpleNamespace(clip_eps=0.2, kl_coef=0.05 if v["kl"] else 0.0)
        rows = synthetic_rows(v["micro"] * (args.warmup + args.steps), args.seq, model.config.vocab_size, rank,
                              v["micro"], args.vary, args.mixed)
        if v["balance"]:
            widths = [packing.row_width(r) for r in rows]
            groups = steps.balanced_groups(widths, len(rows) // v["micro"], v["micro"])
            random.Random(0).shuffle(groups)
            micros = [[rows[i] for i in g] for g in groups]
        else:
            micros = [rows[i:i + v["micro"]] for i in range(0, len(rows), v["micro"])]
        fixed = None
        if v["graphs"]:
            t_capture = time.perf_counter()
            fixed = packing.fixed_shape(micros)
            cuda_graphs.capture_layers(engine.module, fixed, device)
            if rank == 0:
                print(f"{v['name']}: captured at {fixed.positions} positions, {fixed.segments - 1} rows of up to "
                      f"{fixed.max_length} in {time.perf_counter() - t_capture:.1f} s", flush=True)
        if v["packed"]:
            batches = [packing.pack(m, device, fixed) for m in micros]
        else:
            batches = [collate(m, device) for m in micros]
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        engine.train()

        split = {"backward_s": 0.0, "step_s": 0.0}

        def sync():
            if device.type == "cuda":
                torch.cuda.synchronize()

        def run(batches, engine=engine, ref=ref, timed=False):
            for batch in batches:
                t = time.perf_counter()
                loss, metrics = micro_step(engine, ref, batch, train_cfg, 1.0)
                if timed:
                    sync()
                    split["backward_s"] += time.perf_counter() - t
                    t = time.perf_counter()
                engine.step()
                if v["records"]:
                    step_records.step_record(engine, [{"loss": loss, **metrics}], sum(batch["lengths"]), flat_norm)
                if timed:
                    sync()
                    split["step_s"] += time.perf_counter() - t

        t_first = time.perf_counter()
        run(batches[:1])  # the first step: compiles, where the variant compiles
        if device.type == "cuda":
            torch.cuda.synchronize()
        first_s = time.perf_counter() - t_first
        run(batches[1:args.warmup])
        if device.type == "cuda":
            torch.cuda.synchronize()
        tdist.barrier()
        t0 = time.perf_counter()
        if args.profile:
            from tests.benchmarks.profiling import profiled

            timed_batches = batches[args.warmup:]
            profiled(lambda: run(timed_batches), device, rows=args.profile_rows, width=120)
        elif args.host_profile and rank == 0:
            from tests.benchmarks.profiling import host_profiled

            def timed_steps(timed_batches=batches[args.warmup:]):
                run(timed_batches)
                sync()  # the profile's wall then covers the GPU's queue too

            host_profiled(timed_steps, rows=60)  # deep enough that the optimizer step shows beside the layers
        else:
            run(batches[args.warmup:], timed=args.split)
        if device.type == "cuda":
            torch.cuda.synchronize()
        tdist.barrier()
        seconds = time.perf_counter() - t0
        timed = batches[args.warmup:]
        passes = 3 + v["kl"]
        model_flops = world * passes * sum(flops.forward_flops(shape, n) for b in timed for n in b["lengths"])
        positions = world * sum(sum(b["lengths"]) for b in timed)
        six_n = world * 6 * shape["n"] * sum(sum(b["lengths"]) for b in timed)
        r = {"variant": v["name"], "seconds_per_step": seconds / args.steps, "first_step_s": first_s, "tokens_per_s": positions / seconds,
             "mfu": model_flops / (seconds * world * peak) if peak else None,
             "mfu_6n": six_n / (seconds * world * peak) if peak else None,
             "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
             # the last step's; None where it is not computed
             "grad_norm": flat_norm.norm if flat_norm is not None else engine.get_global_grad_norm()}
        if r["grad_norm"] is not None:
            r["grad_norm"] = float(r["grad_norm"])
        if args.split:
            r.update({k: val / args.steps for k, val in split.items()})
        results.append(r)
        if rank == 0:
            mfu = f"MFU {r['mfu']:6.1%} (6N only {r['mfu_6n']:6.1%})" if peak else "MFU n/a (no GPU peak known)"
            mem = f", peak {r['peak_mem_gib']:.1f} GiB" if r["peak_mem_gib"] is not None else ""
            norm = "not computed" if r["grad_norm"] is None else f"{r['grad_norm']:.3g}"
            print(f"{v['name']:<18} {r['seconds_per_step']:7.3f} s/step (first {first_s:.1f} s) "
                  f"{r['tokens_per_s']:10.0f} tok/s "
                  f"(all {world} ranks)  {mfu}{mem}, grad norm {norm}", flush=True)
            if args.split:
                print(f"{'':<18} of which forward+backward {r['backward_s'] * 1e3:.1f} ms, optimizer step "
                      f"{r['step_s'] * 1e3:.1f} ms", flush=True)
        del engine, model, ref, batches
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if rank == 0:
        peak_text = f"peak {peak:.3g} FLOP/s per GPU" if peak else "no GPU peak known"
        print(f"{args.shape or args.preset}: N = {shape['n']:,}, L = {shape['layers']}, d = {shape['attn_dim']}; seq {args.seq}; "
              f"{world} ranks; {peak_text}", flush=True)
        print(flops.FORMULA)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    tdist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
