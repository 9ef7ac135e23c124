"""Benchmark: the train stage's DeepSpeed checkpoint, written and read back under torch's serialization settings.

Every iteration train writes a full DeepSpeed checkpoint (bf16 weights plus fp32 master weights and
both Adam moments: 14 bytes per parameter, 6.66 GB for the ~0.48B preset) and the next train reads it
back, both on the iteration's critical path. This builds the engine train builds (the preset, the
ZeRO config of configs/gpu_small.yaml), takes one optimizer step so that the Adam state exists, then
for each variant times engine.save_checkpoint and engine.load_checkpoint (what train calls),
checks that every rank's fp32 master partition and Adam moments read back with the bits they had
(position-weighted sums of their bits, chunk by chunk), and prints
seconds and GB/s (slowest rank) per run and the mean per variant. A plain write of the same number
of bytes from host memory into the same directory is printed first: the filesystem's own ceiling.

A variant is "default" (torch's settings: a CRC-32 over every tensor's bytes on write, device-to-host
copies into pageable memory, reads into fresh host memory) or settings of
torch.utils.serialization.config, which DeepSpeed's torch.save / torch.load go through, joined by "+":

  nocrc     save.compute_crc32 = False
  pinned    save.use_pinned_memory_for_d2h = True
  mmap      load.mmap = True (tensors come straight from the page cache the write filled)
  threads   each file through stages/rl/serialization.py's parallel_save (tuning.checkpoint_write_threads: 8)
  staged    each file's large tensors moved to the GPU by 8 threads before DeepSpeed copies them
            (serialization.staged_loads, tuning.resume_to_gpu)

syncrl's train and save stages use nocrc+pinned+mmap (stages/rl/serialization.py).

    python -m torch.distributed.run --nproc-per-node N tests/benchmarks/checkpoint_io.py \\
        [--preset small-llama | --shape small-llama-host] [--dir /tmp/syncrl-ckpt] [--repeats 2] \\
        [--variants default,nocrc,nocrc+mmap] [--profile]

--shape builds a model of tests/benchmarks/shapes.py from its config (random weights, nothing on
disk): small-llama-host is small-llama's 24 layers and 219 parameters at a width of 80, so a load
of it is all of DeepSpeed's per-parameter work and hardly any bytes. --profile traces the last load
on rank 0 (torch.profiler, on stderr): host-to-device copies against everything else.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SETTINGS = {  # variant part -> (torch.utils.serialization.config section, key, value)
    "nocrc": ("save", "compute_crc32", False),
    "pinned": ("save", "use_pinned_memory_for_d2h", True),
    "mmap": ("load", "mmap", True),
}


def variant_settings(name: str) -> tuple[dict, dict]:
    """("save" settings, "load" settings) of a variant: "default", or parts of SETTINGS joined by "+"."""
    out = {"save": {}, "load": {}}
    for part in [] if name == "default" else name.split("+"):
        if part in ("threads", "staged"):
            continue
        if part not in SETTINGS:
            raise SystemExit(f"unknown variant part {part!r} in {name!r}: use default or {'+'.join(SETTINGS)}+threads+staged")
        section, key, value = SETTINGS[part]
        out[section][key] = value
    return out["save"], out["load"]


def optimizer_tensors(engine) -> list:
    """This rank's fp32 master partitions and Adam moments, flattened, in a fixed order."""
    opt = engine.optimizer
    out = [t for t in opt.single_partition_of_fp32_groups]
    for t in opt.single_partition_of_fp32_groups:
        state = opt.optimizer.state[t]
        out += [state["exp_avg"], state["exp_avg_sq"]]
    return out


def fingerprint(t, chunk: int = 1 << 26) -> list[int]:
    """Position-weighted sums of a float32 tensor's bits, one per chunk of `chunk` elements: any changed
    element changes its chunk's sum (but for a 2**64 wrap). Computed where the tensor lives, a chunk
    at a time, so that checking a 3B model's state needs no copy of it (a host copy beside the
    checkpoint in tmpfs does not fit the host memory of a 125 GB machine)."""
    import torch
    bits = t.detach().reshape(-1).view(torch.int32)
    sums = []
    for i in range(0, bits.numel(), chunk):
        part = bits[i:i + chunk].to(torch.int64)
        weights = torch.arange(i + 1, i + 1 + part.numel(), dtype=torch.int64, device=part.device)
        sums.append(int((part * weights).sum()))
    return sums


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small-llama")
    parser.add_argument("--shape", default=None, help="build this shape in place instead of loading --preset")
    parser.add_argument("--profile", action="store_true", help="trace the last load on rank 0 (torch.profiler)")
    parser.add_argument("--model-dir", default="/tmp/syncrl-bench/base")
    parser.add_argument("--dir", default="/tmp/syncrl-ckpt", help="where checkpoints are written (emptied first)")
    parser.add_argument("--variants", default="default,nocrc,nocrc+mmap,nocrc+mmap+pinned,nocrc+mmap+pinned+threads,"
                                              "nocrc+mmap+pinned+threads+staged")
    parser.add_argument("--repeats", type=int, default=2, help="passes over the variants, in mirrored order")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    for v in args.variants.split(","):
        variant_settings(v)

    import deepspeed
    import torch
    import torch.distributed as tdist
    from torch.utils.serialization import config as ser

    from stages.rl.serialization import staged_loads, threaded_writes
    from stages.rl.modeling import load_policy
    from stages.rl.tiny_model import create_base_model

    sys.path.insert(0, str(Path(__file__).parent))
    from profiling import profiled
    from train_mfu import build_in_place, join_process_group

    rank, world, device = join_process_group()
    model_dir, out = Path(args.model_dir), Path(args.dir)
    if rank == 0:
        if args.shape is None and not model_dir.is_dir():
            create_base_model(model_dir, args.preset)
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
    tdist.barrier()

    ds = json.loads((ROOT / "configs/ds_zero2_gpu.json").read_text())
    ds.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1, train_batch_size=world)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    if device.type != "cuda":
        ds.pop("bf16", None)
    model = load_policy(model_dir, dtype, device) if args.shape is None else build_in_place(args.shape, ds, dtype)
    engine, *_ = deepspeed.initialize(model=model, config=ds, model_parameters=model.parameters())
    ids = torch.randint(4, model.config.vocab_size, (1, 64), device=device)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    # Fingerprints, not a copy: at the 3B shape a copy of the state fits neither beside the engine's on
    # an 80 GB card nor beside the checkpoint in tmpfs on the host.
    expected = [fingerprint(t) for t in optimizer_tensors(engine)]

    def all_ranks(value: float, op=tdist.ReduceOp.MAX) -> float:
        """`value` reduced over the ranks: the slowest rank's seconds by default."""
        t = torch.tensor([value], dtype=torch.float64, device=device)
        tdist.all_reduce(t, op=op)
        return float(t.item())

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()
        tdist.barrier()

    results = []
    local_bytes = sum(t.numel() * t.element_size() for t in optimizer_tensors(engine))
    if rank == 0:
        local_bytes += sum(p.numel() * p.element_size() for p in engine.module.parameters())
    # One host buffer written over and over: the file's bytes are what a checkpoint's would be, and
    # the host holds one buffer, not a second checkpoint.
    host = torch.empty(min(local_bytes, 1 << 30), dtype=torch.uint8).fill_(1)
    sync()
    t0 = time.perf_counter()
    with open(out / f"plain.rank{rank}", "wb") as f:
        for done in range(0, local_bytes, host.numel()):
            f.write(memoryview(host.numpy())[:min(host.numel(), local_bytes - done)])
    plain_s = all_ranks(time.perf_counter() - t0)
    all_bytes = int(all_ranks(local_bytes, tdist.ReduceOp.SUM))
    del host
    (out / f"plain.rank{rank}").unlink()
    if rank == 0:
        print(f"{world} rank(s), {args.shape or args.preset}, {all_bytes / 1e9:.2f} GB per checkpoint, into {out}")
        print(f"{'plain write':<10} {plain_s:7.2f} s  {all_bytes / 1e9 / plain_s:6.2f} GB/s  "
              "(host memory to file, no serialization: the ceiling)", flush=True)
    def measure(name: str, profile: bool = False) -> dict:
        save_cfg, load_cfg = variant_settings(name)
        with ser.patch(**{f"save.{k}": v for k, v in save_cfg.items()}, **{f"load.{k}": v for k, v in load_cfg.items()}):
            sync()
            t0 = time.perf_counter()
            with threaded_writes(engine, "checkpoint_engine", 8 if "threads" in name.split("+") else 0):
                engine.save_checkpoint(str(out), tag=name)
            sync()
            save_s = all_ranks(time.perf_counter() - t0)
            with torch.no_grad():
                for t in optimizer_tensors(engine):
                    t.zero_()
            sync()
            t0 = time.perf_counter()

            def load():
                with staged_loads(engine, device, 8 if "staged" in name.split("+") else 0):
                    return engine.load_checkpoint(str(out), tag=name, load_optimizer_states=True,
                                                  load_lr_scheduler_states=True)

            path, _ = profiled(load, device) if profile else load()
            sync()
            load_s = all_ranks(time.perf_counter() - t0)
        if path is None:
            raise SystemExit(f"variant {name}: DeepSpeed could not load {out / name}")
        same = [fingerprint(t) for t in optimizer_tensors(engine)] == expected
        if not same:
            raise SystemExit(f"variant {name}: optimizer state read back differs on rank {rank}")
        size = sum(f.stat().st_size for f in (out / name).rglob("*") if f.is_file())
        tdist.barrier()
        if rank == 0:
            shutil.rmtree(out / name)
            print(f"{name:<18} save {save_s:6.2f} s {size / 1e9 / save_s:6.2f} GB/s   load {load_s:6.2f} s "
                  f"{size / 1e9 / load_s:6.2f} GB/s   optimizer state read back identical", flush=True)
        return {"variant": name, "save_s": save_s, "load_s": load_s, "bytes": size, "identical": same}

    # Mirrored order (A B C, C B A, ...): the page cache's write-back of one variant's files slows the
    # next one's write, and the mirror spreads that over every variant.
    names = args.variants.split(",")
    for rep in range(args.repeats):
        order = names if rep % 2 == 0 else names[::-1]
        results += [measure(n, args.profile and rank == 0 and rep == args.repeats - 1 and n == order[-1])
                    for n in order]
    if rank == 0:
        print(f"mean of {args.repeats}:")
        for n in names:
            rs = [r for r in results if r["variant"] == n]
            save_s, load_s = (statistics.mean(r[k] for r in rs) for k in ("save_s", "load_s"))
            print(f"{n:<18} save {save_s:6.2f} s {rs[0]['bytes'] / 1e9 / save_s:6.2f} GB/s   "
                  f"load {load_s:6.2f} s {rs[0]['bytes'] / 1e9 / load_s:6.2f} GB/s")
    if rank == 0 and args.json:
        Path(args.json).write_text(json.dumps({"plain_write_s": plain_s, "results": results}, indent=1) + "\n")
    tdist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
