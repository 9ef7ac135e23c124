"""One process of tests/test_checkpoint_prefetch.py: a DeepSpeed checkpoint resumed as DeepSpeed reads
it, and from the files read ahead (stages/rl/checkpoint_prefetch.py); both engines then take one more
optimizer step. Writes what it found as JSON.

Run as `python -m tests.workers.resume_read_ahead MODEL_DIR WORK_DIR` with RANK=0, WORLD_SIZE=1,
MASTER_ADDR and MASTER_PORT set (gloo on CPU).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch


def main() -> int:
    model_dir, work = sys.argv[1], Path(sys.argv[2])
    import deepspeed
    import torch.distributed as tdist

    from stages.rl import checkpoint_prefetch
    from stages.rl.batches import collate
    from stages.rl.deferred_checkpoint import tensors_in
    from stages.rl.modeling import load_policy
    from stages.runtime.config import load_config
    from stages.train import deepspeed_config, micro_step, optimizer_steps
    from tests.workers.step_gradients import train_rows

    tdist.init_process_group("gloo", rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    cfg = load_config("configs/local_tiny.yaml", [f"model.path={model_dir}", "train.micro_batch_size=4"])
    ctx = SimpleNamespace(cfg=cfg, iteration=0, rank=0, world_size=1)
    steps = optimizer_steps(train_rows(), ctx)

    def engine():  # as train builds it: its DeepSpeed config, torch's AdamW where the config names none
        model = load_policy(model_dir, "float32")
        ds = deepspeed_config(ctx)
        optimizer = None if "optimizer" in ds else torch.optim.AdamW(model.parameters(), lr=cfg.train.lr)
        e, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds,
                                     model_parameters=None if optimizer else model.parameters())
        return e

    def step(e, s):
        for micro in s.micro_batches:
            micro_step(e, None, collate(micro, torch.device("cpu")), cfg.train, 1.0, s.normalizer)
        e.step()

    def state(e):
        return [t.detach().clone() for t in tensors_in([e.module.state_dict(), e.optimizer.state_dict()])
                if torch.is_tensor(t)]

    first = engine()
    for s in steps[:2]:
        step(first, s)
    first.save_checkpoint(str(work), tag="iter_00000", save_latest=False)
    folder = work / "iter_00000"

    read = engine()
    read.load_checkpoint(str(work), tag="iter_00000")

    prefetch = checkpoint_prefetch.Prefetch()
    files = sorted(folder.glob("*optim_states.pt")) + [folder / "mp_rank_00_model_states.pt"]
    prefetch.start(lambda: True, lambda: files, lambda: 1 << 40, None)
    ahead = engine()
    with prefetch.serving(ahead, timeout_s=60):
        ahead.load_checkpoint(str(work), tag="iter_00000")

    same = [torch.equal(a, b) for a, b in zip(state(read), state(ahead))]
    step(read, steps[2])
    step(ahead, steps[2])
    after = [torch.equal(a, b) for a, b in zip(state(read), state(ahead))]
    (work / "result.json").write_text(json.dumps({
        "tensors": len(same), "same": all(same), "same_after_a_step": all(after), "figures": prefetch.figures,
        "files": [f.name for f in files]}))
    tdist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
