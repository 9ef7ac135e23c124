"""The policy's weights as one safetensors file under the train folder (paths.train_policy), for
save to link into models/iter_I instead of consolidating a DeepSpeed checkpoint.

Train writes it where save could not otherwise read the weights in time: before a checkpoint that
reaches the disk after train's marker (tuning.deferred_checkpoint), and under ZeRO-3 with node-local
checkpoints, whose weights are spread over every node's shards while save runs as one task on one
node. The file holds the module's weights in the training dtype under the module's names, a tied
weight once (save's export ties it again), as transformers writes a model's weights file.
"""

from __future__ import annotations

import os
from pathlib import Path


def write(weights: dict, path: Path) -> Path:
    """Write `weights` (name -> host tensor) to `path` through a temporary name; tied tensors once."""
    from safetensors.torch import save_file

    unique, seen = {}, set()
    for name, tensor in weights.items():
        if tensor.data_ptr() in seen:
            continue  # tied to a weight already written
        seen.add(tensor.data_ptr())
        unique[name] = tensor.contiguous()
    tmp = path.with_name(f".{path.name}.tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(unique, str(tmp), metadata={"format": "pt"})  # as transformers writes it: save links it in
    os.replace(tmp, path)
    return path


def write_gathered(engine, path: Path, writer: bool) -> Path | None:
    """Under ZeRO-3: gather each parameter from every rank's partition in turn (one parameter whole
    on the GPU at a time, so any model size fits) and have the `writer` rank write the file. Every
    rank must call it (each gather is a collective); returns the path on the writer, else None."""
    import deepspeed

    weights = {}
    for name, param in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            if writer:
                weights[name] = param.detach().to("cpu", copy=True)
    return write(weights, path) if writer else None
