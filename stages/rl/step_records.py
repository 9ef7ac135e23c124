"""Each optimizer step's record: the means of its micro-batches' loss and metrics, its gradient norm,
learning rate and tokens, read on the host once the step is launched.

Reading the values makes the host wait for the GPU to finish the step; the stacked means come back
in one copy rather than one per value.
"""

from __future__ import annotations

import torch


def step_record(engine, pending: list[dict], tokens: int, norm=None) -> dict:
    """The record of the optimizer step `engine` just took over `tokens` loss tokens. `pending`: its
    micro-batches' loss and metric tensors (averaged); `norm`: train's flat gradient norm
    (stages/rl/grad_norm.FlatGradNorm), or None where DeepSpeed's is the one."""
    value = norm.norm if norm is not None else None
    return record(pending, host_fields(engine, tokens, value is not None), value)


def record(pending: list[dict], fields: dict, norm: torch.Tensor | None = None) -> dict:
    """The means of `pending`'s values, `norm` as grad_norm where given, and `fields` (what the host
    knows of the step)."""
    keys = list(pending[0])
    values = torch.stack([torch.stack([m[k].float() for k in keys]) for m in pending]).mean(0)
    if norm is not None:
        keys, values = keys + ["grad_norm"], torch.cat([values, norm.reshape(1).to(values)])
    return {**dict(zip(keys, values.tolist())), **fields}


def host_fields(engine, tokens: int, has_norm: bool) -> dict:
    """What the host knows of the optimizer step `engine` just took: its tokens, number and learning
    rate, DeepSpeed's gradient norm unless the record has its own (`has_norm`), and whether
    DeepSpeed's overflow check skipped it (the flag is the last step's, so it is taken now)."""
    fields = {"tokens": tokens, "step": engine.global_steps}
    if not has_norm:
        value = engine.get_global_grad_norm()
        fields["grad_norm"] = float(value) if value is not None else None
    lr = engine.get_lr()
    fields["lr"] = lr[0] if lr else None
    fields["skipped"] = bool(getattr(engine.optimizer, "overflow", False))
    return fields
