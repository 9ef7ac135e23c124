"""What a safetensors file holds, read from its header alone: no torch, no tensor data. The file
starts with the header's length (8 bytes, little-endian), then the header, a JSON object of
name -> {dtype, shape, data_offsets} and an optional "__metadata__"."""

from __future__ import annotations

import json
from pathlib import Path

# Headers of real checkpoints are well under this; a larger length means the file is not one.
MAX_HEADER = 1 << 30


def layout(path: Path) -> dict[str, tuple[str, tuple[int, ...]]] | None:
    """Name -> (dtype as safetensors spells it, e.g. "BF16"; shape) of each tensor in the file; None
    where the file is absent or not safetensors."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 0 < size < MAX_HEADER:
                return None
            header = json.loads(f.read(size))
    except (OSError, ValueError):
        return None
    return {k: (v["dtype"], tuple(v["shape"])) for k, v in header.items() if k != "__metadata__"}
