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

A file that must be written before the marker (parallel_save) is torch.save's own file, its tensors'
bytes written by several threads (write_ranges: any part of them, in any order, into the layout
archive_layout writes): torch.save copies each GPU tensor whole into newly allocated host
memory and writes it from one thread, so at 3B (tensors of several GB) the allocation and the single
writer set the pace, not the disk.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pickle
import threading
import time

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


class ThreadedWrites:
    """DeepSpeed's torch checkpoint engine, each file it saves written by parallel_save; everything
    else (loads, directories, commits) the wrapped engine's."""

    def __init__(self, inner, threads: int):
        self.inner, self.threads = inner, threads

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def save(self, state_dict, path: str) -> None:
        t0 = time.time()
        if not parallel_save(state_dict, path, self.threads):
            self.inner.save(state_dict, path)
            return
        size, seconds = os.path.getsize(path), time.time() - t0
        log.info("%s: %.2f GB written by %d threads in %.1fs (%.2f GB/s)", path, size / 1e9, self.threads, seconds,
                 size / 1e9 / max(seconds, 1e-9))


@contextlib.contextmanager
def threaded_writes(owner, attr: str, threads: int):
    """For the duration, `owner`'s checkpoint engine (its attribute `attr`) writes through
    ThreadedWrites where it is DeepSpeed's torch engine writing torch's zip format."""
    inner = getattr(owner, attr)
    try:
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    except ImportError:
        TorchCheckpointEngine = None
    if threads > 0 and TorchCheckpointEngine is not None and isinstance(inner, TorchCheckpointEngine) \
            and inner.zipfile_serialization:
        setattr(owner, attr, ThreadedWrites(inner, threads))
    try:
        yield
    finally:
        setattr(owner, attr, inner)


# Bytes one thread copies and writes at a time (its page-locked staging buffer for GPU tensors).
CHUNK_BYTES = 64 << 20


def parallel_save(obj, path: str, threads: int | None = None) -> bool:
    """torch.save(obj, path), the tensors' bytes written by `threads` threads in chunks, each GPU
    chunk through its thread's page-locked buffer. Returns False, having written nothing, where this
    torch lacks what it needs (the caller then calls torch.save)."""
    layout = archive_layout(obj, path)
    if layout is None:
        return False
    write_ranges(path, [(storage, 0, storage.nbytes(), offset) for storage, offset in layout], threads)
    return True


def archive_layout(obj, path: str) -> list | None:
    """torch.save's file of `obj` at `path` without the tensors' bytes (holes where they go), and
    (storage, file offset) for each of its distinct storages; None, having written nothing, where
    this torch lacks what it needs."""
    import torch

    if not (hasattr(torch.serialization, "skip_data") and hasattr(torch._C.PyTorchFileReader, "get_record_offset")):
        return None
    storages = storage_order(obj)
    with torch.serialization.skip_data():
        torch.save(obj, path)
    reader = torch._C.PyTorchFileReader(path)
    names = [n for n in reader.get_all_records() if n.startswith("data/") and n[5:].isdigit()]
    offsets = [reader.get_record_offset(f"data/{i}") for i in range(len(storages))]
    del reader
    if len(names) != len(storages) or any(a + s.nbytes() > b for a, s, b in
                                          zip(offsets, storages, offsets[1:] + [os.path.getsize(path)])):
        raise RuntimeError(f"{path}: the archive's {len(names)} tensor records do not match the "
                           f"{len(storages)} storages found in the object")
    return list(zip(storages, offsets))


def write_ranges(path: str, ranges: list, threads: int | None = None) -> None:
    """Bytes of storages into the file archive_layout laid out: each (storage, start, bytes, its record's
    offset), bytes [start, start + bytes) of the storage, in CHUNK_BYTES pieces by `threads` threads."""
    import torch

    work = [(s, record + start, start, min(CHUNK_BYTES, first + n - start))
            for s, first, n, record in ranges for start in range(first, first + n, CHUNK_BYTES)]
    # The threads copy on streams of their own: what the caller's stream still computes into these
    # tensors (the optimizer step) must be done first, as torch.save's copies on that stream would wait.
    for device in {s.device for s, *_ in ranges if s.device.type == "cuda"}:
        torch.cuda.current_stream(device).synchronize()
    fd = os.open(path, os.O_WRONLY)
    try:
        _write_chunks(fd, work, threads or min(8, os.cpu_count() or 1))
    finally:
        os.close(fd)


def storage_order(obj) -> list:
    """The distinct storages of `obj` in the order torch.save numbers them: the order its pickler
    first meets them (the same traversal, its persistent ids dropped)."""
    import torch

    seen: dict = {}

    class Order(pickle.Pickler):
        def persistent_id(self, o):
            if isinstance(o, torch.storage.TypedStorage) or torch.is_storage(o):
                storage = o._untyped_storage if isinstance(o, torch.storage.TypedStorage) else o
                seen.setdefault(storage._cdata, storage)
                return ("storage", len(seen))
            return None

    Order(io.BytesIO(), protocol=torch.serialization.DEFAULT_PROTOCOL).dump(obj)
    return list(seen.values())


def storage_bytes(storage):
    """The storage's bytes as a one-dimensional uint8 tensor on its device."""
    import torch

    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _write_chunks(fd: int, work: list, threads: int) -> None:
    """Each (storage, file offset, storage offset, bytes) by one of `threads` threads; the first error stops all."""
    import torch

    lock, errors, items = threading.Lock(), [], iter(work)

    def worker() -> None:
        staging, stream = None, None
        while not errors:
            with lock:
                item = next(items, None)
            if item is None:
                return
            storage, at, start, size = item
            try:
                source = storage_bytes(storage)[start:start + size]
                if source.device.type not in ("cpu", "cuda"):
                    source = source.cpu()
                elif source.device.type == "cuda":
                    if staging is None:
                        staging = torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True)
                        stream = torch.cuda.Stream(source.device)
                    with torch.cuda.stream(stream):
                        staging[:size].copy_(source, non_blocking=True)
                    stream.synchronize()
                    source = staging[:size]
                view, written = memoryview(source.numpy()).cast("B"), 0
                while written < size:  # a write may take fewer bytes than asked
                    written += os.pwrite(fd, view[written:], at + written)
            except BaseException as e:  # noqa: BLE001 (handed to the caller's thread)
                errors.append(e)
                return

    pool = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if errors:
        raise errors[0]
