"""One rank of tests/test_train_batching.py: the gradient of train's first optimizer step, written to a file.

Run as `python -m tests.workers.step_gradients MODEL_DIR OUT_FILE key=value ... [-- OUT_FILE key=value ...]`
with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set; each OUT_FILE's settings in turn, each with an
engine of its own over the model as loaded from MODEL_DIR. Builds train's real DeepSpeed engine (stages.train's
config and optimizer-step plan, gloo on CPU) over a fixed synthetic train set, runs the first
optimizer step's micro-batches (right-padded, or packed with tuning.remove_padding) through
stages.train.micro_step, and rank 0 saves every parameter's full fp32 gradient
(deepspeed.utils.safe_get_full_grad) as it stands at the step's boundary, then takes the step and
saves the names of the parameters whose storage it moved.
"""

from __future__ import annotations

import os
import random
import sys
from types import SimpleNamespace

import torch


def train_rows(n: int = 12, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        p, c = rng.randint(2, 6), rng.randint(1, 20)  # lengths that vary: groupings differ
        rows.append({"prompt_ids": [rng.randint(4, 90) for _ in range(p)],
                     "completion_ids": [rng.randint(4, 90) for _ in range(c)],
                     "logprobs": [-rng.uniform(2.0, 6.0) for _ in range(c)],
                     "advantage": rng.uniform(-1.5, 1.5), "prompt_id": f"p{i}"})
    return rows


def train_engine(model_dir: str, overrides: list[str]):
    """This rank's process group (gloo, from RANK and WORLD_SIZE) and train's DeepSpeed engine over the
    model in `model_dir`, with local_tiny.yaml and `overrides`; returns (run config, stage context, engine)."""
    import deepspeed
    import torch.distributed as tdist

    from stages.rl import packing
    from stages.rl.modeling import load_policy
    from stages.runtime.config import load_config
    from stages.train import deepspeed_config

    torch.manual_seed(0)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not tdist.is_initialized():  # the process's first engine
        tdist.init_process_group("gloo", rank=rank, world_size=world)
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    cfg = load_config("configs/local_tiny.yaml", [f"model.path={model_dir}", *overrides])
    ctx = SimpleNamespace(cfg=cfg, iteration=0, rank=rank, world_size=world)
    model = load_policy(model_dir, "float32")
    if cfg.tuning.remove_padding:
        packing.use_packed_attention(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=deepspeed_config(ctx))
    return cfg, ctx, engine


def main() -> int:
    model_dir, *args = sys.argv[1:]
    runs = [[]]
    for arg in args:
        if arg == "--":
            runs.append([])
        else:
            runs[-1].append(arg)
    for out, *overrides in runs:
        step_gradients(model_dir, out, overrides)
    return 0


def step_gradients(model_dir: str, out: str, overrides: list[str]) -> None:
    import torch.distributed as tdist
    from deepspeed.utils import safe_get_full_grad

    from stages.rl.steps import optimizer_steps
    from stages.train import micro_step
    from stages.rl import packing
    from stages.rl.batches import collate

    cfg, ctx, engine = train_engine(model_dir, overrides)
    batch_of = packing.pack if cfg.tuning.remove_padding else collate
    storage = {name: p.data_ptr() for name, p in engine.module.named_parameters()}
    step = optimizer_steps(train_rows(), ctx)[0]
    for i, micro in enumerate(step.micro_batches):
        if step.normalizer is not None:
            engine.set_gradient_accumulation_boundary(i == len(step.micro_batches) - 1)
        micro_step(engine, None, batch_of(micro, torch.device("cpu")), cfg.train, 1.0, step.normalizer)
        if i < len(step.micro_batches) - 1:
            engine.step()  # not a boundary: accumulates only
    grads = {name: safe_get_full_grad(p).clone() for name, p in engine.module.named_parameters()}
    engine.step()
    # The optimizer step updates each parameter in place: what holds a view of one (the fused layers'
    # adjacent q/k/v weights) keeps reading the current weights.
    moved = [name for name, p in engine.module.named_parameters() if p.data_ptr() != storage[name]]
    if ctx.rank == 0:
        torch.save({"grads": grads, "micro_batches": [len(m) for m in step.micro_batches],
                    "steps": len(optimizer_steps(train_rows(), ctx)), "moved": moved}, out)
    tdist.barrier()
    engine.destroy()


if __name__ == "__main__":
    sys.exit(main())
