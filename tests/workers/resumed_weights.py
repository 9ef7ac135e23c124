"""One rank of tests/test_train_checkpoint.py: train's set-up of iteration 1 in a finished run dir,
the policy it builds without its weights filled with NaN as it is built, so that any weight the
resumed checkpoint does not set shows. Rank 0 saves the weights the engine holds after the resume,
under ZeRO 1-2 its optimizer's fp32 master partitions and Adam moments, and whether set-up built the
policy so.

Run as `python -m tests.workers.resumed_weights RUN_DIR OUT_FILE` with RANK, WORLD_SIZE, MASTER_ADDR
and MASTER_PORT set.
"""

from __future__ import annotations

import sys

import torch


def main() -> int:
    run_dir, out = sys.argv[1:]
    import deepspeed
    import torch.distributed as tdist

    from stages import train
    from stages.runtime.stage import make_context

    built, build = [], train.build_policy

    def poisoned(*args, **kwargs):
        model = build(*args, **kwargs)
        with torch.no_grad():
            for p in model.parameters():  # under ZeRO-3 each rank's shard
                getattr(p, "ds_tensor", p).fill_(float("nan"))
        built.append(True)
        return model

    train.build_policy = poisoned
    ctx = make_context("train", run_dir, 1, waiting=True)
    run = train.set_up(ctx)
    params = dict(run.engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):  # ZeRO-3's shards whole; else nothing
        weights = {name: p.detach().clone() for name, p in params.items()}
    optimizer = run.engine.optimizer
    state = {}
    if hasattr(optimizer, "single_partition_of_fp32_groups"):  # ZeRO 1-2: this rank's fp32 master and moments
        groups = optimizer.single_partition_of_fp32_groups
        state = {"fp32": [t.detach().cpu().clone() for t in groups],
                 "moments": [{k: v.detach().cpu().clone() for k, v in optimizer.optimizer.state[t].items()
                              if torch.is_tensor(v) and v.numel() > 1} for t in groups]}
    if ctx.rank == 0:
        from stages.rl.serialization import copies_in_place

        state["copies_in_place"] = copies_in_place(optimizer)
        torch.save({"built": bool(built), "weights": weights, "optimizer": state,
                    "device": str(next(run.engine.module.parameters()).device)}, out)
    tdist.barrier()
    return 0


if __name__ == "__main__":
    from stages.runtime.stage import exit_now

    # As a stage ends: without the interpreter's teardown, where the engine's threads (ZeRO-3's) may
    # still be torn down and abort the process after its work is done.
    exit_now(main())
