"""Benchmark: training throughput from 2 to 4 to 8 GPUs of one host, placed as two "nodes" of half each.

For each GPU count G, starts two `torch.distributed.run` launchers on this host (node ranks 0 and 1,
G/2 processes each, each launcher seeing only its half of the GPUs through CUDA_VISIBLE_DEVICES),
as slurm/rl_2node.sbatch places ranks on two nodes, and runs tests/benchmarks/train_mfu.py with the
same variants. Prints tokens/s, MFU and the scaling efficiency against the smallest G:
    efficiency(G) = (tokens/s at G / G) / (tokens/s at G0 / G0)

    python tests/benchmarks/scaling.py --gpus 2,4,8 [--variants z2:m32:compile,z3:m32] [--preset small-llama]
    python tests/benchmarks/scaling.py --gpus 4,8 --variants z3:m4 --shape largest
--shape NAME builds a larger model of tests/benchmarks/shapes.py in place; "largest" picks, per GPU
count, the largest whose ZeRO-3 model states fit there (so efficiency compares like with like only
between counts that picked the same shape: the table says which). On CPU (gloo) --gpus 2 runs one
process per "node", to check the launch.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(ROOT))

from jobs.launchers import free_port  # noqa: E402 (needs ROOT on the path)


def run_size(gpus: int, args, out: Path, port: int, shape: str | None) -> list[dict]:
    per_node = gpus // 2
    procs = []
    for node in (0, 1):
        env = dict(os.environ)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(node * per_node + i) for i in range(per_node))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", str(per_node), "--master-addr", "127.0.0.1", "--master-port", str(port),
               "tests/benchmarks/train_mfu.py", "--preset", args.preset, "--seq", str(args.seq),
               "--steps", str(args.steps), "--variants", args.variants, "--model-dir", args.model_dir,
               "--json", str(out), *(["--shape", shape] if shape else [])]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env))
    codes = [p.wait(timeout=args.timeout_s) for p in procs]
    if any(codes):
        raise SystemExit(f"{gpus} GPUs: launchers exited {codes}")
    return json.loads(out.read_text())


def shape_for(option: str | None, gpus: int) -> str | None:
    """--shape as given, or for "largest" the largest shape whose ZeRO-3 states fit `gpus` GPUs here."""
    if option != "largest":
        return option
    import torch

    from shapes import largest_fitting

    if not torch.cuda.is_available():
        raise SystemExit("--shape largest needs GPUs to size against")
    return largest_fitting(gpus, torch.cuda.get_device_properties(0).total_memory)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", default="2,4,8")
    parser.add_argument("--variants", default="z2:m32:compile,z3:m32")
    parser.add_argument("--preset", default="small-llama")
    parser.add_argument("--shape", default=None, help="a model of tests/benchmarks/shapes.py, or 'largest'")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--model-dir", default="/tmp/syncrl-bench/base")
    parser.add_argument("--timeout-s", type=int, default=900, help="per GPU count")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    sizes = [int(g) for g in args.gpus.split(",")]
    if any(g < 2 or g % 2 for g in sizes):
        parser.error("--gpus: even counts of at least 2 (two nodes of half each)")
    tmp = Path(tempfile.mkdtemp(prefix="syncrl-scaling-"))
    shapes = {g: shape_for(args.shape, g) for g in sizes}
    results = {}
    for g in sizes:
        # A free port: a fixed one would meet another run's rendezvous on a shared machine.
        results[g] = run_size(g, args, tmp / f"gpus_{g}.json", free_port(), shapes[g])
    base_g = sizes[0]
    print(f"\nseq {args.seq}, two nodes of half the GPUs each; efficiency against {base_g} GPUs")
    print(f"{'variant':<18} {'model':<12} {'GPUs':>4} {'tokens/s':>10} {'MFU':>7} {'efficiency':>10}")
    table = []
    for v_index, variant in enumerate(args.variants.split(",")):
        base = results[base_g][v_index]["tokens_per_s"] / base_g
        for g in sizes:
            r = results[g][v_index]
            eff = r["tokens_per_s"] / g / base
            mfu = f"{r['mfu']:7.1%}" if r.get("mfu") is not None else f"{'-':>7}"
            model = shapes[g] or args.preset
            # Tokens/s of different models do not compare: efficiency only against the same model.
            eff_text = f"{eff:>10.2f}" if shapes[g] == shapes[base_g] else f"{'-':>10}"
            print(f"{variant:<18} {model:<12} {g:>4} {r['tokens_per_s']:>10.0f} {mfu} {eff_text}")
            table.append({"variant": variant, "model": model, "gpus": g, **r,
                          "efficiency": eff if shapes[g] == shapes[base_g] else None})
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
