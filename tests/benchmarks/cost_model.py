"""A cost model, on paper, of one syncrl RL iteration at sizes that do not run here (docs/scale.md).

    python tests/benchmarks/cost_model.py                              # 8B and 70B on 2 x 8 H200
    python tests/benchmarks/cost_model.py --gpu h100,h200 --models 3b,8b,70b
    python tests/benchmarks/cost_model.py --checkpoint shared --json    # checkpoints on the shared filesystem

Every stage's seconds follow from the model's dimensions, the workload, datasheet peaks and the
rates given as options; --help names each default's source. The formulas are in docs/scale.md.
Standard library only: it runs anywhere, with no torch and no GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from stages.runtime.footprint import llama_parameters  # noqa: E402

# Datasheet figures per GPU (SXM): dense bf16 FLOP/s, HBM bytes/s, memory bytes.
GPUS = {"h100": dict(peak=989e12, hbm=3.35e12, memory=80e9),
        "h200": dict(peak=989e12, hbm=4.8e12, memory=141e9)}

# Llama 3.2 3B, Llama 3.1 8B and 70B: only the 3B ties its output projection to the embedding.
SHAPES = {
    "3b": dict(hidden=3072, layers=28, heads=24, kv_heads=8, intermediate=8192, vocab=128256, tied=True),
    "8b": dict(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256, tied=False),
    "70b": dict(hidden=8192, layers=80, heads=64, kv_heads=8, intermediate=28672, vocab=128256, tied=False),
}

CHECKPOINT_BYTES = 14  # per parameter: bf16 weights 2 + fp32 master 4 + the two fp32 Adam moments 8
EXPORT_BYTES = 2       # per parameter: the bf16 HF export generate loads
ZERO3_BYTES = 16       # per parameter resident under ZeRO-3 while training: the checkpoint's 14 + bf16 gradients
STATE_SHARE = 0.7      # of a GPU's memory for ZeRO-3 states (tests/benchmarks/shapes.py): the rest is activations

# What syncrl does (or would do) about each part, named when that part's stage dominates; docs/scale.md.
REMEDY = {
    "generate": "tensor-parallel sampling over a node's GPUs, data-parallel groups above it (planned: only "
                "generate.backend: vllm's tensor-parallel wiring exists, not run above one GPU)",
    "score + gather": "torch-free processes, one task each for gather",
    "train: start-up": "train starts early, beside save and generate, so its imports leave the critical path, "
                       "and takes its weights from the checkpoint it resumes; its engine stays on it",
    "train: resume": "node-local checkpoints (train.local_checkpoint_dir), each rank reading its own shard",
    "train: update": "ZeRO-3 across the nodes in a fresh process group per iteration; more tokens per "
                     "micro-batch hide its all-gathers",
    "train: checkpoint write": "node-local checkpoints, each rank writing its own shard; persist copies them later",
    "save (export)": "one writer on the shared filesystem (a node-local export is not built)",
    "persist (durable copy)": "a durable copy every train.durable_every iterations instead of every one",
}


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    results = [iteration(name, gpu, a) for gpu in a.gpu.split(",") for name in a.models.split(",")]
    if a.json:
        print(json.dumps({"inputs": vars(a), "results": results}, indent=1))
    else:
        print("\n\n".join(table(r) for r in results))
    return 0


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--models", default="8b,70b", help=f"comma-separated, of {', '.join(SHAPES)}")
    add("--gpu", default="h200", help="h100 or h200, or both comma-separated (datasheet peaks and memory)")
    add("--nodes", type=int, default=2)
    add("--gpus-per-node", type=int, default=8)
    add("--prompts", type=int, default=512, help="per iteration (configs/rl_2node.yaml)")
    add("--attempts", type=int, default=8, help="completions per prompt (configs/rl_2node.yaml)")
    add("--prompt-tokens", type=int, default=150, help="a GSM8K question in syncrl's template, about")
    add("--completion-tokens", type=int, default=300, help="mean completion; lengths taken uniform "
        "between 2 x mean - max and max")
    add("--max-completion", type=int, default=512, help="generate.max_new_tokens (configs/rl_2node.yaml)")
    add("--mfu", type=float, default=0.43, help="ZeRO-3 update MFU (stages/rl/flops.py's model FLOPs): measured "
        "at the 3B shape on 1 H200 (train_mfu z3:m16:fused:packed, docs/benchmarks.md 2026-12-04)")
    add("--decode-efficiency", type=float, default=0.15, help="share of the sampling roofline an engine reaches "
        "(syncrl's compact sampler on 1 H200: 10%% of its bandwidth bound at the 3B shape, 18%% at 8B, "
        "docs/benchmarks.md 2026-12-04)")
    add("--generate-tp", type=int, default=0, help="GPUs per sampling group (0: 1 where the bf16 weights fit half "
        "a GPU, else a node's GPUs)")
    add("--generate-memory-share", type=float, default=0.9, help="of a GPU's memory for weights and KV cache "
        "(vLLM's gpu_memory_utilization default)")
    add("--micro-batch-rows", type=int, default=4, help="rows per GPU per micro-batch (configs/rl_2node.yaml); "
        "ZeRO-3 gathers the weights once per micro-batch")
    add("--no-overlap", action="store_true", help="add ZeRO-3's communication to the compute instead of hiding "
        "it under it (DeepSpeed's overlap_comm and prefetch, on in configs/ds_zero3_multinode.json)")
    add("--inter-node-gbs", type=float, default=200, help="GB/s per node each way: 4 x 400 Gb/s InfiniBand "
        "(assumed; many H100/H200 nodes have 8)")
    add("--nvlink-gbs", type=float, default=450, help="GB/s per GPU each way, NVLink 4 (datasheet: 900 both ways)")
    add("--local-write-gbs", type=float, default=10, help="node-local storage GB/s per node: /dev/shm ~10 "
        "(assumed), a local NVMe ~5")
    add("--local-read-gbs", type=float, default=10, help="as --local-write-gbs, reading")
    add("--shared-fs-gbs", type=float, default=2, help="shared filesystem GB/s per node (assumed)")
    add("--checkpoint", choices=("local", "shared"), default="local", help="where train's checkpoint goes: "
        "node-local storage (train.local_checkpoint_dir) or the shared run dir")
    add("--durable-every", type=int, default=1, help="iterations per durable copy of a node-local checkpoint "
        "(train.durable_every; its default 1 copies every iteration)")
    add("--train-startup-s", type=float, default=30, help="train's fixed start-up: imports, process group, "
        "DeepSpeed engine (assumed), before its model load at --shared-fs-gbs")
    add("--generate-startup-s", type=float, default=0, help="generate's fixed start-up beyond its model load at "
        "--shared-fs-gbs (0: started early, its imports are off the critical path)")
    add("--cpu-stages-s", type=float, default=2, help="score and gather together (0.7 s for score at 2,048 "
        "rows, docs/benchmarks.md)")
    add("--json", action="store_true", help="print the inputs and results as JSON")
    a = p.parse_args(argv)
    for name in a.models.split(","):
        if name not in SHAPES:
            p.error(f"--models: unknown shape {name!r}; valid: {', '.join(SHAPES)}")
    for gpu in a.gpu.split(","):
        if gpu not in GPUS:
            p.error(f"--gpu: unknown GPU {gpu!r}; valid: {', '.join(GPUS)}")
    if not a.max_completion / 2 <= a.completion_tokens <= a.max_completion:
        p.error("--completion-tokens must lie between half of --max-completion and --max-completion")
    return a


def shape(name: str) -> dict:
    """Parameters from the dimensions; n = those that multiply activations (flops.py's N)."""
    s = SHAPES[name]
    d, layers = s["hidden"], s["layers"]
    dims = dict(hidden_size=d, num_hidden_layers=layers, intermediate_size=s["intermediate"],
                num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"])
    kv = s["kv_heads"] * d // s["heads"]
    return dict(name=name, params=llama_parameters(dims, s["vocab"], s["tied"]),
                n=llama_parameters(dims, s["vocab"], tied=True),  # the output head multiplies, the embedding looks up
                layers=layers, d=d, kv_bytes=2 * layers * kv * 2)  # K and V in bf16, per position


def iteration(name: str, gpu_name: str, a) -> dict:
    m, gpu = shape(name), GPUS[gpu_name]
    gpus, P, gb = a.nodes * a.gpus_per_node, m["params"], 1e9
    fs, link = a.shared_fs_gbs * gb, (a.inter_node_gbs if a.nodes > 1 else a.nvlink_gbs) * gb
    load = EXPORT_BYTES * P / fs  # each node reads the export once; its other ranks hit the page cache
    gen, train = sample(m, gpu, a), update(m, gpu, a, gpus, link)
    per_node = CHECKPOINT_BYTES * P / a.nodes  # each node reads and writes its own ranks' shards
    local = a.checkpoint == "local"
    stages = {
        "generate": a.generate_startup_s + load + gen["seconds"],
        "score + gather": a.cpu_stages_s,
        # A steady iteration's train builds the policy without reading it: the checkpoint it resumes
        # sets every weight (stages/rl/modeling.py build_policy). Iteration 0 reads the base model.
        "train: start-up": a.train_startup_s,
        "train: resume": per_node / ((a.local_read_gbs if local else a.shared_fs_gbs) * gb),
        "train: update": train["seconds"],
        "train: checkpoint write": per_node / ((a.local_write_gbs if local else a.shared_fs_gbs) * gb),
        # ZeRO-3: train gathers the weights (one all-gather) and one rank writes them for save to link in.
        "save (export)": EXPORT_BYTES * P * (gpus - 1) / gpus / link + EXPORT_BYTES * P / fs,
    }
    # persist copies each node's share to the shared run dir beside the next generate, score and gather;
    # the next train waits for it, so only what outlasts them is on the critical path.
    copy = per_node / fs if local else 0.0
    stages["persist (durable copy)"] = max(0.0, copy - stages["generate"] - a.cpu_stages_s) / a.durable_every
    per_stage = {}
    for part, seconds in stages.items():
        per_stage[stage_of(part)] = per_stage.get(stage_of(part), 0.0) + seconds
    top = max(per_stage, key=per_stage.get)
    part = max((k for k in stages if stage_of(k) == top), key=stages.get)
    # What waits on the shared filesystem: generate's model load, the export, persist's excess (and
    # the checkpoint itself when it goes there).
    on_fs = load + EXPORT_BYTES * P / fs + stages["persist (durable copy)"]
    on_fs += 0 if local else stages["train: resume"] + stages["train: checkpoint write"]
    return dict(model=name, gpu=gpu_name, nodes=a.nodes, gpus_per_node=a.gpus_per_node, params=P,
                tokens=train["tokens"], stages=stages, per_stage=per_stage, iteration_s=sum(stages.values()),
                dominant=top, dominant_part=part, remedy=REMEDY[part], shared_fs_s=on_fs, generate=gen,
                train=train, load_s=load, persist_copy_s=copy, checkpoint=a.checkpoint,
                checkpoint_gb_per_node=per_node / gb,
                round_trip_local_s=per_node / (a.local_read_gbs * gb) + per_node / (a.local_write_gbs * gb),
                round_trip_shared_s=2 * per_node / fs)


def stage_of(part: str) -> str:
    return part.split(":")[0].split(" (")[0]


def sample(m: dict, gpu: dict, a) -> dict:
    """Prefill and decode of every row: per step the max of compute and memory time (the roofline),
    summed over steps, over the decode efficiency. A group of tp GPUs splits each matrix (tensor
    parallel, two all-reduces a layer over NVLink); groups split the rows (data parallel)."""
    weights = EXPORT_BYTES * m["params"]
    tp = a.generate_tp or (1 if weights <= gpu["memory"] / 2 else a.gpus_per_node)
    groups = a.nodes * a.gpus_per_node // tp
    rows = a.prompts * a.attempts / groups
    lo, hi, pre = 2 * a.completion_tokens - a.max_completion, a.max_completion, a.prompt_tokens
    live = [rows * min(1.0, (hi - t) / max(hi - lo, 1)) for t in range(hi)]  # rows still sampling at step t
    # A paged cache holds live rows' positions only; if their peak does not fit beside the weights,
    # the rows go in waves, each paying every decode step again.
    room = tp * a.generate_memory_share * gpu["memory"] - weights
    if room <= 0:
        raise SystemExit(f"{m['name']}: {weights / 1e9:.0f} GB of weights do not fit {tp} GPU(s): raise --generate-tp")
    waves = math.ceil(max(r * (pre + t) for t, r in enumerate(live)) * m["kv_bytes"] / room)
    reduce = 2 * (tp - 1) / tp / (a.nvlink_gbs * 1e9)  # ring all-reduce: seconds per byte all-reduced

    def roofline(speed: int, per_byte: float) -> tuple[float, int]:
        """Seconds of one wave at `speed` GPUs' rates, and how many of its decode steps are memory-bound."""
        flops_s, bytes_s = speed * gpu["peak"], speed * gpu["hbm"]
        r0 = rows / waves
        seconds = max(r0 * (2 * m["n"] * pre + 4 * m["layers"] * m["d"] * pre ** 2) / flops_s, weights / bytes_s)
        memory_bound = 0
        for t, r in enumerate(live):
            r /= waves
            compute = (2 * m["n"] * r + 4 * m["layers"] * m["d"] * r * (pre + t)) / flops_s
            memory = (weights + m["kv_bytes"] * r * (pre + t)) / bytes_s
            seconds += max(compute, memory) + 2 * m["layers"] * r * m["d"] * 2 * per_byte
            memory_bound += memory >= compute
        return seconds, memory_bound

    wave, memory_bound = roofline(tp, reduce)
    # syncrl's HF path (generate.gpus_per_process) splits the layers instead: its GPUs run in turn.
    layered = roofline(1, 0.0)[0]
    return dict(seconds=waves * wave / a.decode_efficiency, tp=tp, groups=groups, waves=waves, steps=hi,
                memory_bound_steps=memory_bound, layer_split_s=waves * layered / a.decode_efficiency,
                new_tokens=a.prompts * a.attempts * a.completion_tokens)


def update(m: dict, gpu: dict, a, gpus: int, link: float) -> dict:
    """Model FLOPs (flops.py: 3 x forward, forward = 2 N s + 4 L d s^2 per row of s tokens) at the MFU,
    and ZeRO-3's traffic: per micro-batch two all-gathers of the bf16 weights (forward, backward) and
    one reduce-scatter of the bf16 gradients, each moving (W - 1) / W of 2 bytes x params through every
    node's links (a ring over W GPUs)."""
    rows, s = a.prompts * a.attempts, a.prompt_tokens + a.completion_tokens
    flops = 3 * rows * (2 * m["n"] * s + 4 * m["layers"] * m["d"] * s ** 2)
    compute = flops / (gpus * gpu["peak"] * a.mfu)
    micro = math.ceil(rows / gpus / a.micro_batch_rows)
    comm = micro * 3 * 2 * m["params"] * (gpus - 1) / gpus / link
    seconds = compute + comm if a.no_overlap else max(compute, comm)
    states = ZERO3_BYTES * m["params"] / gpus
    return dict(seconds=seconds, tokens=rows * s, flops=flops, compute_s=compute, comm_s=comm, micro_batches=micro,
                exposed_comm_s=seconds - compute, states_gb_per_gpu=states / 1e9,
                states_fit=states <= STATE_SHARE * gpu["memory"])


def table(r: dict) -> str:
    g, t, total = r["generate"], r["train"], r["iteration_s"]
    how = {
        "generate": f"model load {r['load_s']:.1f} + sampling {g['seconds']:.1f} s: {g['groups']} x {g['tp']} GPU(s), "
                    f"{g['waves']} wave(s) of {g['steps']} steps, {g['memory_bound_steps']} memory-bound",
        "train: start-up": "fixed; the weights come from the checkpoint resumed",
        "train: resume": f"{r['checkpoint_gb_per_node']:.0f} GB per node from {r['checkpoint']} storage",
        "train: update": f"compute {t['compute_s']:.1f} s, ZeRO-3 comm {t['comm_s']:.1f} s over {t['micro_batches']} "
                         f"micro-batches ({t['exposed_comm_s']:.1f} s exposed)",
        "train: checkpoint write": f"{r['checkpoint_gb_per_node']:.0f} GB per node to {r['checkpoint']} storage",
        "save (export)": f"{EXPORT_BYTES * r['params'] / 1e9:.0f} GB gathered, written by one rank",
        "persist (durable copy)": f"copy {r['persist_copy_s']:.0f} s per node beside generate, score, gather"
                                  if r["checkpoint"] == "local" else "none: train wrote the durable copy",
    }
    lines = [f"{r['model'].upper()} ({r['params'] / 1e9:.2f}B params) on {r['nodes']} x {r['gpus_per_node']} "
             f"{r['gpu'].upper()}: {r['tokens'] / 1e6:.2f}M tokens per iteration",
             f"{'stage':<25}{'seconds':>8}{'share':>7}  how"]
    lines += [f"{k:<25}{v:>8.1f}{v / total:>7.0%}  {how.get(k, '')}".rstrip() for k, v in r["stages"].items()]
    lines += [f"{'iteration':<25}{total:>8.1f}{1:>7.0%}",
              f"dominant stage: {r['dominant']} ({r['per_stage'][r['dominant']] / total:.0%}), most of it "
              f"{r['dominant_part']} ({r['stages'][r['dominant_part']] / total:.0%}): {r['remedy']}",
              f"waiting on the shared filesystem: {r['shared_fs_s']:.1f} s ({r['shared_fs_s'] / total:.0%}: "
              f"generate's model load, the export, persist's excess{'' if r['checkpoint'] == 'local' else ', checkpoint'})",
              f"checkpoint round trip ({CHECKPOINT_BYTES} B/param, {r['checkpoint_gb_per_node']:.0f} GB per node): "
              f"node-local {r['round_trip_local_s']:.1f} s, shared filesystem {r['round_trip_shared_s']:.1f} s "
              f"({r['round_trip_shared_s'] / r['round_trip_local_s']:.1f}x)",
              f"ZeRO-3 states {t['states_gb_per_gpu']:.1f} GB per GPU: " + ("fit" if t["states_fit"] else
              f"over {STATE_SHARE:.0%} of the GPU, needs optimizer offload (not modeled)")]
    if g["tp"] > 1:
        lines.append(f"sampling with the layers split over {g['tp']} GPUs (HF device_map): {g['layer_split_s']:.1f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
