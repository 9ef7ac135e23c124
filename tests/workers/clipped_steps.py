"""One rank of tests/test_grad_norm.py: train's optimizer steps over a fixed train set, the weights
and each step's gradient norm written to a file.

Run as `python -m tests.workers.clipped_steps MODEL_DIR OUT_FILE key=value ...` with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set. Builds train's real DeepSpeed engine (its config, its
optimizer, tuning.grad_norm's norm; gloo on CPU), runs every optimizer step of 24 synthetic rows
through stages.train.micro_step and engine.step, records each step as train does
(stages/rl/step_records.py), and rank 0 saves the final weights and the step records.
"""

from __future__ import annotations

import sys

import torch


def main() -> int:
    model_dir, out, *overrides = sys.argv[1:]
    import torch.distributed as tdist

    from stages.rl import packing
    from stages.rl.steps import optimizer_steps
    from stages.rl.step_records import step_record
    from stages.train import flat_grad_norm, micro_step
    from tests.workers.step_gradients import train_engine, train_rows

    cfg, ctx, engine = train_engine(model_dir, overrides)
    norm = flat_grad_norm(ctx, engine)
    records = []
    for step in optimizer_steps(train_rows(24, seed=3), ctx):
        pending = []
        for micro in step.micro_batches:
            loss, metrics = micro_step(engine, None, packing.pack(micro, torch.device("cpu")), cfg.train, 1.0)
            pending.append({"loss": loss.detach(), **metrics})
            engine.step()
        records.append(step_record(engine, pending, 0, norm))
    if ctx.rank == 0:
        weights = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
        torch.save({"weights": weights, "records": records}, out)
    tdist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
