"""Each optimizer step's record (the means of its micro-batches' loss and metrics, its gradient norm,
learning rate and tokens), read from the GPU one step late.

Reading a value on the host makes the host wait until the GPU has run everything queued before it.
Read right after its own step, every step's record left the GPU idle while the host packed and
launched the next micro-batch. Here a step's values are copied to host memory behind its own work
and read once the next step is queued: by then the copy is done, or is the next thing the GPU does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class _Staged:
    keys: list
    values: torch.Tensor  # on the host; filled once `done` is reached
    done: object  # a CUDA event recorded after the copy, or None on the host
    fields: dict  # what the host already knows: tokens, step, lr, DeepSpeed's norm, skipped


class StepRecords:
    """`add` each optimizer step once it is launched; it returns the step before's record (None for
    the first); `last` returns the final step's."""

    def __init__(self):
        self._staged: _Staged | None = None

    def add(self, pending: list[dict], fields: dict, norm: torch.Tensor | None = None) -> dict | None:
        """Stage the step just launched and return the one before's record. `pending`: its
        micro-batches' loss and metric tensors (averaged); `fields`: what the host knows of it
        (host_fields); `norm`: its gradient norm as a tensor, where it is one."""
        previous, self._staged = self._staged, _stage(pending, fields, norm)
        return None if previous is None else _read(previous)

    def add_step(self, engine, pending: list[dict], tokens: int, norm=None) -> dict | None:
        """`add` for the optimizer step `engine` just took over `tokens` loss tokens; `norm`: train's
        flat gradient norm (stages/rl/grad_norm.FlatGradNorm), or None where DeepSpeed's is the one."""
        value = norm.norm if norm is not None else None
        return self.add(pending, host_fields(engine, tokens, value is not None), value)

    def last(self) -> dict | None:
        """The last staged step's record (waits for the GPU to reach it)."""
        staged, self._staged = self._staged, None
        return None if staged is None else _read(staged)


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


def _stage(pending: list[dict], fields: dict, norm: torch.Tensor | None) -> _Staged:
    keys = list(pending[0])
    values = torch.stack([torch.stack([m[k].float() for k in keys]) for m in pending]).mean(0)
    if norm is not None:
        keys, values = keys + ["grad_norm"], torch.cat([values, norm.reshape(1).to(values)])
    done = None
    if values.is_cuda:
        # To page-locked host memory without waiting; the event marks when it has landed.
        values = values.to("cpu", non_blocking=True)
        done = torch.cuda.Event()
        done.record()
    return _Staged(keys, values, done, fields)


def _read(staged: _Staged) -> dict:
    if staged.done is not None:
        staged.done.synchronize()
    return {**dict(zip(staged.keys, staged.values.tolist())), **staged.fields}
