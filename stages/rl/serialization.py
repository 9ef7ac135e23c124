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
import copy
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

    def worker(take) -> None:
        staging, stream = None, None
        while (item := take()) is not None:
            storage, at, start, size = item
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

    in_threads(work, threads, worker)


def in_threads(items, threads: int, worker) -> None:
    """worker(take) in each of `threads` threads, take() giving the next of `items` (None once they
    are all taken or a thread has failed); the first error is raised here, in the caller's thread."""
    lock, errors, items = threading.Lock(), [], iter(items)

    def take():
        with lock:
            return None if errors else next(items, None)

    def run() -> None:
        try:
            worker(take)
        except BaseException as e:  # noqa: BLE001 (handed to the caller's thread)
            errors.append(e)

    pool = [threading.Thread(target=run, daemon=True) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if errors:
        raise errors[0]


class StagedLoads:
    """DeepSpeed's checkpoint engine, each file it loads moved to the GPU by to_device before
    DeepSpeed copies it into the engine; everything else the wrapped engine's."""

    def __init__(self, inner, device, threads: int, spare_largest: bool = True):
        self.inner, self.device, self.threads, self.spare_largest = inner, device, threads, spare_largest
        self.last = None  # (path, state): DeepSpeed loads the model file twice in a row, once to check it

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def load(self, path, map_location=None):
        # The check's copy serves the load after it; any other file's is let go before this one moves,
        # so that the GPU memory it holds is free for this one.
        last, self.last = self.last, None
        if last is not None and last[0] == str(path):
            return last[1]
        del last
        state = self.inner.load(path, map_location=map_location)
        t0 = time.time()
        state, moved = to_device(state, self.device, self.threads, self.spare_largest)
        self.last = (str(path), state)
        if moved:
            seconds = time.time() - t0
            log.info("%s: %.2f GB moved to the GPU by %d threads in %.1fs (%.2f GB/s)", path, moved / 1e9, self.threads,
                     seconds, moved / 1e9 / max(seconds, 1e-9))
        return state


@contextlib.contextmanager
def staged_loads(engine, device, threads: int):
    """For the duration, `engine`'s checkpoint loads go through StagedLoads (CUDA, threads > 0)."""
    if getattr(device, "type", None) != "cuda" or threads <= 0:
        yield
        return
    import torch

    inner = engine.checkpoint_engine
    engine.checkpoint_engine = StagedLoads(inner, device, threads, spare_largest=not copies_in_place(engine.optimizer))
    try:
        yield
    finally:
        engine.checkpoint_engine = inner
        torch.cuda.empty_cache()  # the staged copies are gone: their blocks go back for the update


def copies_in_place(optimizer) -> bool:
    """Whether `optimizer` is ZeRO 1-2's copying a loaded checkpoint into its own tensors in place: a
    rigid checkpoint, partitions without padding. Otherwise it builds a new tensor of a partition's
    size first (an elastic checkpoint's partitions flattened, a padded partition zero-filled to its
    size), or is an optimizer not read for this; the staged loads run below ZeRO-3 only, so ZeRO-3's,
    which has the same flags, never comes here."""
    if getattr(optimizer, "elastic_checkpoint", True):
        return False
    paddings = list(getattr(optimizer, "groups_padding", [1]))  # the last rank's partitions, for alignment
    paddings += [p for group in getattr(optimizer, "round_robin_bit16_padding", []) for p in group]
    return not any(paddings)


# A loaded tensor smaller than this stays where it was loaded (scalars such as an optimizer's step
# must stay on the host for torch's optimizers).
STAGED_MIN_BYTES = 1 << 20


def to_device(obj, device, threads: int, spare_largest: bool = True) -> tuple[object, int]:
    """(`obj` with its large contiguous host tensors copied to `device`, the bytes copied).

    DeepSpeed copies a loaded checkpoint's host tensors into the engine's GPU tensors one by one
    from pageable memory (memory-mapped pages of the file, tuning.checkpoint_mmap), one staging
    copy at a time; here `threads` threads copy them through page-locked buffers of their own
    first. Only what fits the GPU's free memory moves, less a margin and, with `spare_largest`,
    room for DeepSpeed to make one more tensor of the largest's size (copies_in_place)."""
    import torch

    seen, chosen = set(), []
    for t in tensors_in(obj):
        if t.device.type == "cpu" and id(t) not in seen and t.is_contiguous() and \
                t.numel() * t.element_size() >= STAGED_MIN_BYTES:
            seen.add(id(t))
            chosen.append(t)
    if not chosen:
        return obj, 0
    free, _ = torch.cuda.mem_get_info(device)
    room = free - (max(t.numel() * t.element_size() for t in chosen) if spare_largest else 0) - (2 << 30)
    fits = []
    for t in chosen:
        size = t.numel() * t.element_size()
        if size <= room:
            fits.append(t)
            room -= size
    copies = {id(t): torch.empty_like(t, device=device) for t in fits}
    copy_to_device([(t, copies[id(t)]) for t in fits], threads)
    return rebuilt(obj, lambda t: copies.get(id(t), t)), sum(t.numel() * t.element_size() for t in fits)


def copy_to_device(pairs: list, threads: int) -> None:
    """Each (contiguous host tensor, CUDA tensor of its size) pair's bytes, in CHUNK_BYTES pieces by
    `threads` threads, each through two page-locked buffers and a stream of its own: one buffer
    fills from host memory while the other's copy to the GPU runs."""
    import torch

    work = [(src, dst, start, min(CHUNK_BYTES, src.numel() * src.element_size() - start))
            for src, dst in pairs for start in range(0, src.numel() * src.element_size(), CHUNK_BYTES)]
    device = pairs[0][1].device if pairs else None

    def worker(take) -> None:
        torch.cuda.set_device(device)
        stream = torch.cuda.Stream(device)
        buffers = [torch.empty(CHUNK_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        done = [None, None]
        k = 0
        while (item := take()) is not None:
            src, dst, start, size = item
            if done[k] is not None:
                done[k].synchronize()  # the buffer's last copy to the GPU is over: it may be refilled
            buffers[k][:size].copy_(src.view(-1).view(torch.uint8)[start:start + size])
            with torch.cuda.stream(stream):
                dst.view(-1).view(torch.uint8)[start:start + size].copy_(buffers[k][:size], non_blocking=True)
                done[k] = torch.cuda.Event()
                done[k].record(stream)
            k = 1 - k
        stream.synchronize()

    in_threads(work, max(1, threads), worker)


def tensors_in(obj):
    """Every tensor of a (nested) state of dicts, lists and tuples, in order, repeats included."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_in(v)


def rebuilt(obj, replace):
    """A copy of the (nested) state with each tensor t as replace(t); dicts keep their type (OrderedDict,
    defaultdict's factory), lists and tuples theirs; anything else is kept as it is."""
    import torch

    if isinstance(obj, torch.Tensor):
        return replace(obj)
    if isinstance(obj, dict):
        out = copy.copy(obj)
        for k, v in obj.items():
            out[k] = rebuilt(v, replace)
        return out
    if type(obj) in (list, tuple):
        return type(obj)(rebuilt(v, replace) for v in obj)
    return obj
