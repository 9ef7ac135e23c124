"""A DeepSpeed checkpoint written after train's marker: snapshot to host memory now, write to disk later.

DeepSpeed's save_checkpoint builds each file's state (model states, every rank's ZeRO optimizer
shard) and hands it to its checkpoint engine's save(state, path). DeferredWrites stands in for that
engine: save() copies the state's tensors to host memory and queues the file; flush() writes the
queue as the engine it replaced would, paced (stages/runtime/paced_writes.py: the stages running
beside it sync their own files). Between the two, train writes the policy's weights for save,
frees the GPU and writes its marker, so save and the next generate do not wait for the optimizer
state to reach the disk. The copy to host memory (copy_to_host) is what stays before the marker.

A file whose state does not fit the host-memory budget left is written in part at once instead, as
without deferral: a snapshot must never push the node into swap or the OOM killer. Where its writer
lays the archive out first (serialization.ThreadedWrites), the pieces of its large tensors that fit
the budget are held all the same and written after the marker into their places in the file
(HeldPieces); only the rest is written before it. Where the checkpoint
directory is itself in host memory (tmpfs), each file written takes as much memory again as its
snapshot, and the budget counts both.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import json
import logging
import mmap
import shutil
import threading
import time
from pathlib import Path

import torch

from stages.rl import policy_file, serialization
from stages.runtime import footprint, local_checkpoints, markers, paced_writes
from stages.runtime.memory import HOST_MEMORY_SHARE, available_host_bytes, memory_backed, snapshot_budget_bytes

log = logging.getLogger("syncrl.deferred_checkpoint")

# A file over the budget is held in pieces of this size: the next iteration prepares host memory by
# them (HostPool), and a budget that moves a little between iterations still finds them prepared.
PIECE_BYTES = 256 << 20


class DeferredWrites:
    """A checkpoint engine that snapshots on save() and writes on flush(); everything else is the
    wrapped engine's (loads, directories, commits)."""

    def __init__(self, inner, budget_bytes: int, pool: HostPool | None = None, piece_bytes: int = PIECE_BYTES):
        self.inner = inner
        self.budget = budget_bytes
        self.piece_bytes = piece_bytes  # what a file over the budget holds of its tensors comes in these
        self.pool = pool or HostPool()  # host memory prepared for the snapshot (none: allocated as it goes)
        self.queued: list[tuple[str, object]] = []
        self.held = 0  # bytes of the queued snapshots
        self.snapshot_s = 0.0
        # Files over the budget, written before the marker as without deferral: what the marker and
        # the stage's summary report, so a checkpoint on the critical path does not read as deferred.
        self.written_now = 0
        self.written_now_s = 0.0
        self.layout: list = []  # [dtype, shape] of each tensor copied to host memory (HostPool)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def save(self, state_dict, path: str) -> None:
        size = state_bytes(state_dict)
        if self.held + size > self.budget:
            if self._save_split(state_dict, path):
                return
            log.info("%s: %.2f GB does not fit the host-memory budget left (%.2f GB): written now", path, size / 1e9,
                     (self.budget - self.held) / 1e9)
            self.pool.release()  # what the pool prepared and the snapshot did not take goes before the write
            t0 = time.time()
            self.inner.save(state_dict, path)
            self.written_now += state_bytes(state_dict, host_too=True)  # the file's bytes, wherever they were
            self.written_now_s += time.time() - t0
            return
        t0 = time.time()
        self.queued.append((path, to_host(state_dict, self.layout, self.pool)))
        self.held += size
        self.snapshot_s += time.time() - t0

    def _save_split(self, state, path: str) -> bool:
        """A file over the budget left, where its writer lays the archive out first: the pieces of its
        tensors that fit the budget held in host memory (HeldPieces, written after the marker), the
        rest written now around them. False, having written nothing, where it cannot."""
        room = self.budget - self.held
        if room < self.piece_bytes or not isinstance(self.inner, serialization.ThreadedWrites):
            return False
        layout = serialization.archive_layout(state, path)
        if layout is None:
            return False
        held, now = split_pieces(layout, room, self.piece_bytes)
        t0 = time.time()
        views = [serialization.storage_bytes(s)[start:start + n] for s, start, n, _ in held]
        # Host storages are kept as they are (to_host's rule): train makes no step after the snapshot.
        copied = [v for v in views if v.device.type != "cpu"]
        self.layout += [["uint8", [v.numel()]] for v in copied]
        moved = iter(copy_to_host(copied, self.pool))
        self.queued.append((path, HeldPieces((v if v.device.type == "cpu" else next(moved), record + start)
                                             for v, (_, start, _, record) in zip(views, held))))
        self.held += sum(v.numel() for v in copied)
        self.snapshot_s += time.time() - t0
        self.pool.release()  # what the pool prepared and the snapshot did not take goes before the write
        t0 = time.time()
        serialization.write_ranges(path, now, self.inner.threads)
        now_bytes = sum(n for _, _, n, _ in now)
        self.written_now += now_bytes
        self.written_now_s += time.time() - t0
        log.info("%s: over the host-memory budget left (%.2f GB): %.2f GB held for after the marker, %.2f GB "
                 "written now in %.1fs", path, room / 1e9, sum(n for _, _, n, _ in held) / 1e9, now_bytes / 1e9,
                 time.time() - t0)
        return True

    def find(self, suffix: str):
        """The queued state of the file whose path ends with `suffix` (None if not queued whole)."""
        return next((state for path, state in self.queued if path.endswith(suffix)
                     and not isinstance(state, HeldPieces)), None)

    def flush(self, beat=lambda: None) -> float:
        """Write the queued files in order, freeing each snapshot once written; returns the seconds."""
        t0 = time.time()
        while self.queued:
            path, state = self.queued.pop(0)
            try:
                self._write(state, path)
            except BaseException as e:
                # Free space as the write failed (before its partial file goes, and before another
                # rank's failed write frees its own); then what was cut short goes, for the redo.
                free = shutil.disk_usage(Path(path).parent).free
                Path(path).unlink(missing_ok=True)
                size = state_bytes(state, host_too=True)
                if isinstance(e, Exception) and free < size:
                    # torch.save's zip writer reports a full disk as "unexpected pos" (a RuntimeError).
                    raise OSError(errno.ENOSPC, f"No space left on device writing {path} ({free / 1e6:.1f} MB free, "
                                                f"{size / 1e6:.1f} MB to write)") from e
                raise
            del state
            beat()
        self.held = 0
        return time.time() - t0

    def _write(self, state, path: str) -> None:
        """What DeepSpeed's torch engine writes, paced (stages/runtime/paced_writes.py): the stages
        running beside this write sync their own files. Another engine writes its own way."""
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

        if isinstance(state, HeldPieces):
            with paced_writes.PacedFile(path, create=False) as f:
                for t, at in sorted(state, key=lambda piece: piece[1]):
                    f.seek(at)
                    f.write(memoryview(t.numpy()))
            return
        if not isinstance(self.inner, TorchCheckpointEngine):
            self.inner.save(state, path)
            return
        with paced_writes.PacedFile(path) as f:
            torch.save(state, f, _use_new_zipfile_serialization=self.inner.zipfile_serialization)


class HeldPieces(list):
    """The held part of a file written in part before the marker: (host uint8 tensor, file offset)
    pairs, each written at its offset into the archive already laid out."""


def split_pieces(layout: list, room: int, piece: int) -> tuple[list, list]:
    """(held, now): ranges (storage, start, bytes, record offset) over an archive's (storage, record
    offset) layout. Held: whole pieces of `piece` bytes (a storage's last may be shorter) of storages
    of at least that size, in file order while they fit `room`; now: the rest."""
    held, now = [], []
    for storage, record in layout:
        size, start = storage.nbytes(), 0
        while size >= piece and start < size and min(piece, size - start) <= room:
            n = min(piece, size - start)
            held.append((storage, start, n, record))
            room -= n
            start += n
        if start < size:
            now.append((storage, start, size - start, record))
    return held, now


def deferral_note(record: dict | None) -> str:
    """What train's summary line says of a deferred checkpoint (its marker's deferred_checkpoint
    record): held in host memory and written after the marker, and what did not fit and was written
    before it (this rank's files)."""
    if not record:
        return " (in host memory: written after the marker)"
    held = f"{record['snapshot_gb']:.2f} GB in host memory, written after the marker"
    if not record.get("written_now_gb"):
        return f" ({held})"
    share = f"{HOST_MEMORY_SHARE:.0%} of the node's available memory" + (
        ", halved as the checkpoint folder is in host memory (tmpfs)" if record.get("folder_in_memory") else "")
    fix = "checkpoints on disk or " if record.get("folder_in_memory") else ""
    return (f" ({held}; {record['written_now_gb']:.2f} GB written before it, in {record['written_now_s']:.1f}s: "
            f"over this rank's host-memory budget of {record['budget_gb']:.2f} GB, {share}; {fix}more host memory "
            f"per rank takes it off the critical path)")


def write_policy(ctx, writes: DeferredWrites) -> Path:
    """Rank 0, ZeRO 0-2: the policy's weights (the held model states' module, in the training dtype)
    as one safetensors file under the train folder, for save to export before the checkpoint is on
    disk."""
    states = writes.find(local_checkpoints.MODEL_STATES)
    if states is None:
        raise RuntimeError(f"the model states ({local_checkpoints.MODEL_STATES}) were not held in host memory: "
                           f"set tuning.deferred_checkpoint=false")
    return policy_file.write(states["module"], ctx.paths.train_policy(ctx.iteration))


def state_bytes(obj, host_too: bool = False) -> int:
    """Bytes a snapshot copies: the distinct accelerator tensors of a (nested) state (views of one
    storage counted once; host tensors are kept, not copied). host_too: every tensor's."""
    seen, total = set(), 0
    for t in serialization.tensors_in(obj):
        if t.device.type == "cpu" and not host_too:
            continue
        key = _view_key(t)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def to_host(obj, layout: list | None = None, pool: HostPool | None = None):
    """The state (dicts, lists, tuples, nested) with every accelerator tensor copied to host memory;
    each copy's [dtype, shape] is appended to `layout`; the copies go into `pool`'s prepared tensors
    where it has them.

    Host tensors are kept as they are: train makes no step after the snapshot, so they no longer
    change. A tensor that appears twice (tied weights) is copied once and appears twice in the
    result, as torch.save keeps shared storage."""
    memo = {}
    for t in serialization.tensors_in(obj):
        if t.device.type != "cpu":
            memo.setdefault(_view_key(t), t)
    if layout is not None:
        layout += [[str(t.dtype).removeprefix("torch."), list(t.shape)] for t in memo.values()]
    copies = dict(zip(memo, copy_to_host(list(memo.values()), pool)))
    return serialization.rebuilt(obj, lambda t: t if t.device.type == "cpu" else copies[_view_key(t)])


def write_layout(ctx, writes: DeferredWrites) -> None:
    """This rank's snapshot layout, for the next iteration's train to prepare host memory by."""
    markers.write_json_atomic(ctx.paths.snapshot_layout(ctx.iteration, ctx.rank), writes.layout)


class HostPool:
    """Host tensors laid out as the previous iteration's snapshot, their pages faulted in while the
    train process waits for its turn, for copy_to_host to fill.

    Fresh host memory is faulted in page by page as it is first written, which would put that cost
    on the copy before train's marker. A train process started early has seconds to spare before
    its turn (save, generate, score and gather of the iteration run meanwhile); it spends them on one
    core, outside the GIL.

    On CUDA each tensor is its own page-aligned mapping, page-locked (registered with CUDA), so the
    GPU copies into it directly at full bus speed, several times faster than through page-locked
    buffers into pageable memory (tests/benchmarks/snapshot_copy.py).
    Locking costs about what allocating does, and is paid before the turn. Elsewhere, or where CUDA
    refuses to lock, the pages are only faulted in (memset)."""

    def __init__(self):
        self._free: dict[tuple, list] = {}
        self._thread: threading.Thread | None = None
        self._turn = threading.Event()
        self._locked: dict[int, object] = {}  # data_ptr -> the mapping of a page-locked tensor
        self.prepared_bytes = self.taken_bytes = self.locked_bytes = 0

    def prepare(self, layout_path: Path, budget_bytes, cuda_device: int | None = None, ready=None) -> None:
        """Start preparing, in a thread, the tensors `layout_path` lists once it is there (the
        previous train writes it with its snapshot) and `ready()` is true; none if they would exceed
        `budget_bytes` (bytes, or a function giving them, asked then). With `cuda_device` (an
        index), page-locked for copies from that GPU."""
        self._thread = threading.Thread(target=self._fill, name="host-pool", daemon=True,
                                        args=(Path(layout_path), budget_bytes, cuda_device, ready or (lambda: True)))
        self._thread.start()

    def turn_came(self) -> None:
        """The stage's turn: a layout not there now will not come (its train's marker is in)."""
        self._turn.set()

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor | None:
        """A prepared tensor of `shape` and `dtype` (its contents undefined), or None."""
        self.wait()
        free = self._free.get((str(dtype).removeprefix("torch."), tuple(shape)))
        if not free:
            return None
        t = free.pop()
        self.taken_bytes += t.numel() * t.element_size()
        return t

    def page_locked(self, t: torch.Tensor) -> bool:
        """Whether `t` is one of this pool's page-locked tensors (a GPU copies into it directly)."""
        return t.data_ptr() in self._locked

    def release(self) -> None:
        """Drop what the snapshot did not take."""
        self.wait()
        for tensors in self._free.values():
            for t in tensors:
                self._unlock(t.data_ptr())
        self._free.clear()

    def close(self) -> None:
        """Unlock the pages of every tensor the snapshot took (once it is written: it holds them)."""
        self.release()
        for ptr in list(self._locked):
            self._unlock(ptr)

    def _unlock(self, ptr: int) -> None:
        if self._locked.pop(ptr, None) is not None:
            torch.cuda.cudart().cudaHostUnregister(ptr)

    def wait(self) -> None:
        """Wait for the filling thread (it stops waiting for a layout once told the turn came)."""
        if self._thread is not None:
            self._turn.set()
            self._thread.join()
            self._thread = None

    def untaken_bytes(self) -> int:
        """Bytes prepared and not yet taken by the snapshot (once the filling thread is done)."""
        self.wait()
        return self.prepared_bytes - self.taken_bytes

    def _fill(self, path: Path, budget_bytes, cuda_device: int | None, ready) -> None:
        while not (path.is_file() and ready()):
            if self._turn.is_set():
                return
            time.sleep(0.1)
        if callable(budget_bytes):
            budget_bytes = budget_bytes()
        try:
            layout = [(dtype, tuple(shape)) for dtype, shape in json.loads(path.read_text())]
            sizes = [torch.Size(shape).numel() * getattr(torch, dtype).itemsize for dtype, shape in layout]
        except (OSError, ValueError, TypeError, AttributeError) as e:
            log.warning("host memory not prepared: %s unreadable (%s)", path, e)
            return
        # What fits the budget, in the snapshot's order: a file held in pieces filled the last budget,
        # and this one may be a little smaller.
        fit = sum(1 for total in itertools.accumulate(sizes) if total <= budget_bytes)
        if fit < len(sizes):
            log.info("host memory prepared for %d of the %d tensors %s lists (%.2f of %.2f GB): the budget is %.2f GB",
                     fit, len(sizes), path, sum(sizes[:fit]) / 1e9, sum(sizes) / 1e9, budget_bytes / 1e9)
            layout, sizes = layout[:fit], sizes[:fit]
        t0 = time.time()
        lock = cuda_device is not None
        if lock:
            torch.cuda.set_device(cuda_device)  # this thread's device: CUDA's context is made on it
        for (dtype, shape), size in zip(layout, sizes):
            t = None
            if lock and size:
                t = self._page_locked(shape, getattr(torch, dtype), size)
                lock = t is not None  # CUDA refused: the rest is only faulted in
            if t is None:
                t = torch.empty(shape, dtype=getattr(torch, dtype))
                if size:
                    ctypes.memset(t.data_ptr(), 0, size)  # faults the pages in; ctypes releases the GIL
            self._free.setdefault((dtype, shape), []).append(t)
        self.prepared_bytes = sum(sizes)
        log.info("host memory for the snapshot prepared: %.2f GB in %d tensors (%.2f GB page-locked), %.1fs",
                 self.prepared_bytes / 1e9, len(layout), self.locked_bytes / 1e9, time.time() - t0)

    def _page_locked(self, shape, dtype: torch.dtype, size: int) -> torch.Tensor | None:
        """A host tensor in a mapping of its own, page-locked; None where CUDA refuses to lock it.

        A mapping per tensor: locking works on whole pages, and two tensors of one page could not both
        be locked; a tensor that shared a storage with others would be written with all of it."""
        region = mmap.mmap(-1, size)
        t = torch.frombuffer(region, dtype=torch.uint8, count=size).view(dtype).view(shape)
        # cudaHostRegisterPortable: page-locked for every CUDA context of the process.
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), size, 1)
        if int(err) != 0:
            log.warning("host memory for the snapshot not page-locked: cudaHostRegister returned %s; faulted in "
                        "instead (the copy to it goes through page-locked buffers)", err)
            return None
        self._locked[t.data_ptr()] = region
        self.locked_bytes += size
        return t


def prepare_pool(ctx) -> HostPool | None:
    """Host memory for this rank's snapshot, prepared in a thread by the previous iteration's layout
    (a train process started early, before its turn; CUDA only: elsewhere nothing is copied)."""
    if ctx.iteration == 0 or footprint.why_not_deferred(ctx.cfg) or not torch.cuda.is_available():
        return None
    # The budget is read once the previous checkpoint is written: until then its write may still be
    # taking host memory (a checkpoint directory on tmpfs), which the snapshot must leave to it.
    previous_written = lambda: local_checkpoints.deferred_problem(ctx.paths, ctx.iteration - 1) is None  # noqa: E731
    folder = local_checkpoints.this_node(ctx.cfg.train.local_checkpoint_dir, ctx.paths) or ctx.paths.checkpoints
    pool = HostPool()
    pool.prepare(ctx.paths.snapshot_layout(ctx.iteration - 1, ctx.rank), lambda: snapshot_budget(ctx, folder),
                 cuda_device=ctx.info.local_rank % torch.cuda.device_count(), ready=previous_written)
    return pool


def snapshot_budget(ctx, folder: Path, held: int = 0) -> int:
    """Host memory one rank's snapshot may hold: HOST_MEMORY_SHARE of the node's available memory,
    shared by the node's ranks, plus `held` (what the pool already holds for it); half that where the
    checkpoint's `folder` is in host memory, as each file written there takes its snapshot's size again."""
    ranks_per_node = max(1, ctx.world_size // max(1, ctx.info.num_nodes))
    return snapshot_budget_bytes(available_host_bytes(), ranks_per_node, memory_backed(folder), held)


# Page-locked buffers the CUDA copies into pageable memory go through (two: one fills from the GPU
# while the other is copied out): far faster than tensor.to("cpu") into fresh pageable memory
# (tests/benchmarks/snapshot_copy.py). Page-locking the whole snapshot is faster still, but costs
# about what allocating does, which only a process started early can spare (HostPool).
STAGING_BYTES = 64 << 20


def copy_to_host(tensors: list, pool: HostPool | None = None) -> list:
    """Host copies of `tensors` (accelerator tensors; views copied as contiguous tensors).

    CUDA tensors are copied on a side stream into host tensors prepared beforehand (`pool`): straight
    into those it page-locked; else through two page-locked STAGING_BYTES buffers, each chunk's copy
    from the GPU overlapping the host copy of the one before, into prepared tensors or ones first
    written with zeros (the fill faults their pages in on every core, torch's parallel fill, where a
    copy into fresh pageable memory faults them one by one). Other devices copy with tensor.to("cpu")."""
    pool = pool or HostPool()
    out = [_host_tensor(t, pool) if t.is_cuda else t.detach().to("cpu", copy=True) for t in tensors]
    cuda = [(t.detach().contiguous(), o) for t, o in zip(tensors, out) if t.is_cuda and t.numel()]
    if not cuda:
        return out
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # the state's last writes come first
    staged = []
    with torch.cuda.stream(stream):
        for src, dst in cuda:
            if pool.page_locked(dst):
                dst.copy_(src, non_blocking=True)
            else:
                staged.append((src, dst))
    if staged:
        copy_staged(staged, stream)
    stream.synchronize()
    return out


def copy_staged(pairs: list, stream) -> None:
    """Each (CUDA source, pageable host destination) pair copied through two page-locked buffers."""
    buffers = [torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    filled = [torch.cuda.Event(), torch.cuda.Event()]
    pending = None  # (buffer, host bytes, length): copied into the buffer, not yet out of it
    k = 0
    for src, dst in pairs:
        src_bytes, dst_bytes = src.view(-1).view(torch.uint8), dst.view(-1).view(torch.uint8)
        for start in range(0, src_bytes.numel(), STAGING_BYTES):
            n = min(STAGING_BYTES, src_bytes.numel() - start)
            # Buffer k was drained last round (pending is the other one): it may be refilled.
            with torch.cuda.stream(stream):
                buffers[k][:n].copy_(src_bytes[start:start + n], non_blocking=True)
                filled[k].record(stream)
            if pending is not None:
                _drain(buffers, filled, pending)
            pending, k = (k, dst_bytes[start:start + n], n), 1 - k
    _drain(buffers, filled, pending)


def _host_tensor(t: torch.Tensor, pool: HostPool) -> torch.Tensor:
    prepared = pool.take(t.shape, t.dtype)
    return prepared if prepared is not None else torch.empty(t.shape, dtype=t.dtype).zero_()


def _drain(buffers, filled, pending) -> None:
    j, dst, n = pending
    filled[j].synchronize()
    dst.copy_(buffers[j][:n])


def _view_key(t: torch.Tensor) -> tuple:
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.storage_offset()) if t.numel() else \
        (id(t),)
