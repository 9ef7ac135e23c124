"""The policy's weights as one safetensors file under the train folder (paths.train_policy), for
save to link into models/iter_I instead of consolidating a DeepSpeed checkpoint.

Train writes it where save could not otherwise read the weights in time: before a checkpoint that
reaches the disk after train's marker (tuning.deferred_checkpoint), and under ZeRO-3 with node-local
checkpoints, whose weights are spread over every node's shards while save runs as one task on one
node. The file holds the module's weights in the training dtype under the module's names, a tied
weight once (save's export ties it again), as transformers writes a model's weights file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


# safetensors' names of the dtypes a policy's weights come in.
DTYPE_NAMES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64", "int64": "I64",
               "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def write(weights: dict, path: Path, threads: int = 8) -> Path:
    """Write `weights` (name -> host tensor) to `path` through a temporary name; tied tensors once.

    The file is what safetensors' save_file writes (header, then each tensor's bytes), but its bytes
    go from the tensors straight to the file, `threads` writers at a time (serialization's chunked
    writes): save_file first assembles the whole file in memory, a second copy of the weights that
    a single thread makes and writes, on train's critical path before its marker."""
    from stages.rl.serialization import write_tensor_bytes

    unique, seen = {}, set()
    for name, tensor in weights.items():
        if tensor.data_ptr() in seen:
            continue  # tied to a weight already written
        seen.add(tensor.data_ptr())
        unique[name] = tensor.contiguous()
    header, end = {"__metadata__": {"format": "pt"}}, 0  # as transformers writes it: save links it in
    for name, tensor in unique.items():
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": DTYPE_NAMES[str(tensor.dtype).removeprefix("torch.")], "shape": list(tensor.shape),
                        "data_offsets": [end, end + size]}
        end += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors pads it
    start = 8 + len(blob)
    tmp = path.with_name(f".{path.name}.tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        f.truncate(start + end)
    write_tensor_bytes(tmp, [(t, start + header[n]["data_offsets"][0]) for n, t in unique.items()], threads)
    os.replace(tmp, path)
    return path


def write_gathered(engine, path: Path, writer: bool, threads: int = 8) -> Path | None:
    """Under ZeRO-3: gather each parameter from every rank's partition in turn (one parameter whole
    on the GPU at a time, so any model size fits) and have the `writer` rank write the file. Every
    rank must call it (each gather is a collective); returns the path on the writer, else None."""
    import deepspeed

    weights = {}
    for name, param in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            if writer:
                weights[name] = param.detach().to("cpu", copy=True)
    return write(weights, path, threads) if writer else None
