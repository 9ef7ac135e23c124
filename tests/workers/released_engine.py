"""One rank of tests/test_grad_norm.py's release test: train's engine after its optimizer steps, given
back as train gives it back before a deferred checkpoint's marker (stages.train.release_engine); saves
whether the engine and the ZeRO optimizer's fp32 state were freed (a ZeRO-3 engine outlives its
destroy(): the memory its tensors hold, freed by storage as release_engine does on a GPU).

Run as `python -m tests.workers.released_engine MODEL_DIR OUT_FILE key=value ...` with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set (gloo on CPU).
"""

from __future__ import annotations

import gc
import sys
import weakref

import torch


def main() -> int:
    model_dir, out, *overrides = sys.argv[1:]
    import torch.distributed as tdist

    from stages.rl import packing
    from stages.rl.steps import optimizer_steps
    from stages.runtime.memory import free_tensors_reached
    from stages.train import TrainRun, flat_grad_norm, micro_step, release_engine
    from tests.workers.step_gradients import train_engine, train_rows

    cfg, ctx, engine = train_engine(model_dir, overrides)
    norm = flat_grad_norm(ctx, engine)
    for step in optimizer_steps(train_rows(8, seed=3), ctx):
        for micro in step.micro_batches:
            micro_step(engine, None, packing.pack(micro, torch.device("cpu")), cfg.train, 1.0)
            engine.step()
    optimizer = engine.optimizer
    fp32 = getattr(optimizer, "single_partition_of_fp32_groups", None) or optimizer.fp32_partitioned_groups_flat
    fp32 = fp32[0]
    held = {"engine": weakref.ref(engine), "fp32 partition": weakref.ref(fp32)}
    run = TrainRun(engine, None, [], torch.device("cpu"), None, None, 0.0, None, {}, None, norm)
    del engine, norm, fp32, optimizer
    release_engine(run)
    gc.collect()
    if held["engine"]() is not None:  # what release_engine frees on a GPU, freed here on the CPU
        free_tensors_reached(held["engine"](), torch.device("cpu"))
    fp32 = held["fp32 partition"]()
    if ctx.rank == 0:
        torch.save({"alive": [name for name, ref in held.items() if ref() is not None],
                    "fp32 bytes held": 0 if fp32 is None else fp32.untyped_storage().nbytes()}, out)
    tdist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
