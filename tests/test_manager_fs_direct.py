"""The fs tier's direct read/write path (issue 14): loads land straight in the slot, with
and without O_DIRECT, aligned or not; damaged, truncated and empty files are never a hit;
the checksum falls back to zlib's CRC32 when no CRC32C implementation is installed.

Every test runs on both load paths: Python (``fs_io.read_block_into``) and, where it is built,
the C extension (``fs_io.native``)."""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np
import pytest

from manager import LookupResult, NumpyBlockIO, make_offload_key
from manager.base import BlockIO
from manager.tiering import JobMetadata, JobResult, SecondaryTierFactory
from manager.tiering import fs_io
from manager.tiering.fs import FileSystemSecondaryTierManager

BLOCK = 8192  # two pages: O_DIRECT-able
PATH = {"native_io": False}


@pytest.fixture(autouse=True, params=["python", "c"])
def load_path(request: pytest.FixtureRequest) -> str:
    if request.param == "c" and fs_io.native is None:
        pytest.skip("the C extension manager.tiering._fsio is not built")
    PATH["native_io"] = request.param == "c"
    return str(request.param)


def K(i: int) -> bytes:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def ids(*b: int) -> np.ndarray:
    return np.array(b, dtype=np.int64)


def host(n: int, aligned: bool) -> NumpyBlockIO:
    """A page-aligned host buffer (like a pinned one), or one deliberately off by 8 bytes."""
    m = mmap.mmap(-1, n * BLOCK + 4096)
    off = 0 if aligned else 8
    return NumpyBlockIO(np.frombuffer(m, np.uint8, n * BLOCK, off).reshape(n, BLOCK))


def tier_at(root: Path, io: BlockIO | None, **kw) -> FileSystemSecondaryTierManager:  # type: ignore[no-untyped-def]
    t = SecondaryTierFactory.create_secondary_tier({"type": "fs", "root": str(root), "pack_blocks": 1, **PATH, **kw}, block_io=io)
    assert isinstance(t, FileSystemSecondaryTierManager)
    assert t.stats()["native_io"] is PATH["native_io"]
    return t


def run(t: FileSystemSecondaryTierManager, job: JobMetadata, load: bool = False) -> JobResult:
    (t.submit_load if load else t.submit_store)(job)
    assert t.drain_jobs(timeout=10)
    (res,) = t.get_finished_jobs()
    return res


def pattern(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_round_trip(tmp_path: Path, direct: bool, aligned: bool) -> None:
    if direct and not fs_io.probe_o_direct(str(tmp_path)):
        pytest.skip("this filesystem refuses O_DIRECT")
    io = host(4, aligned)
    for b in range(4):
        io.write_block(b, pattern(b))
    t = tier_at(tmp_path, io, o_direct=direct, load_threads=2)
    assert t.o_direct is direct and t.stats()["o_direct"] is direct
    assert run(t, JobMetadata(1, [K(b) for b in range(4)], ids(0, 1, 2, 3), False)).success
    io.array[:] = 0
    assert run(t, JobMetadata(2, [K(3), K(2), K(1), K(0)], ids(0, 1, 2, 3), True), load=True).success
    for b in range(4):
        assert bytes(io.read_block(b)) == pattern(3 - b)
    # the file: one header page, then exactly the payload
    assert t._path(K(0)).stat().st_size == fs_io.HEADER_SIZE + BLOCK
    t.shutdown()


def test_o_direct_falls_back_when_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe decides once: where O_DIRECT is refused (tmpfs, some overlays), the tier uses
    buffered I/O and works."""
    monkeypatch.setattr(fs_io, "O_DIRECT", 0)
    assert not fs_io.probe_o_direct(str(tmp_path))
    io = host(1, True)
    io.write_block(0, pattern(7))
    t = tier_at(tmp_path, io)
    assert t.o_direct is False
    assert run(t, JobMetadata(1, [K(1)], ids(0), False)).success
    io.array[:] = 0
    assert run(t, JobMetadata(2, [K(1)], ids(0), True), load=True).success
    assert bytes(io.read_block(0)) == pattern(7)
    t.shutdown()


class CopyOnlyIO(BlockIO):
    """A BlockIO without a writable view: the tier reads into its own buffer, then copies."""

    def __init__(self, n: int) -> None:
        self.inner = NumpyBlockIO.allocate(n, BLOCK)
        self.block_nbytes = BLOCK
        self.writes = 0

    def read_block(self, block_id: int) -> memoryview:
        return self.inner.read_block(block_id)

    def write_block(self, block_id: int, data) -> None:  # type: ignore[no-untyped-def]
        self.writes += 1
        self.inner.write_block(block_id, data)


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_block_io_without_a_writable_view(tmp_path: Path, direct: bool) -> None:
    if direct and not fs_io.probe_o_direct(str(tmp_path)):
        pytest.skip("this filesystem refuses O_DIRECT")
    io = CopyOnlyIO(2)
    io.write_block(0, pattern(1))
    t = tier_at(tmp_path, io, o_direct=direct)
    assert run(t, JobMetadata(1, [K(1)], ids(0), False)).success
    assert run(t, JobMetadata(2, [K(1)], ids(1), True), load=True).success
    assert bytes(io.read_block(1)) == pattern(1) and io.writes == 2
    t.shutdown()


def _damage(path: Path, how: str) -> None:
    raw = bytearray(path.read_bytes())
    if how == "payload_flip":
        raw[fs_io.HEADER_SIZE + 1234] ^= 0x01
    elif how == "header_flip":  # inside the key: the header checksum catches it
        raw[30] ^= 0x40
    elif how == "header_crc_flip":
        raw[fs_io.HEADER_SIZE - 4000] ^= 0x01  # in the padding after the checksum: harmless
        raw[24 + 12] ^= 0x01  # the header checksum itself (key is 12 bytes)
    elif how == "truncated_payload":
        del raw[-100:]
    elif how == "header_only":
        del raw[fs_io.HEADER_SIZE :]
    elif how == "half_header":
        del raw[100:]
    elif how == "empty":
        raw = bytearray()
    path.write_bytes(bytes(raw))


DAMAGES = ["payload_flip", "header_flip", "header_crc_flip", "truncated_payload", "header_only", "half_header", "empty"]


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
@pytest.mark.parametrize("how", DAMAGES)
def test_damaged_files_are_never_a_hit(tmp_path: Path, how: str, direct: bool) -> None:
    """Damage after the start-up scan (the tier indexed the file as whole): the load fails,
    the slot is not reported loaded, and the file is dropped with a removal."""
    if direct and not fs_io.probe_o_direct(str(tmp_path)):
        pytest.skip("this filesystem refuses O_DIRECT")
    io = host(2, True)
    io.write_block(0, pattern(3))
    t = tier_at(tmp_path, io, o_direct=direct)
    assert run(t, JobMetadata(1, [K(1)], ids(0), False)).success
    t.take_events()
    _damage(t._path(K(1)), how)
    assert run(t, JobMetadata(2, [K(1)], ids(1), True), load=True) == JobResult(2, False)
    assert t.lookup(K(1)) is LookupResult.MISS and not t._path(K(1)).exists()
    assert [(e.keys, e.removed) for e in t.take_events()] == [([K(1)], True)]
    assert t.corrupt_files == 1 and t.load_errors == 1 and t.loads == 0
    t.shutdown()


def test_a_file_of_another_block_size_is_a_miss(tmp_path: Path) -> None:
    big = NumpyBlockIO.allocate(1, 2 * BLOCK)
    big.write_block(0, pattern(1) + pattern(2))
    t = tier_at(tmp_path, big)
    assert run(t, JobMetadata(1, [K(1)], ids(0), False)).success
    t.shutdown()
    io = host(1, True)
    io.write_block(0, pattern(9))
    t2 = tier_at(tmp_path, io)
    assert t2.lookup(K(1)) is LookupResult.HIT  # the scan checks the header, not the size
    assert run(t2, JobMetadata(2, [K(1)], ids(0), True), load=True) == JobResult(2, False)
    assert t2.payload_mismatches == 1 and t2.lookup(K(1)) is LookupResult.MISS
    t2.shutdown()


def test_scan_drops_torn_files_and_the_previous_format(tmp_path: Path) -> None:
    io = host(2, True)
    io.write_block(0, pattern(1))
    io.write_block(1, pattern(2))
    t = tier_at(tmp_path, io)
    assert run(t, JobMetadata(1, [K(1), K(2)], ids(0, 1), False)).success
    t.shutdown()
    _damage(t._path(K(1)), "truncated_payload")
    legacy = t._path(K(3))
    legacy.write_bytes(b"KVB1" + bytes(100))  # a block file of the previous format
    t2 = tier_at(tmp_path, io)
    assert t2.cached_keys() == {K(2)} and t2.corrupt_files == 2
    assert not t._path(K(1)).exists() and not legacy.exists()
    t2.shutdown()


def test_checksum_kinds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a fast CRC32C files carry zlib's CRC32 (and say so in their header); a process
    with CRC32C reads them; a process without a fast CRC32C still verifies CRC32C files (the
    pure-Python table). A file whose checksum kind this format does not know is neither
    offered nor deleted by the scan, and never loaded."""
    io = host(2, True)
    io.write_block(0, pattern(5))
    io.write_block(1, pattern(6))
    monkeypatch.setattr(fs_io, "crc32c", None)
    t = tier_at(tmp_path, io)
    assert t.stats()["checksum"] == "crc32"
    assert run(t, JobMetadata(1, [K(1)], ids(0), False)).success
    io.array[:] = 0
    assert run(t, JobMetadata(2, [K(1)], ids(0), True), load=True).success
    assert bytes(io.read_block(0)) == pattern(5)
    t.shutdown()
    fast = fs_io.crc32c if fs_io.crc32c is not None else fs_io.crc32c_python
    monkeypatch.setattr(fs_io, "crc32c", fast)
    t2 = tier_at(tmp_path, io)
    assert t2.stats()["checksum"] == "crc32c"
    io.write_block(1, pattern(6))
    assert run(t2, JobMetadata(3, [K(1)], ids(0), True), load=True).success  # a CRC32 file
    assert run(t2, JobMetadata(4, [K(2)], ids(1), False)).success  # a CRC32C file
    t2.shutdown()
    assert t._path(K(2)).read_bytes()[5] == fs_io.CRC_CRC32C and t._path(K(1)).read_bytes()[5] == fs_io.CRC_CRC32
    monkeypatch.setattr(fs_io, "crc32c", None)
    io.array[:] = 0
    t3 = tier_at(tmp_path, io)  # no fast CRC32C: the scan and the load verify it in Python (or C)
    assert t3.lookup(K(2)) is LookupResult.HIT and t3.lookup(K(1)) is LookupResult.HIT
    assert run(t3, JobMetadata(5, [K(2), K(1)], ids(0, 1), True), load=True).success
    assert bytes(io.read_block(0)) == pattern(6) and bytes(io.read_block(1)) == pattern(5)
    t3.shutdown()
    raw = bytearray(t._path(K(2)).read_bytes())
    raw[5] = 7  # a checksum kind from the future
    t._path(K(2)).write_bytes(bytes(raw))
    t4 = tier_at(tmp_path, io)
    assert t4.lookup(K(2)) is LookupResult.MISS and t._path(K(2)).exists() and t4.foreign_files == 1
    t4.shutdown()


def test_crc32c_python_matches_the_fast_one() -> None:
    data = np.random.default_rng(3).integers(0, 256, 40_000, dtype=np.uint8).tobytes()
    assert fs_io.crc32c_python(b"123456789") == 0xE3069283  # the standard check value
    if fs_io.crc32c is not None:  # (40,000 bytes: past the C path's three-stream rounds of 12 KiB)
        for n in (0, 1, 7, 8, 33, 5000, 40_000):
            assert fs_io.crc32c_python(data[:n]) == fs_io.crc32c(data[:n])


def test_store_errors_leave_nothing_claimed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A short write (disk full) fails the job; no temp file, no event, not indexed. (The
    failure is injected into the Python path's os.pwritev; the C path's cleanup is tested in
    tests/test_manager_fs.py::test_a_failed_rename_leaves_nothing.)"""
    if PATH["native_io"]:
        pytest.skip("injects the failure into the Python store path")
    io = host(1, True)
    io.write_block(0, pattern(1))
    t = tier_at(tmp_path, io, o_direct=False)
    monkeypatch.setattr(fs_io.os, "pwritev", lambda fd, bufs, off: 100)
    assert run(t, JobMetadata(1, [K(1)], ids(0), False)) == JobResult(1, False)
    monkeypatch.undo()
    assert t.store_errors == 1 and t.lookup(K(1)) is LookupResult.MISS and t.take_events() == []
    assert not list(tmp_path.rglob("*.tmp")) and not t._path(K(1)).exists()
    t.shutdown()


def test_fsync_store(tmp_path: Path) -> None:
    io = host(2, True)
    io.write_block(0, pattern(1))
    t = tier_at(tmp_path, io, fsync=True)
    assert run(t, JobMetadata(1, [K(1)], ids(0), False)).success
    assert run(t, JobMetadata(2, [K(1)], ids(1), True), load=True).success
    assert bytes(io.read_block(1)) == pattern(1)
    t.shutdown()


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
@pytest.mark.parametrize("how", ["wrong_key", "missing"])
def test_wrong_key_and_missing_files_are_never_a_hit(tmp_path: Path, how: str, direct: bool) -> None:
    """A whole, valid block file of another key under this key's name, or no file at all
    (deleted behind the tier's back): the load fails and the key is dropped with a removal."""
    if direct and not fs_io.probe_o_direct(str(tmp_path)):
        pytest.skip("this filesystem refuses O_DIRECT")
    io = host(2, True)
    io.write_block(0, pattern(1))
    io.write_block(1, pattern(2))
    t = tier_at(tmp_path, io, o_direct=direct)
    assert run(t, JobMetadata(1, [K(1), K(2)], ids(0, 1), False)).success
    t.take_events()
    if how == "wrong_key":
        t._path(K(2)).replace(t._path(K(1)))
    else:
        t._path(K(1)).unlink()
    io.array[:] = 0
    assert run(t, JobMetadata(2, [K(1)], ids(0), True), load=True) == JobResult(2, False)
    assert t.lookup(K(1)) is LookupResult.MISS and t.loads == 0 and t.load_errors == 1
    assert [(e.keys, e.removed) for e in t.take_events()] == [([K(1)], True)]
    t.shutdown()


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
def test_one_damaged_block_fails_its_job_and_only_it_is_dropped(tmp_path: Path, aligned: bool) -> None:
    io = host(8, aligned)
    for b in range(8):
        io.write_block(b, pattern(b))
    t = tier_at(tmp_path, io, load_threads=3)
    keys = [K(b) for b in range(8)]
    assert run(t, JobMetadata(1, keys, ids(*range(8)), False)).success
    t.take_events()
    _damage(t._path(K(5)), "payload_flip")
    io.array[:] = 0
    assert run(t, JobMetadata(2, keys, ids(*range(8)), True), load=True) == JobResult(2, False)
    assert t.lookup(K(5)) is LookupResult.MISS and t.corrupt_files == 1
    assert [(e.keys, e.removed) for e in t.take_events()] == [([K(5)], True)]
    others = [b for b in range(8) if b != 5]
    assert run(t, JobMetadata(3, [K(b) for b in others], ids(*others), True), load=True).success
    for b in others:
        assert bytes(io.read_block(b)) == pattern(b)
    t.shutdown()


def test_native_io_demanded_but_not_built(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvevents.errors import ConfigError

    monkeypatch.setattr(fs_io, "native", None)
    with pytest.raises(ConfigError, match="native_io=True"):
        FileSystemSecondaryTierManager(root=tmp_path, native_io=True)
    t = FileSystemSecondaryTierManager(root=tmp_path)  # auto: the Python path
    assert t.stats()["native_io"] is False
    t.shutdown()


@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
@pytest.mark.parametrize("how", ["truncated_payload", "header_only", "half_header", "empty", "trailing_bytes"])
def test_a_file_of_the_wrong_size_leaves_the_slot_alone(tmp_path: Path, how: str, direct: bool) -> None:
    """An O_DIRECT read past the end of a file zeroes the rest of the buffer, so a short file
    read straight into a page-aligned slot clobbered it; a file whose size is not header +
    block is now read as far as its header only."""
    if direct and not fs_io.probe_o_direct(str(tmp_path)):
        pytest.skip("this filesystem refuses O_DIRECT")
    io = host(2, True)
    io.write_block(0, pattern(3))
    t = tier_at(tmp_path, io, o_direct=direct)
    assert run(t, JobMetadata(1, [K(1)], ids(0), False)).success
    if how == "trailing_bytes":
        with open(t._path(K(1)), "ab") as f:
            f.write(b"x")
    else:
        _damage(t._path(K(1)), how)
    io.write_block(1, pattern(4))
    assert run(t, JobMetadata(2, [K(1)], ids(1), True), load=True) == JobResult(2, False)
    assert bytes(io.read_block(1)) == pattern(4)
    assert t.lookup(K(1)) is LookupResult.MISS and t.corrupt_files == 1
    t.shutdown()
