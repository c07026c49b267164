"""The "fs" secondary tier: real bytes, atomic writes, torn/corrupt files are misses,
non-blocking submits, capacity eviction with events, restart."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from kvevents import ConfigError
from manager import CPUOffloadingManager, LookupResult, NumpyBlockIO, ReqContext, make_offload_key
from manager.tiering import JobMetadata, JobResult, SecondaryTierFactory, TieringOffloadingManager
from manager.tiering.fs import FileSystemSecondaryTierManager

BLOCK = 64


def K(i: int) -> bytes:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def ids(*b: int) -> np.ndarray:
    return np.array(b, dtype=np.int64)


def tier_at(root: Path, io: NumpyBlockIO | None = None, **kw) -> FileSystemSecondaryTierManager:  # type: ignore[no-untyped-def]
    t = SecondaryTierFactory.create_secondary_tier({"type": "fs", "root": str(root), **kw}, block_io=io)
    assert isinstance(t, FileSystemSecondaryTierManager)
    return t


def fill(io: NumpyBlockIO, block: int, seed: int) -> bytes:
    data = bytes((seed + i) % 256 for i in range(BLOCK))
    io.write_block(block, data)
    return data


def run(t: FileSystemSecondaryTierManager, job: JobMetadata, load: bool = False) -> JobResult:
    (t.submit_load if load else t.submit_store)(job)
    assert t.drain_jobs(timeout=10)
    (res,) = t.get_finished_jobs()
    return res


def test_store_load_round_trip_and_restart(tmp_path: Path) -> None:
    io = NumpyBlockIO.allocate(4, BLOCK)
    d1, d2 = fill(io, 0, 1), fill(io, 1, 2)
    t = tier_at(tmp_path, io)
    assert run(t, JobMetadata(1, [K(1), K(2)], ids(0, 1), False)) == JobResult(1, True)
    assert t.lookup(K(1)) is LookupResult.HIT and t.lookup(K(3)) is LookupResult.MISS
    evs = t.take_events()  # (a store task announces its blocks in one event, in key order)
    assert [k for e in evs for k in e.keys] == [K(1), K(2)]
    assert {(e.removed, e.medium) for e in evs} == {(False, "STORAGE")}
    t.shutdown()
    assert not list(tmp_path.rglob("*.tmp"))
    # Restart: a new tier on the same directory finds the blocks and announces them.
    io2 = NumpyBlockIO.allocate(4, BLOCK)
    t2 = tier_at(tmp_path, io2)
    assert t2.cached_keys() == {K(1), K(2)}
    (ev,) = t2.take_events()
    assert sorted(ev.keys) == [K(1), K(2)] and not ev.removed
    assert run(t2, JobMetadata(2, [K(2), K(1)], ids(3, 2), True), load=True) == JobResult(2, True)
    assert bytes(io2.read_block(3)) == d2 and bytes(io2.read_block(2)) == d1
    t2.shutdown()


def test_torn_and_corrupt_files_are_misses(tmp_path: Path) -> None:
    io = NumpyBlockIO.allocate(4, BLOCK)
    for b in range(3):
        fill(io, b, b)
    t = tier_at(tmp_path, io)
    assert run(t, JobMetadata(1, [K(1), K(2), K(3)], ids(0, 1, 2), False)).success
    t.shutdown()
    p1, p2, p3 = (t._path(K(i)) for i in (1, 2, 3))
    p1.write_bytes(p1.read_bytes()[:-10])  # torn: a crash mid-write without the rename
    raw = bytearray(p2.read_bytes())
    raw[-1] ^= 0xFF  # same length, bad checksum
    p2.write_bytes(bytes(raw))
    (p3.parent / (p3.name + ".123.tmp")).write_bytes(b"partial")  # an interrupted temp file
    t2 = tier_at(tmp_path, NumpyBlockIO.allocate(4, BLOCK))
    assert t2.lookup(K(1)) is LookupResult.MISS  # torn: dropped at start-up
    assert t2.corrupt_files == 1 and not p1.exists()
    assert not list(tmp_path.rglob("*.tmp"))
    assert t2.lookup(K(2)) is LookupResult.HIT  # checksum is verified on load
    t2.take_events()
    before = bytes(t2.block_io.read_block(0))  # type: ignore[union-attr]
    assert run(t2, JobMetadata(2, [K(2)], ids(0), True), load=True) == JobResult(2, False)
    assert bytes(t2.block_io.read_block(0)) == before  # type: ignore[union-attr]  # no bad data
    assert t2.lookup(K(2)) is LookupResult.MISS and not p2.exists()
    assert [(e.keys, e.removed) for e in t2.take_events()] == [([K(2)], True)]
    assert run(t2, JobMetadata(3, [K(3)], ids(1), True), load=True).success
    t2.shutdown()


def test_writes_are_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that dies after part of the data leaves no visible block and no temp file.
    (The Python store path: the failure is injected into its os.replace; both paths below.)"""
    io = NumpyBlockIO.allocate(2, BLOCK)
    fill(io, 0, 7)
    t = tier_at(tmp_path, io, native_io=False)
    import manager.tiering.fs as fsmod

    real_replace = fsmod.os.replace

    def boom(src, dst):  # type: ignore[no-untyped-def]
        raise OSError("disk full")

    monkeypatch.setattr(fsmod.os, "replace", boom)
    assert run(t, JobMetadata(1, [K(1)], ids(0), False)) == JobResult(1, False)
    assert t.store_errors == 1 and t.lookup(K(1)) is LookupResult.MISS
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and p.parent.name != ".owners"]
    monkeypatch.setattr(fsmod.os, "replace", real_replace)
    assert run(t, JobMetadata(2, [K(1)], ids(0), False)).success
    t.shutdown()


@pytest.mark.parametrize("native", [False, True], ids=["python", "c"])
def test_a_failed_rename_leaves_nothing(tmp_path: Path, native: bool) -> None:
    """The rename into place fails (the block's name is taken by a directory): no visible
    block, no temp file, the job fails, the key is not claimed; once the name is free the
    same store succeeds. On both store paths (the C one renames in C)."""
    from manager.tiering import fs_io

    if native and fs_io.native is None:
        pytest.skip("the C extension manager.tiering._fsio is not built")
    io = NumpyBlockIO.allocate(2, BLOCK)
    data = fill(io, 0, 7)
    t = tier_at(tmp_path, io, native_io=native)
    t._path(K(1)).parent.mkdir(parents=True, exist_ok=True)
    t._path(K(1)).mkdir()
    assert run(t, JobMetadata(1, [K(1)], ids(0), False)) == JobResult(1, False)
    assert t.store_errors == 1 and t.lookup(K(1)) is LookupResult.MISS and t.take_events() == []
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and p.parent.name != ".owners"]
    t._path(K(1)).rmdir()
    assert run(t, JobMetadata(2, [K(1)], ids(0), False)).success
    io.array[:] = 0
    assert run(t, JobMetadata(3, [K(1)], ids(1), True), load=True).success
    assert bytes(io.read_block(1)) == data
    t.shutdown()


def test_submits_never_block(tmp_path: Path) -> None:
    io = NumpyBlockIO.allocate(2, BLOCK)
    t = tier_at(tmp_path, io, num_threads=1)
    gate = threading.Event()
    t._stores.submit(gate.wait)  # occupy the only store worker
    t.submit_store(JobMetadata(1, [K(1)], ids(0), False))  # returns at once
    assert t.has_pending_work() and t.get_finished_jobs() == []
    assert not t.drain_jobs(timeout=0.05)
    gate.set()
    assert t.drain_jobs(timeout=10)
    assert t.get_finished_jobs() == [JobResult(1, True)]
    t.shutdown()


def test_capacity_evicts_lru_not_being_read(tmp_path: Path) -> None:
    io = NumpyBlockIO.allocate(4, BLOCK)
    t = tier_at(tmp_path, io, capacity_blocks=2)
    assert run(t, JobMetadata(1, [K(1), K(2)], ids(0, 1), False)).success
    t.touch([K(1)])
    assert run(t, JobMetadata(2, [K(3)], ids(2), False)).success
    assert t.cached_keys() == {K(1), K(3)} and not t._path(K(2)).exists()
    evs = [(e.keys, e.removed) for e in t.take_events()]
    assert evs[-1] == ([K(2)], True) and t.evictions == 1
    # Restart with a smaller capacity: what no longer fits is evicted (and announced).
    t.shutdown()
    t2 = tier_at(tmp_path, io, capacity_blocks=1)
    assert len(t2.cached_keys()) == 1
    evs2 = t2.take_events()
    assert [e.removed for e in evs2] == [False, True]
    t2.shutdown()


def test_bad_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="capacity_blocks"):
        tier_at(tmp_path, capacity_blocks=0)
    with pytest.raises(ConfigError, match="offload_policy"):
        tier_at(tmp_path, offload_policy="whole")
    with pytest.raises(ConfigError, match="bad arguments"):
        SecondaryTierFactory.create_secondary_tier({"type": "fs"})  # root missing


def test_tiering_with_fs_promotes_real_bytes(tmp_path: Path) -> None:
    io = NumpyBlockIO.allocate(4, BLOCK)
    fs = tier_at(tmp_path)
    m = TieringOffloadingManager(CPUOffloadingManager(4, enable_events=True), [fs], block_io=io)
    ctx = ReqContext("a")
    out = m.prepare_store([K(1)], ctx)
    assert out is not None
    data = fill(io, int(out.store_spec.block_ids[0]), 9)
    m.complete_store([K(1)], ctx)
    assert m.drain_jobs(timeout=10)
    m.on_schedule_end()
    m.on_schedule_end()
    assert fs.lookup(K(1)) is LookupResult.HIT and not m.has_pending_work()
    m.primary.reset_cache()  # drop it from the primary
    io.array[:] = 0
    assert m.lookup(K(1), ctx) is LookupResult.RETRY
    m.on_schedule_end()  # submits the promotion
    assert m.drain_jobs(timeout=10)
    m.on_schedule_end()
    assert m.lookup(K(1), ctx) is LookupResult.HIT
    assert bytes(io.read_block(m.primary.block_id(K(1)))) == data  # type: ignore[attr-defined,arg-type]
    m.shutdown()
