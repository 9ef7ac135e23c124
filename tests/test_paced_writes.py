"""The paced writer of background writes (stages/runtime/paced_writes.py): the bytes it leaves, the
backlog it allows, and what happens where the filesystem will not pace or is full."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from stages.runtime import paced_writes
from stages.runtime.paced_writes import PacedFile, copy_paced
from tests.test_faults import small_disk  # noqa: F401 (a fixture)

CHUNK = 1 << 20


def test_a_checkpoint_saved_through_it_loads_whole(tmp_path):
    state = {"flat": torch.randn(3 * CHUNK // 4 + 11), "moments": [torch.arange(1000), torch.ones(2, 3)], "step": 7}
    path = tmp_path / "state.pt"
    with PacedFile(path, CHUNK) as f:
        torch.save(state, f)
    for mmap in (False, True):
        back = torch.load(path, mmap=mmap, weights_only=False)
        assert torch.equal(back["flat"], state["flat"]) and torch.equal(back["moments"][0], state["moments"][0])
        assert back["step"] == 7


def test_writes_of_every_size_leave_the_same_bytes(tmp_path):
    parts = [os.urandom(n) for n in (10, CHUNK - 10, 1, 5 * CHUNK + 3, 0, CHUNK // 2)]
    with PacedFile(tmp_path / "f", CHUNK) as f:
        for p in parts:
            assert f.write(p) == len(p)
    assert (tmp_path / "f").read_bytes() == b"".join(parts)
    assert copy_paced(tmp_path / "f", tmp_path / "g", CHUNK) == sum(map(len, parts))
    assert (tmp_path / "g").read_bytes() == b"".join(parts)


def test_parts_of_an_existing_file_go_where_they_are_sought(tmp_path):
    # A checkpoint file written in part before train's marker: the rest goes into its places after it.
    path = tmp_path / "f"
    base = bytearray(os.urandom(7 * CHUNK))
    path.write_bytes(base)
    parts = {3 * CHUNK + 5: os.urandom(2 * CHUNK + 1), 10: os.urandom(CHUNK // 3), 6 * CHUNK: os.urandom(CHUNK)}
    with PacedFile(path, CHUNK, create=False) as f:
        for at, data in parts.items():
            f.seek(at)
            f.write(data)
    for at, data in parts.items():
        base[at:at + len(data)] = data
    assert path.read_bytes() == bytes(base)


@pytest.mark.skipif(paced_writes._sync_file_range is None, reason="no sync_file_range here (not Linux)")
def test_no_more_than_two_chunks_are_ever_left_to_write_back(tmp_path, monkeypatch):
    """The real sync_file_range runs; each call is recorded. Before any write returns, every byte
    but the last two chunks' has been waited for."""
    real, waited = paced_writes._sync_file_range, [0]

    def recording(fd, offset, length, flags):
        rc = real(fd, offset, length, flags)
        if rc == 0 and flags & paced_writes._WAIT_AFTER:
            waited[0] = max(waited[0], offset + length)
        return rc

    monkeypatch.setattr(paced_writes, "_sync_file_range", recording)
    with PacedFile(tmp_path / "f", CHUNK) as f:
        for size in (3 * CHUNK + 5, 7, CHUNK, 12 * CHUNK):  # one write of 12 chunks, as a large tensor arrives
            f.write(os.urandom(size))
            assert f.written - waited[0] <= 2 * CHUNK
    assert waited[0] >= f.written - 2 * CHUNK


def test_a_filesystem_that_will_not_pace_gets_each_chunk_synced(tmp_path, monkeypatch):
    """Stand-in for a filesystem whose sync_file_range fails with EINVAL (none such is mounted
    here): the file is synced whole every chunk instead, and comes out the same."""
    def refusing(fd, offset, length, flags):
        import ctypes
        ctypes.set_errno(errno.EINVAL)
        return -1

    synced = []
    real_sync = os.fdatasync
    monkeypatch.setattr(paced_writes, "_sync_file_range", refusing)
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(fd), real_sync(fd)))
    data = os.urandom(3 * CHUNK + 1)
    with PacedFile(tmp_path / "f", CHUNK) as f:
        f.write(data)
    assert not f.ranges and len(synced) == 4  # three chunks, then the close
    assert (tmp_path / "f").read_bytes() == data


def test_a_full_disk_is_an_error_naming_no_space(small_disk):
    disk = small_disk(4 * 1024)
    with pytest.raises(OSError) as e:
        with PacedFile(disk / "f", CHUNK) as f:
            f.write(os.urandom(6 * CHUNK))
    assert e.value.errno == errno.ENOSPC
    assert f.file.closed
