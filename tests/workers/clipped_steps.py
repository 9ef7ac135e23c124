"""One rank of tests/test_grad_norm.py: train's optimizer steps over a fixed train set, the weights
and each step's gradient norm written to a file.

Run as `python -m tests.workers.clipped_steps MODEL_DIR OUT_FILE key=value ...` with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set. Builds train's real DeepSpeed engine (its config, its
optimizer, train.grad_norm's norm; gloo on CPU), runs every optimizer step of 24 synthetic rows
through stages.train.micro_step and engine.step, records each step as train does
(stages.train._step_record), and rank 0 saves the final weights and the step records.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import torch


def main() -> int:
    model_dir, out, *overrides = sys.argv[1:]
    import deepspeed
    import torch.distributed as tdist

    from stages.rl import packing
    from stages.rl.modeling import load_policy
    from stages.runtime.config import load_config
    from stages.train import _step_record, deepspeed_config, flat_grad_norm, micro_step, optimizer_steps
    from tests.workers.step_gradients import train_rows

    torch.manual_seed(0)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    tdist.init_process_group("gloo", rank=rank, world_size=world)
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    cfg = load_config("configs/local_tiny.yaml", [f"model.path={model_dir}", *overrides])
    ctx = SimpleNamespace(cfg=cfg, iteration=0, rank=rank, world_size=world)
    model = load_policy(model_dir, "float32")
    packing.use_packed_attention(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(ctx))
    norm = flat_grad_norm(ctx, engine)
    records = []
    for step in optimizer_steps(train_rows(24, seed=3), ctx):
        pending = []
        for micro in step.micro_batches:
            loss, metrics = micro_step(engine, None, packing.pack(micro, torch.device("cpu")), cfg.train, 1.0)
            pending.append({"loss": loss.detach(), **metrics})
            engine.step()
        records.append(_step_record(engine, pending, 0, norm))
    if rank == 0:
        weights = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
        torch.save({"weights": weights, "records": records}, out)
    tdist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
