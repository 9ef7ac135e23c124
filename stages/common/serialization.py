"""torch.save / torch.load settings for the DeepSpeed checkpoint that train writes and reads every iteration.

Both sides sit on the iteration's critical path (train writes, save consolidates, the next train
resumes), and DeepSpeed's default checkpoint engine goes through torch.save / torch.load, so their
process-wide settings apply to it. tests/benchmarks/checkpoint_io.py measures each setting.

- No CRC-32 on write: torch.load does not check it (a flipped byte in a tensor loads silently), so
  it costs a pass over every byte and protects nothing; completeness is the marker's job (sizes).
- Memory-mapped reads (optional): tensors come straight from the page cache that train's write just
  filled, instead of being read into freshly allocated host memory first.
"""

from __future__ import annotations

import contextlib
import logging

log = logging.getLogger("syncrl.serialization")


@contextlib.contextmanager
def checkpoint_io(mmap: bool):
    """Apply the settings for the duration of a checkpoint write or read; torch without them keeps its defaults."""
    try:
        from torch.utils.serialization import config
    except ImportError:
        config = None
    if config is None or not (hasattr(config.save, "compute_crc32") and hasattr(config.load, "mmap")):
        log.info("this torch has no save.compute_crc32 / load.mmap setting: checkpoint I/O keeps its defaults")
        yield
        return
    with config.patch(**{"save.compute_crc32": False, "load.mmap": bool(mmap)}):
        yield
