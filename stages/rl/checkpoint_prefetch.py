"""The previous iteration's checkpoint read into host memory while train waits for its turn.

A train process started early waits seconds for its turn (save, generate, score and gather of the
iteration run meanwhile), and the checkpoint it resumes from is complete seconds before that turn
(train.deferred_checkpoint: the previous train publishes it after its marker). Resuming read it
at the turn: on 1 H200, 0.8-1.2 s for 6.66 GB from the page cache, the copies from pageable memory
to the GPU included; from a shared filesystem, longer. PREFETCH reads this rank's files of it while
the process waits, into page-locked memory on CUDA, and DeepSpeed's load_checkpoint takes them
from there (PrefetchedLoads) instead of reading them: only the copies to the GPU stay at the turn.

A file that changed after it was read (size, modification time or inode), that was not read, or
that does not fit the host-memory budget is read by DeepSpeed as usual. The memory is unlocked and
dropped once the checkpoint is loaded.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from pathlib import Path

import torch

from stages.rl.deferred_checkpoint import (POOL, page_locked_empty, replaced, snapshot_budget, tensors_in,
                                           unlock_pages, view_key, why_not)
from stages.runtime import local_checkpoints
from stages.runtime.config import zero_stage

log = logging.getLogger("syncrl.checkpoint_prefetch")


class Prefetch:
    """Reads checkpoint files in a thread; serves them to a DeepSpeed engine's load_checkpoint."""

    def __init__(self):
        self._thread: threading.Thread | None = None
        self._turn = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._files: dict[str, tuple[tuple, object]] = {}  # real path -> (stat key, state)
        self._locked: list[tuple[int, object]] = []  # (address, mapping) of each page-locked tensor
        self.figures = {"files": 0, "gb": 0.0, "read_s": 0.0, "served": 0}

    def start(self, folder_ready, files, budget, cuda_device: int | None) -> None:
        """In a thread: wait until folder_ready() says the checkpoint is complete (None: not yet;
        False: it will not be), then read `files()` in order while they fit budget() bytes;
        page-locked with `cuda_device` (an index)."""
        self._thread = threading.Thread(target=self._run, args=(folder_ready, files, budget, cuda_device),
                                        name="checkpoint-prefetch", daemon=True)
        self._thread.start()

    def turn_came(self) -> None:
        """The stage's turn: a checkpoint not complete by now is not waited for."""
        self._turn.set()

    @property
    def turned(self) -> bool:
        return self._turn.is_set()

    @contextlib.contextmanager
    def serving(self, engine, timeout_s: float):
        """DeepSpeed's checkpoint reads within the block take the files read ahead. Waits for the
        reading at most `timeout_s` (then stops it after the tensor in hand)."""
        t0 = time.time()
        self._finish(timeout_s)
        self.figures["waited_s"] = time.time() - t0
        inner = engine.checkpoint_engine
        engine.checkpoint_engine = PrefetchedLoads(inner, self)
        try:
            yield
        finally:
            engine.checkpoint_engine = inner
            self.release()

    def take(self, path: str):
        """The state read from `path`, once, if the file is still what was read; else None."""
        with self._lock:
            entry = self._files.pop(os.path.realpath(path), None)
        if entry is None:
            return None
        key, state = entry
        if stat_key(path) != key:
            log.warning("%s changed after it was read ahead: read again", path)
            return None
        self.figures["served"] += 1
        return state

    def release(self) -> None:
        """Stop reading, unlock and drop what was read (what a loaded engine still references stays)."""
        self._finish(0)
        with self._lock:
            self._files.clear()
            locked, self._locked = self._locked, []
        for ptr, _ in locked:
            unlock_pages(ptr)

    def _finish(self, timeout_s: float) -> None:
        if self._thread is None:
            return
        self._turn.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("reading the checkpoint ahead took over %.0fs: stopped, DeepSpeed reads what is left", timeout_s)
            self._stop.set()
            self._thread.join()
        self._thread = None

    def _run(self, folder_ready, files, budget, cuda_device: int | None) -> None:
        try:
            while (ready := folder_ready()) is None:
                if self._turn.is_set():
                    ready = folder_ready()
                    break
                time.sleep(0.1)
            if not ready:
                return
            if cuda_device is not None:
                torch.cuda.set_device(cuda_device)  # this thread's device: CUDA's context is made on it
            t0, left = time.time(), budget()
            for path in files():
                size = path.stat().st_size
                if size > left:
                    log.info("%s (%.2f GB) not read ahead: over the host-memory budget left (%.2f GB)", path, size / 1e9,
                             left / 1e9)
                    continue
                if not self._read(path, cuda_device is not None):
                    return
                left -= size
                self.figures["files"] += 1
                self.figures["gb"] += size / 1e9
            self.figures["read_s"] = time.time() - t0
            log.info("read ahead %d checkpoint file(s), %.2f GB, in %.1fs", self.figures["files"], self.figures["gb"],
                     self.figures["read_s"])
        except Exception as e:  # reading ahead is an optimisation: DeepSpeed reads what is not here
            log.warning("reading the checkpoint ahead failed (%s: %s): DeepSpeed reads it", type(e).__name__, e)

    def _read(self, path: Path, lock: bool) -> bool:
        """Read one file into host memory of its own; False if told to stop first."""
        key = stat_key(path)
        # Mapped from the file: each tensor is copied once, into memory this process owns.
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=False)
        copies = {}
        for t in tensors_in(state):
            k = view_key(t)
            if k in copies or not t.numel():
                continue
            if self._stop.is_set():
                return False
            size = t.numel() * t.element_size()
            locked = page_locked_empty(t.shape, t.dtype, size) if lock and t.is_contiguous() else None
            if locked is not None:
                dst, region = locked
                with self._lock:
                    self._locked.append((dst.data_ptr(), region))
            else:
                dst = torch.empty_like(t, memory_format=torch.preserve_format)
            dst.copy_(t)
            copies[k] = dst
        with self._lock:
            self._files[os.path.realpath(path)] = (key, replaced(state, copies))
        return True


class PrefetchedLoads:
    """A checkpoint engine whose load() returns the state read ahead for a path; everything else is
    the wrapped engine's."""

    def __init__(self, inner, prefetch: Prefetch):
        self.inner = inner
        self.prefetch = prefetch

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def load(self, path, map_location=None):
        state = self.prefetch.take(str(path))
        if state is not None:
            log.info("%s: read ahead, before the turn", path)
            return state
        return self.inner.load(path, map_location=map_location)


def stat_key(path) -> tuple:
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns, st.st_ino


# The train process's reader: train's preload starts it, resume serves from it.
PREFETCH = Prefetch()


def prepare(ctx, ds_config: dict) -> None:
    """Read this rank's files of iteration I-1's checkpoint ahead, once the previous train has
    published it whole after its marker (train.deferred_checkpoint; a train process started early)."""
    if ctx.iteration == 0 or why_not(ctx.cfg, zero_stage(ds_config)):
        return
    cuda_device = ctx.info.local_rank % torch.cuda.device_count() if torch.cuda.is_available() else None
    paths, prev = ctx.paths, ctx.iteration - 1
    folder = paths.checkpoints / paths.checkpoint_tag(prev)

    def ready():
        recorded = local_checkpoints.deferred(paths, prev)
        if recorded is None:  # no marker yet (or a checkpoint written before it, which a redo may replace)
            return None
        return local_checkpoints.problem(folder, recorded["id"]) is None or None

    def files():
        # What DeepSpeed's load_checkpoint reads on this rank (ZeRO 1-2): its own optimizer partition, then
        # the model states (every rank reads them; ZeRO keeps the module's weights whole).
        return sorted(folder.glob(f"*zero_pp_rank_{ctx.rank}_mp_rank_*optim_states.pt")) + \
            [folder / local_checkpoints.MODEL_STATES]

    def budget():
        # The snapshot's share less what the host pool takes of it (prepared beside this).
        return snapshot_budget(ctx) - POOL.wait_planned(lambda: PREFETCH.turned)

    PREFETCH.start(ready, files, budget, cuda_device)
