"""torch.save / torch.load settings for the DeepSpeed checkpoint that train writes and reads every iteration.

Both sides sit on the iteration's critical path (train writes, save consolidates, the next train
resumes), and DeepSpeed's default checkpoint engine goes through torch.save / torch.load, so their
process-wide settings apply to it. tests/benchmarks/checkpoint_io.py measures each setting.

- No CRC-32 on write: torch.load does not check it (a flipped byte in a tensor loads silently), so
  it costs a pass over every byte and protects nothing; completeness is the marker's job (sizes).
- Device-to-host copies into pinned memory: one GPU tensor at a time, so the pinned buffer is the
  size of the largest tensor (a ZeRO flat partition), not of the checkpoint.
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
    settings = {"save.compute_crc32": False, "save.use_pinned_memory_for_d2h": True, "load.mmap": bool(mmap)}
    if config is None or not all(hasattr(getattr(config, k.split(".")[0]), k.split(".")[1]) for k in settings):
        log.info("this torch lacks one of %s: checkpoint I/O keeps its defaults", ", ".join(settings))
        yield
        return
    with config.patch(**settings):
        yield
