"""A single data-parallel rank's ZeRO 1-2 step without the gradient reduction that has nothing to reduce.

With contiguous_gradients off (configs/ds_zero2_gpu.json), ZeRO 1-2 reduces each bucket of gradients
as the backward produces them: it flattens the bucket into a new tensor, divides it by the number of
ranks, all-reduces it, and copies each parameter's slice back into that parameter's gradient. On one
rank none of that changes a value (a division by one, a sum over one rank), yet it copies every
gradient twice and launches a kernel per parameter, each optimizer step. DeepSpeed already skips its
weights' all-gather on a single rank for the same reason; this skips the reduction too. The
gradients stay where the backward left them, which is where ZeRO's accumulation and optimizer step
read them (the bookkeeping around the reduction runs as before).
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("syncrl.train")


def skip_gradient_reduction(engine) -> bool:
    """Make `engine`'s ZeRO 1-2 optimizer skip its bucket reduction where it is the identity: one
    data-parallel rank, no sequence parallelism, gradients not in contiguous buffers (that path
    reduces in place and is left as it is), no offload. Returns whether it now skips."""
    zero = engine.optimizer
    if not hasattr(zero, "buffered_reduce_fallback") or not hasattr(zero, "single_partition_of_fp32_groups"):
        return False  # not DeepSpeed's ZeRO 1-2 optimizer (stage 0 or 3, or another DeepSpeed)
    if (not torch.distributed.is_initialized()
            or torch.distributed.get_world_size(group=zero.dp_process_group) != 1
            or getattr(zero, "sequence_parallel_size", 1) != 1
            or zero.contiguous_gradients or zero.cpu_offload):
        return False
    zero.buffered_reduce_fallback = _nothing_to_reduce
    log.info("one data-parallel rank: ZeRO's gradient reduction skipped (it would divide by one and sum over one "
             "rank, copying every gradient twice)")
    return True


def _nothing_to_reduce(rank, grads, communication_data_type, elements_per_buffer=500000000, log=None):
    """ZeRO 1-2's buffered_reduce_fallback on one rank: the gradients are already reduced."""
