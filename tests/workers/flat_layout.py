"""One rank of tests/test_fused_layers.py's layout test: whether train's DeepSpeed engine keeps each
layer's q, k, v weights and its gate, up weights back to back (so tuning.fused_layers takes them as
one view, stages/rl/fused_layers.py), before and after an optimizer step.

Run as `python -m tests.workers.flat_layout MODEL_DIR OUT_FILE key=value ...` with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set; rank 0 saves {"before": [...], "after": [...]}, one pair of booleans
(attention, MLP) per decoder layer.
"""

from __future__ import annotations

import sys

import torch


def layout(model) -> list:
    from stages.rl.fused_layers import adjacent

    return [(adjacent([layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight]),
             adjacent([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight])) for layer in model.model.layers]


def main() -> int:
    model_dir, out, *overrides = sys.argv[1:]
    import torch.distributed as tdist

    from stages.rl import packing
    from stages.rl.steps import optimizer_steps
    from stages.train import micro_step
    from tests.workers.step_gradients import train_engine, train_rows

    cfg, ctx, engine = train_engine(model_dir, overrides)
    before = layout(engine.module)
    step = optimizer_steps(train_rows(), ctx)[0]
    for micro in step.micro_batches:
        micro_step(engine, None, packing.pack(micro, torch.device("cpu")), cfg.train, 1.0)
        engine.step()
    if ctx.rank == 0:
        torch.save({"before": before, "after": layout(engine.module)}, out)
    tdist.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
