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

from stages.rl import serialization

# torch dtype name -> safetensors' name, for the dtypes a policy's weights come in.
DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64", "int64": "I64",
          "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


def write(weights: dict, path: Path, threads: int | None = None) -> Path:
    """Write `weights` (name -> host tensor) to `path` through a temporary name; tied tensors once."""
    unique, seen = {}, set()
    for name, tensor in weights.items():
        if tensor.data_ptr() in seen:
            continue  # tied to a weight already written
        seen.add(tensor.data_ptr())
        unique[name] = tensor.contiguous()
    tmp = path.with_name(f".{path.name}.tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    if all(str(t.dtype).removeprefix("torch.") in DTYPES for t in unique.values()):
        write_threaded(unique, tmp, threads)
    else:
        from safetensors.torch import save_file

        save_file(unique, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)
    return path


def write_threaded(tensors: dict, path: Path, threads: int | None = None) -> None:
    """The safetensors file of `tensors` (contiguous, dtypes of DTYPES), as transformers writes a
    model's weights (save links it in), its bytes written by several threads: on the critical
    path, one writer of a multi-GB file into the page cache sets the pace, not the storage."""
    header, ranges, end = {}, [], 0
    for name, t in tensors.items():
        size = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPES[str(t.dtype).removeprefix("torch.")], "shape": list(t.shape),
                        "data_offsets": [end, end + size]}
        start = t.storage_offset() * t.element_size()
        ranges.append((t.untyped_storage(), start, size, end - start))
        end += size
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors lays it out
    data = 8 + len(text)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        f.truncate(data + end)
    serialization.write_ranges(str(path), [(s, start, n, data + at) for s, start, n, at in ranges], threads)


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
