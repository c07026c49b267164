"""The fs tier's directory layout: 16 fan-out directories (the key's first hex digit), and
roots written in the previous layout (256 directories, the first two hex digits) still read:
their block files are moved into place, byte-identical, by the start-up scan (a kill -9 in the
middle loses nothing) and by a shared root's asynchronous lookup."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from manager import LookupResult, NumpyBlockIO, make_offload_key
from manager.tiering import JobMetadata, JobResult, SecondaryTierFactory, fs_io
from manager.tiering.fs import FileSystemSecondaryTierManager
from manager.tiering.fs_scan import block_path, legacy_block_path

BLOCK = 4096
N = 12


def K(i: int) -> bytes:  # first bytes 0x00, 0x17, 0x2e, ...: several fan-out directories
    return make_offload_key(bytes([(i * 23) % 256]) * 7 + bytes([i]), 0)


def payload(i: int) -> bytes:
    return bytes((i * 31 + j * 7) % 256 for j in range(BLOCK))


def tier_at(root: Path, io: NumpyBlockIO | None = None, **kw) -> FileSystemSecondaryTierManager:  # type: ignore[no-untyped-def]
    t = SecondaryTierFactory.create_secondary_tier({"type": "fs", "root": str(root), "pack_blocks": 1, **kw}, block_io=io)
    assert isinstance(t, FileSystemSecondaryTierManager)
    return t


def run(t: FileSystemSecondaryTierManager, job: JobMetadata, load: bool = False) -> JobResult:
    (t.submit_load if load else t.submit_store)(job)
    assert t.drain_jobs(timeout=20)
    (res,) = t.get_finished_jobs()
    return res


def write_legacy(root: Path, i: int) -> Path:
    """A block file where a tier of the previous version put it (the format is unchanged)."""
    path = legacy_block_path(str(root), K(i))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fs_io.write_block_file(path + ".0.tmp", path, K(i), payload(i), fs_io.IOBuffers(), False,
                           fs_io.default_crc_kind(), False)
    return Path(path)


def load_all(t: FileSystemSecondaryTierManager, n: int = N) -> NumpyBlockIO:
    io = t.block_io
    assert isinstance(io, NumpyBlockIO)
    assert run(t, JobMetadata(9, [K(i) for i in range(n)], np.arange(n, dtype=np.int64), True), load=True).success
    return io


def test_blocks_live_in_sixteen_fanout_directories(tmp_path: Path) -> None:
    io = NumpyBlockIO.allocate(N, BLOCK)
    for i in range(N):
        io.write_block(i, payload(i))
    t = tier_at(tmp_path, io)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != ".owners") == [f"{d:x}" for d in range(16)]
    assert run(t, JobMetadata(1, [K(i) for i in range(N)], np.arange(N, dtype=np.int64), False)).success
    for i in range(N):
        h = K(i).hex()
        assert t._path(K(i)) == tmp_path / h[0] / f"{h}.blk" and t._path(K(i)).is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != ".owners") == [f"{d:x}" for d in range(16)]
    t.shutdown()


def test_a_previous_layout_root_is_moved_into_place_byte_identical(tmp_path: Path) -> None:
    olds = [write_legacy(tmp_path, i) for i in range(N)]
    mtimes = [p.stat().st_mtime_ns for p in olds]
    torn = write_legacy(tmp_path, N)  # the 13th block, torn: deleted as before
    torn.write_bytes(torn.read_bytes()[:-7])
    foreign = tmp_path / olds[0].parent.name / "notes.txt"
    foreign.write_bytes(b"someone else's")
    (olds[1].parent / (olds[1].name + ".99.tmp")).write_bytes(b"stale")  # an old writer's leftover
    t = tier_at(tmp_path, NumpyBlockIO.allocate(N, BLOCK))
    assert t.cached_keys() == {K(i) for i in range(N)}
    assert t.migrated_files == N and t.stats()["migrated_files"] == N and t.corrupt_files == 1
    for i, old in enumerate(olds):
        new = Path(block_path(str(tmp_path), K(i)))
        assert not old.exists() and new.is_file() and new.stat().st_mtime_ns == mtimes[i]  # (its LRU rank)
    assert not torn.exists() and foreign.exists()
    # the old directories are gone once empty; the one with a foreign file stays
    assert sorted(p.name for p in tmp_path.iterdir() if len(p.name) == 2) == [foreign.parent.name]
    io = load_all(t)
    assert all(bytes(io.read_block(i)) == payload(i) for i in range(N))
    t.shutdown()
    t2 = tier_at(tmp_path, NumpyBlockIO.allocate(N, BLOCK))  # nothing left to move
    assert t2.cached_keys() == {K(i) for i in range(N)} and t2.migrated_files == 0
    t2.shutdown()


def test_a_block_in_both_layouts_is_indexed_once(tmp_path: Path) -> None:
    io = NumpyBlockIO.allocate(1, BLOCK)
    io.write_block(0, payload(0))
    t = tier_at(tmp_path, io)
    assert run(t, JobMetadata(1, [K(0)], np.arange(1, dtype=np.int64), False)).success
    t.shutdown()
    write_legacy(tmp_path, 0)
    t = tier_at(tmp_path, NumpyBlockIO.allocate(1, BLOCK))
    assert t.cached_keys() == {K(0)} and t.stats()["blocks"] == 1
    assert bytes(load_all(t, 1).read_block(0)) == payload(0)
    assert not Path(legacy_block_path(str(tmp_path), K(0))).exists()
    t.shutdown()


def test_a_kill_9_in_the_middle_of_the_move_loses_nothing(tmp_path: Path) -> None:
    for i in range(N):
        write_legacy(tmp_path, i)
    code = (
        "import os, signal\n"
        "import manager.tiering.fs_scan as s\n"
        "n = [0]\n"
        "real = os.rename\n"
        "def rename(a, b):\n"
        "    if n[0] == 5:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    n[0] += 1\n"
        "    real(a, b)\n"
        "s.os.rename = rename\n"
        "from manager.tiering.fs import FileSystemSecondaryTierManager as T\n"
        f"T(root={str(tmp_path)!r})\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -9, proc.stderr
    moved = [i for i in range(N) if Path(block_path(str(tmp_path), K(i))).exists()]
    assert len(moved) == 5  # killed with 5 moved and 7 not
    t = tier_at(tmp_path, NumpyBlockIO.allocate(N, BLOCK))
    assert t.cached_keys() == {K(i) for i in range(N)} and t.migrated_files == N - 5 and t.corrupt_files == 0
    io = load_all(t)
    assert all(bytes(io.read_block(i)) == payload(i) for i in range(N))
    assert not [p for p in tmp_path.iterdir() if len(p.name) == 2]
    t.shutdown()


def test_a_shared_root_lookup_finds_a_block_an_older_tier_wrote(tmp_path: Path) -> None:
    t = tier_at(tmp_path, NumpyBlockIO.allocate(1, BLOCK), shared_root=True)
    old = write_legacy(tmp_path, 3)  # written after the scan, by a tier of the previous version
    assert t.lookup(K(3)) is LookupResult.RETRY
    assert t.drain_jobs(timeout=20)
    assert t.lookup(K(3)) is LookupResult.HIT and t.lookups_found_on_disk == 1
    assert not old.exists() and Path(block_path(str(tmp_path), K(3))).is_file()
    assert run(t, JobMetadata(2, [K(3)], np.arange(1, dtype=np.int64), True), load=True).success
    assert bytes(t.block_io.read_block(0)) == payload(3)  # type: ignore[union-attr]
    assert t.lookup(K(4)) is LookupResult.RETRY  # in neither place: a miss
    assert t.drain_jobs(timeout=20) and t.lookup(K(4)) is LookupResult.MISS
    t.shutdown()


def test_with_fsync_the_new_fanout_directories_are_synced(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import manager.tiering.fs_scan as fs_scan

    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(fs_scan.os, "fsync", fsync)
    t = tier_at(tmp_path / "a", fsync=True)
    assert synced == [str(tmp_path / "a")]  # the root, once, after its directories were made
    t.shutdown()
    t = tier_at(tmp_path / "a", fsync=True)  # nothing made: nothing to sync
    t2 = tier_at(tmp_path / "b")  # fsync off: no sync
    assert synced == [str(tmp_path / "a")]
    t.shutdown()
    t2.shutdown()
