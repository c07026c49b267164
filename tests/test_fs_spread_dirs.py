"""The fs tier marks its root ``chattr +T`` (spread_dirs) so that ext4 spreads the fan-out
directories, and their files' inodes, over its block groups; best effort elsewhere."""

from __future__ import annotations

import fcntl
import os
import sys

import numpy as np
import pytest

from manager import NumpyBlockIO, make_offload_key
from manager.tiering import JobMetadata, fs_io
from manager.tiering.fs import FileSystemSecondaryTierManager


def _flags(path: str) -> int | None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        buf = bytearray(4)
        fcntl.ioctl(fd, fs_io._FS_IOC_GETFLAGS, buf)
        return int.from_bytes(buf, sys.byteorder)
    except OSError:
        return None
    finally:
        os.close(fd)


def _tier(root: str, **kw: object) -> FileSystemSecondaryTierManager:
    host = np.arange(4 * 4096, dtype=np.uint8).reshape(4, 4096)
    return FileSystemSecondaryTierManager(root=root, block_io=NumpyBlockIO(host), enable_events=False, **kw)


@pytest.mark.parametrize("spread", [True, False])
def test_root_marked_topdir_only_when_asked(tmp_path, spread):
    root = str(tmp_path / "tier")
    os.mkdir(root)
    if _flags(root) is None:
        pytest.skip("this filesystem has no inode flags (FS_IOC_GETFLAGS)")
    probe = str(tmp_path / "probe")
    os.mkdir(probe)
    settable = fs_io.spread_directories(probe) and bool(_flags(probe) & fs_io._FS_TOPDIR_FL)  # type: ignore[operator]
    t = _tier(root, spread_dirs=spread)
    try:
        marked = bool(_flags(root) & fs_io._FS_TOPDIR_FL)  # type: ignore[operator]
        assert t.stats()["spread_dirs"] is t.spread_dirs
        if spread:
            assert t.spread_dirs is settable and marked is settable
        if not spread:
            assert not t.spread_dirs and not marked
        # stores and loads work either way (the flag changes placement, not the files)
        keys = [make_offload_key(bytes([i]) * 8, 0) for i in range(4)]
        t.submit_store(JobMetadata(1, keys, np.arange(4, dtype=np.int64), False))
        assert t.drain_jobs(timeout=30)
        assert [r.success for r in t.get_finished_jobs()] == [True]
        assert all(t.holds(k) for k in keys)
    finally:
        t.shutdown()


def test_spread_directories_false_where_unsupported(tmp_path):
    assert fs_io.spread_directories(str(tmp_path / "missing")) is False
    f = tmp_path / "file"
    f.write_bytes(b"x")
    assert fs_io.spread_directories(str(f)) is False  # not a directory
