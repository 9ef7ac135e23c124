"""Large writes made beside the critical path, paced so that the running stage's small writes do
not queue behind them: the checkpoint train writes after its marker, persist's durable copy.

Linux lets a writer's dirty pages pile up to a share of host memory (vm.dirty_ratio: gigabytes on a
GPU node) before it writes them back. A light stage that syncs a small file meanwhile (gather's
train set, any marker) waits for that backlog in the filesystem's journal commit, and a writer over
the limit is throttled wherever it writes. A paced writer starts the write-back of each chunk as
soon as the chunk is written, and waits for the chunk before it: never more than two chunks are
dirty. At close the file is on storage (fdatasync), as a durable copy must be.
tests/benchmarks/background_writes.py measures a light stage's writes beside a paced and an
unpaced writer.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from pathlib import Path

# Small next to the page cache, large enough that the storage sees long sequential writes.
CHUNK_BYTES = 64 << 20

# sync_file_range(2) flags (linux/fs.h).
_WAIT_BEFORE, _WRITE, _WAIT_AFTER = 1, 2, 4


def _libc_sync_file_range():
    """libc's sync_file_range, or None where there is none (not Linux): the writer then syncs each
    chunk whole (fdatasync), which bounds the backlog too, at the cost of waiting on every chunk."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _libc_sync_file_range()


class PacedFile:
    """A file opened for writing whose dirty pages stay within two chunks; a file object for
    torch.save and for copies. Use it as a context manager: on leaving without an error the file is
    synced and closed, on an error only closed (the caller removes what was cut short)."""

    def __init__(self, path: str | Path, chunk_bytes: int = CHUNK_BYTES, create: bool = True):
        self.path = Path(path)
        self.chunk = chunk_bytes
        # create=False: parts of an existing file, each from its seek()
        self.file = open(self.path, "wb" if create else "r+b", buffering=0)
        self.written = 0  # where the next write goes (bytes written, in a file written from its start)
        self.started = 0  # where the write-back not yet started begins
        self.ranges = _sync_file_range is not None  # else each chunk is synced whole

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            # Never more than the rest of the current chunk in one call: a tensor of gigabytes
            # arrives in one write, and would dirty all of its pages before any pacing.
            room = self.chunk - (self.written - self.started)
            n = self.file.write(view[done:done + room])
            done += n
            self.written += n
            if self.written - self.started >= self.chunk:
                self._chunk_written()
        return done

    def seek(self, offset: int) -> None:
        """Go on writing at `offset`: the write-back of what is dirty starts first."""
        if self.written > self.started:
            self._start_write_back(self.started)
        self.file.seek(offset)
        self.written = self.started = offset

    def _start_write_back(self, offset: int) -> bool:
        """Start the write-back of the chunk at `offset`, without waiting; where the filesystem will not
        take ranges, sync the file whole instead. True where the range was taken."""
        if self.ranges and self._sync_range(offset, _WRITE):
            return True
        os.fdatasync(self.file.fileno())
        return False

    def _chunk_written(self) -> None:
        start = self.started
        if self._start_write_back(start) and start >= self.chunk:
            # The chunk before it must be on storage before more is written.
            self._sync_range(start - self.chunk, _WAIT_BEFORE | _WRITE | _WAIT_AFTER)
        self.started += self.chunk

    def _sync_range(self, offset: int, flags: int) -> bool:
        """sync_file_range on `self.chunk` bytes from `offset`; False where the filesystem does not
        take it (the file is then synced whole each chunk); a write error is raised."""
        if _sync_file_range(self.file.fileno(), offset, self.chunk, flags) == 0:
            return True
        err = ctypes.get_errno()
        if err in (errno.EINVAL, errno.ESPIPE, errno.ENOSYS, errno.EOPNOTSUPP):
            self.ranges = False
            return False
        raise OSError(err, f"writing {self.path}: {os.strerror(err)}")

    def flush(self) -> None:
        """Nothing to do: the file is unbuffered (torch.save's writer may call it)."""

    def close(self, sync: bool = True) -> None:
        if self.file.closed:
            return
        try:
            if sync:
                os.fdatasync(self.file.fileno())
        finally:
            self.file.close()

    def __enter__(self) -> PacedFile:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(sync=exc_type is None)


def copy_paced(src: Path, dst: Path, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Copy `src` to `dst` through a PacedFile (on storage once it returns); returns the bytes."""
    buf = bytearray(chunk_bytes)
    with open(src, "rb", buffering=0) as source, PacedFile(dst, chunk_bytes) as out:
        while n := source.readinto(buf):
            out.write(memoryview(buf)[:n])
    return out.written
