"""tuning.grad_norm: flat — the gradient norm and its clipping on ZeRO's flat fp32 partition.

DeepSpeed's ZeRO 1-2 step takes the norm one parameter at a time (a dtype copy and a norm each: two
kernels and a dozen Python calls per parameter; tests/benchmarks/train_mfu.py's nonorm variant
measures what that costs). The same norm is one multi-tensor norm of the flat fp32 gradient
partition that the step hands its optimizer, then one all-reduce over the data-parallel ranks
(their partitions are disjoint). The clipping is DeepSpeed's: gradients scaled by
min(1, max_norm / (norm + 1e-6)); a non-finite norm is reported as it is.

DeepSpeed's own norm and clipping are turned off for it (zero_optimization.compute_grad_norm false,
gradient_clipping 0: deepspeed_settings); the norm is read back through FlatGradNorm.norm.

It reaches into the ZeRO optimizer's attributes (its flat fp32 groups, its inner optimizer's step),
which are not DeepSpeed's public interface: it runs only on the DeepSpeed releases it was checked
against (CHECKED_DEEPSPEED; tests/test_grad_norm.py pins the installed one to them).
"""

from __future__ import annotations

import torch

# DeepSpeed releases whose ZeRO 1-2 optimizer FlatGradNorm was checked against: [first, last).
CHECKED_DEEPSPEED = ((0, 15), (0, 20))


def checked_release(version: str) -> bool:
    """Whether DeepSpeed `version` ("0.19.8", "0.20.0rc1") is within CHECKED_DEEPSPEED."""
    major_minor = tuple(int(part) for part in version.split(".")[:2])
    return CHECKED_DEEPSPEED[0] <= major_minor < CHECKED_DEEPSPEED[1]


def deepspeed_settings(ds: dict) -> dict:
    """`ds` (a DeepSpeed config) with DeepSpeed's own gradient norm and clipping off."""
    ds = {**ds, "gradient_clipping": 0.0}
    ds["zero_optimization"] = {**ds.get("zero_optimization", {}), "compute_grad_norm": False}
    return ds


class FlatGradNorm:
    """Norm and clip at `max_norm` (0: no clipping) inside `engine`'s ZeRO 1-2 optimizer step, on its
    flat fp32 partition, just before the optimizer updates the weights."""

    def __init__(self, engine, max_norm: float):
        import deepspeed

        if not checked_release(deepspeed.__version__):
            low, high = (".".join(map(str, v)) for v in CHECKED_DEEPSPEED)
            raise ValueError(f"tuning.grad_norm=flat reaches into DeepSpeed's ZeRO optimizer, checked against releases "
                             f"{low} to before {high}; this is DeepSpeed {deepspeed.__version__}: set "
                             "tuning.grad_norm=deepspeed")
        zero = engine.optimizer
        groups = getattr(zero, "single_partition_of_fp32_groups", None)
        if groups is None or getattr(zero, "cpu_offload", False):
            raise ValueError(f"tuning.grad_norm=flat needs DeepSpeed's ZeRO stage 1 or 2 optimizer without offload; "
                             f"this engine has {type(zero).__name__}: set tuning.grad_norm=deepspeed")
        if len(groups) != 1:
            # The step hands its optimizer one group at a time: the first would be clipped before
            # the others' gradients exist.
            raise ValueError(f"tuning.grad_norm=flat takes one parameter group; this optimizer has {len(groups)}: "
                             "set tuning.grad_norm=deepspeed")
        self.max_norm = max_norm
        self.process_group = zero.dp_process_group
        self.norm: torch.Tensor | None = None  # the last step's, on the device (read once per step record)
        self._optimizer = zero.optimizer
        self._step = zero.optimizer.step
        zero.optimizer.step = self._clipped_step

    def _clipped_step(self, *args, **kwargs):
        grads = [p.grad for group in self._optimizer.param_groups for p in group["params"] if p.grad is not None]
        self.norm = clip_(grads, self.max_norm, self.process_group)
        return self._step(*args, **kwargs)


def clip_(grads: list[torch.Tensor], max_norm: float, process_group=None) -> torch.Tensor:
    """The norm of `grads` (summed over `process_group`'s ranks, each holding a partition), and the
    gradients scaled in place to at most `max_norm` (0: not clipped); the norm stays on the device."""
    squares = torch.stack(torch._foreach_norm(grads)).float().square().sum()
    if torch.distributed.is_initialized() and torch.distributed.get_world_size(process_group) > 1:
        torch.distributed.all_reduce(squares, group=process_group)
    norm = squares.sqrt()
    if max_norm > 0:
        # No host sync: the factor stays on the device, 1 when the norm is within the bound.
        torch._foreach_mul_(grads, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm
