"""One rank of tests/test_single_rank.py: train's DeepSpeed engine run for two optimizer steps with
ZeRO's gradient reduction as DeepSpeed does it, or with stages/rl/single_rank.py's skip.

Run as `python -m tests.workers.single_rank MODEL_DIR OUT_FILE mode=keep|skip key=value ...` with
RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set. Rank 0 saves {"applied": whether the skip took,
"reductions": how many buckets ZeRO reduced, "params": every parameter after the steps}.
"""

from __future__ import annotations

import sys

import torch


def main() -> int:
    model_dir, out, mode, *overrides = sys.argv[1:]
    import torch.distributed as tdist

    from stages.rl import packing, single_rank
    from stages.rl.steps import optimizer_steps
    from stages.train import micro_step
    from tests.workers.step_gradients import train_engine, train_rows

    cfg, ctx, engine = train_engine(model_dir, overrides)
    applied = single_rank.skip_gradient_reduction(engine) if mode == "mode=skip" else False
    reductions = 0
    reduce = engine.optimizer.allreduce_bucket  # what each bucket's reduction calls

    def counted(*args, **kwargs):
        nonlocal reductions
        reductions += 1
        return reduce(*args, **kwargs)

    engine.optimizer.allreduce_bucket = counted
    for step in optimizer_steps(train_rows(), ctx)[:2]:
        for i, micro in enumerate(step.micro_batches):
            if step.normalizer is not None:
                engine.set_gradient_accumulation_boundary(i == len(step.micro_batches) - 1)
            micro_step(engine, None, packing.pack(micro, torch.device("cpu")), cfg.train, 1.0, step.normalizer)
            engine.step()
    if ctx.rank == 0:
        torch.save({"applied": applied, "reductions": reductions,
                    "params": {n: p.detach().clone() for n, p in engine.module.named_parameters()}}, out)
    tdist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
