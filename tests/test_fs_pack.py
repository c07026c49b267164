"""The fs tier's pack layout: a store job's blocks in one file, evicted units punched out, runs
of units read with one open (buffered or O_DIRECT), damage a miss (never wrong bytes), the
start-up scan, and where a file per block is kept instead."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvevents import ConfigError
from manager import BlockIO, NumpyBlockIO, make_offload_key
from manager.tiering import JobMetadata, JobResult, SecondaryTierFactory, fs_pack
from manager.tiering import fs_places, fs_rw
from manager.tiering.fs import FileSystemSecondaryTierManager
from manager.tiering.fs_io import HEADER_SIZE, probe_o_direct
from tests.test_manager_fs_direct import BLOCK as DIRECT_BLOCK
from tests.test_manager_fs import run
from tests.test_manager_fs_direct import CopyOnlyIO

BLOCK = 8192  # two pages: packable and O_DIRECT-able
STRIDE = HEADER_SIZE + BLOCK
assert DIRECT_BLOCK == BLOCK

pytestmark = pytest.mark.skipif(not fs_pack.probe_punch("/tmp"), reason="this filesystem cannot punch holes")


def K(i: int) -> bytes:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def pattern(i: int) -> bytes:
    return bytes((i * 31 + j * 7) % 251 for j in range(BLOCK))


def tier_at(root: Path, io: BlockIO | None, **kw) -> FileSystemSecondaryTierManager:  # type: ignore[no-untyped-def]
    t = SecondaryTierFactory.create_secondary_tier({"type": "fs", "root": str(root), **kw}, block_io=io)
    assert isinstance(t, FileSystemSecondaryTierManager)
    return t


def filled(n: int) -> NumpyBlockIO:
    io = NumpyBlockIO.allocate(n, BLOCK)
    for b in range(n):
        io.write_block(b, pattern(b))
    return io


def store(t: FileSystemSecondaryTierManager, job_id: int, blocks: range) -> JobResult:
    return run(t, JobMetadata(job_id, [K(b) for b in blocks], np.array(list(blocks), dtype=np.int64), False))


def load(t: FileSystemSecondaryTierManager, job_id: int, blocks: list[int], slots: list[int]) -> JobResult:
    return run(t, JobMetadata(job_id, [K(b) for b in blocks], np.array(slots, dtype=np.int64), True), load=True)


def packs(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kvp"))


def zeroed(path: Path, unit: int) -> bool:
    with open(path, "rb") as f:
        f.seek(unit * STRIDE)
        return f.read(STRIDE) == bytes(STRIDE)


@pytest.mark.parametrize("o_direct", [True, False], ids=["o_direct", "buffered"])
def test_a_job_is_one_pack_and_loads_in_any_order(tmp_path: Path, o_direct: bool) -> None:
    if o_direct and not probe_o_direct(str(tmp_path)):
        pytest.skip("this filesystem refuses O_DIRECT")
    io = filled(12)
    t = tier_at(tmp_path, io, o_direct=o_direct, pack_blocks=5)
    assert t.stats()["layout"] == "pack" and t.stats()["pack_blocks"] == 5
    assert store(t, 1, range(12)).success
    files = packs(tmp_path)
    assert len(files) == 3 and sorted(os.path.getsize(p) for p in files) == [2 * STRIDE, 5 * STRIDE, 5 * STRIDE]
    assert not list(tmp_path.rglob("*.blk")) and t.stats()["packs"] == 3
    io.array[:] = 0
    # across packs, reversed, with a gap: every block lands in its own slot
    order = [11, 10, 7, 0, 1, 2, 4, 3, 9]
    assert load(t, 2, order, list(range(len(order)))).success
    for slot, b in enumerate(order):
        assert bytes(io.read_block(slot)) == pattern(b), f"slot {slot} (block {b})"
    assert t.stats()["loads"] == len(order)
    t.shutdown()


def test_restart_finds_every_packed_block(tmp_path: Path) -> None:
    io = filled(8)
    t = tier_at(tmp_path, io, pack_blocks=4)
    assert store(t, 1, range(8)).success
    t.take_events()
    t.shutdown()
    io2 = NumpyBlockIO.allocate(8, BLOCK)
    t2 = tier_at(tmp_path, io2, pack_blocks=4)
    assert t2.cached_keys() == {K(b) for b in range(8)} and t2.stats()["packs"] == 2
    (ev,) = t2.take_events()
    assert sorted(ev.keys) == sorted(K(b) for b in range(8)) and not ev.removed
    assert load(t2, 2, list(range(8)), list(range(8))).success
    assert all(bytes(io2.read_block(b)) == pattern(b) for b in range(8))
    t2.shutdown()


def test_eviction_punches_units_and_unlinks_an_empty_pack(tmp_path: Path) -> None:
    io = filled(14)
    t = tier_at(tmp_path, io, pack_blocks=4, capacity_blocks=8)
    assert store(t, 1, range(4)).success and store(t, 2, range(4, 8)).success
    first, second = packs(tmp_path)  # (named by the order they were written)
    assert os.stat(first).st_blocks * 512 >= 4 * STRIDE
    t.take_events()
    assert store(t, 3, range(8, 10)).success  # 10 blocks > 8: the 2 oldest go, punched out
    assert [k for e in t.take_events() if e.removed for k in e.keys] == [K(0), K(1)]
    assert zeroed(first, 0) and zeroed(first, 1) and not zeroed(first, 2)
    assert os.stat(first).st_blocks * 512 <= 2 * STRIDE  # the space is given back, not only marked
    assert store(t, 4, range(10, 12)).success
    assert [k for e in t.take_events() if e.removed for k in e.keys] == [K(2), K(3)]
    assert not first.exists()  # every unit of the first pack evicted: the file is gone
    st = t.stats()
    assert st["packs_removed"] == 1 and st["packs"] == 3 and st["units_punched"] == 3
    # touch 4 and 6 so the next evictions take 5 and 7 from the middle of the second pack
    t.touch([K(4), K(6)])
    assert store(t, 5, range(12, 14)).success
    assert [k for e in t.take_events() if e.removed for k in e.keys] == [K(5), K(7)]
    assert zeroed(second, 1) and zeroed(second, 3) and not zeroed(second, 0) and not zeroed(second, 2)
    io.array[:] = 0
    assert load(t, 6, [4, 6, 10], [0, 1, 2]).success
    assert [bytes(io.read_block(s)) for s in range(3)] == [pattern(4), pattern(6), pattern(10)]
    t.shutdown()
    # a restart sees the punched units as evicted, not as damage
    t2 = tier_at(tmp_path, NumpyBlockIO.allocate(14, BLOCK), pack_blocks=4, capacity_blocks=8)
    assert t2.cached_keys() == {K(b) for b in (4, 6, 8, 9, 10, 11, 12, 13)}
    assert t2.corrupt_files == 0 and t2.stats()["packs"] == 4
    t2.shutdown()


def test_the_index_of_packed_blocks_holds_nothing_the_garbage_collector_tracks(tmp_path: Path) -> None:
    # One tracked object per packed block (a (pack, unit) tuple) was what each store left for
    # the next full collection of an engine's heap; places are ints now, the packs a registry.
    import gc

    io = filled(16)
    t = tier_at(tmp_path, io, pack_blocks=4, capacity_blocks=12)
    places = t._places
    assert store(t, 1, range(8)).success and store(t, 2, range(8, 12)).success
    assert len(places.units) == 12 and not gc.is_tracked(places.units)
    assert len(places._packs) == 3
    assert store(t, 3, range(12, 16)).success  # 16 > 12: the first pack's 4 units evicted
    assert len(places._packs) == 3 and not gc.is_tracked(places.units)
    io.array[:] = 0
    assert load(t, 4, [15, 4, 9, 14, 5], [0, 1, 2, 3, 4]).success  # runs across packs, out of order
    assert [bytes(io.read_block(s)) for s in range(5)] == [pattern(b) for b in (15, 4, 9, 14, 5)]
    t.shutdown()
    t2 = tier_at(tmp_path, NumpyBlockIO.allocate(16, BLOCK), pack_blocks=4, capacity_blocks=12)
    assert len(t2._places.units) == 12 and not gc.is_tracked(t2._places.units) and len(t2._places._packs) == 3
    t2.shutdown()


@pytest.mark.parametrize("how", ["payload_flip", "header_flip", "zeroed_unit", "truncated", "empty", "missing"])
def test_a_damaged_pack_is_a_miss_never_wrong_bytes(tmp_path: Path, how: str) -> None:
    io = filled(4)
    t = tier_at(tmp_path, io, pack_blocks=4)
    assert store(t, 1, range(4)).success
    (path,) = packs(tmp_path)
    raw = bytearray(path.read_bytes())
    if how == "payload_flip":
        raw[2 * STRIDE + HEADER_SIZE + 100] ^= 0x01  # unit 2's payload
    elif how == "header_flip":
        raw[2 * STRIDE + 30] ^= 0x01  # unit 2's key
    elif how == "zeroed_unit":
        raw[2 * STRIDE : 3 * STRIDE] = bytes(STRIDE)
    elif how == "truncated":
        raw = raw[: 2 * STRIDE + HEADER_SIZE + 10]  # units 2 and 3 cut
    elif how == "empty":
        raw = bytearray()
    if how == "missing":
        path.unlink()
    else:
        path.write_bytes(bytes(raw))
    bad = {"payload_flip": [2], "header_flip": [2], "zeroed_unit": [2], "truncated": [2, 3]}.get(how, [0, 1, 2, 3])
    t.take_events()
    sentinel = b"\xee" * BLOCK
    for s in range(4):
        io.write_block(s, sentinel)
    for b in range(4):  # each block alone: a damaged unit fails its load; the others load
        res = load(t, 10 + b, [b], [b])
        assert res.success is (b not in bad), b
        assert bytes(io.read_block(b)) == (pattern(b) if res.success else bytes(io.read_block(b)))
        if res.success:
            assert bytes(io.read_block(b)) == pattern(b)
    assert t.cached_keys() == {K(b) for b in range(4) if b not in bad}  # dropped ...
    assert sorted(k for e in t.take_events() if e.removed for k in e.keys) == sorted(K(b) for b in bad)  # ... with removals
    t.shutdown()
    t2 = tier_at(tmp_path, NumpyBlockIO.allocate(4, BLOCK), pack_blocks=4)
    assert t2.cached_keys() == {K(b) for b in range(4) if b not in bad}
    t2.shutdown()


def test_the_scan_drops_damaged_and_cut_units_and_impossible_packs(tmp_path: Path) -> None:
    io = filled(12)
    t = tier_at(tmp_path, io, pack_blocks=4)
    for j in range(3):
        assert store(t, j, range(4 * j, 4 * j + 4)).success
    t.shutdown()
    a, b, c = packs(tmp_path)  # (named by the order they were written: blocks 0-3, 4-7, 8-11)
    raw = bytearray(a.read_bytes())
    raw[STRIDE + 30] ^= 0xFF  # unit 1's key: its header checksum no longer matches
    a.write_bytes(bytes(raw))
    b.write_bytes(b.read_bytes()[:-1])  # the last unit cut short
    raw = bytearray(c.read_bytes())
    raw[:HEADER_SIZE] = bytes(HEADER_SIZE)  # unit 0 evicted ...
    c.write_bytes(bytes(raw[:-HEADER_SIZE]))  # ... and the file cut: no stride to trust
    t2 = tier_at(tmp_path, NumpyBlockIO.allocate(12, BLOCK), pack_blocks=4)
    assert t2.cached_keys() == {K(b) for b in (0, 2, 3, 4, 5, 6)}
    assert t2.corrupt_files == 3 and not c.exists() and zeroed(a, 1)
    assert load(t2, 1, [0, 2, 3, 4, 5, 6], list(range(6))).success
    t2.shutdown()
    raw = bytearray(a.read_bytes())
    raw[30] ^= 0xFF  # unit 0's header damaged: the stride comes from the size, the rest stays
    a.write_bytes(bytes(raw))
    t3 = tier_at(tmp_path, NumpyBlockIO.allocate(12, BLOCK), pack_blocks=4)
    assert t3.cached_keys() == {K(b) for b in (2, 3, 4, 5, 6)} and t3.corrupt_files == 1 and zeroed(a, 0)
    t3.shutdown()


def test_a_key_in_two_packs_is_indexed_once_and_the_older_copy_dropped(tmp_path: Path) -> None:
    io = filled(2)
    t = tier_at(tmp_path, io, pack_blocks=4)
    assert store(t, 1, range(2)).success
    t.shutdown()
    (path,) = packs(tmp_path)
    copy = path.with_name(fs_pack.pack_name("0" * 16, 99, 2))
    copy.write_bytes(path.read_bytes())
    os.utime(path, (1, 1))  # the original is older: the copy wins
    t2 = tier_at(tmp_path, NumpyBlockIO.allocate(2, BLOCK), pack_blocks=4)
    assert t2.cached_keys() == {K(0), K(1)} and t2.stats()["packs"] == 1
    assert not path.exists() and copy.exists()
    assert load(t2, 2, [0, 1], [0, 1]).success
    t2.shutdown()


def test_a_dead_writers_temp_pack_is_removed_a_live_ones_kept(tmp_path: Path) -> None:
    code = (
        "import os\n"
        "from manager.tiering.fs import FileSystemSecondaryTierManager as T\n"
        "from manager.tiering.fs_pack import pack_name\n"
        f"t = T(root={str(tmp_path)!r})\n"
        "p = os.path.join(t._root, '3', pack_name(t._token, 3, 64)) + '.tmp'\n"
        "open(p, 'wb').write(b'half a pack')\n"
        "print(p, flush=True)\n"
        "os._exit(0)\n"  # no shutdown: as if killed mid-write
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    tmp = Path(out.stdout.strip())
    live = tier_at(tmp_path, None)
    mine = tmp_path / "4" / (fs_pack.pack_name(live._token, 1, 2) + ".tmp")
    mine.write_bytes(b"being written")
    assert not tmp.exists()  # its writer is dead
    other = tier_at(tmp_path, None)
    assert mine.exists()  # its writer runs
    other.shutdown()
    live.shutdown()


def test_where_a_file_per_block_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cases = {
        "shared": (tier_at(tmp_path / "shared", filled(2), shared_root=True), BLOCK),
        "one": (tier_at(tmp_path / "one", filled(2), pack_blocks=1), BLOCK),
        "unaligned": (tier_at(tmp_path / "unaligned", NumpyBlockIO.allocate(2, 1000)), 1000),
        "big": (tier_at(tmp_path / "big", filled(2), pack_below=BLOCK), BLOCK),  # blocks of pack_below bytes or more
        "metadata": (tier_at(tmp_path / "metadata", None), 0),
    }
    monkeypatch.setattr(fs_places, "probe_punch", lambda d: False)
    cases["no_punch"] = (tier_at(tmp_path / "no_punch", filled(2)), BLOCK)
    for name, (t, _n) in cases.items():
        assert store(t, 1, range(2)).success, name
        assert not list((tmp_path / name).rglob("*.kvp")) and len(list((tmp_path / name).rglob("*.blk"))) == 2, name
        assert t.stats()["layout"] == ("pack" if name in ("unaligned", "metadata", "big") else "block"), name
        t.shutdown()


@pytest.mark.parametrize("bad", [{"pack_blocks": 0}, {"pack_blocks": 513}, {"pack_blocks": "8"}, {"pack_blocks": True},
                                 {"pack_below": -1}, {"pack_below": "256k"}])
def test_bad_pack_config_is_a_clear_error(tmp_path: Path, bad: dict) -> None:
    name = next(iter(bad))
    with pytest.raises(ConfigError, match=name):
        tier_at(tmp_path, None, **bad)


def test_a_block_io_without_writable_views(tmp_path: Path) -> None:
    io = CopyOnlyIO(4)  # (test_manager_fs_direct's: the same 8 KiB blocks)
    io.inner.array[:] = filled(4).array
    t = tier_at(tmp_path, io, pack_blocks=4)
    assert store(t, 1, range(2)).success and len(packs(tmp_path)) == 1
    assert load(t, 2, [1, 0], [2, 3]).success
    assert bytes(io.read_block(2)) == pattern(1) and bytes(io.read_block(3)) == pattern(0) and io.writes == 2
    t.shutdown()


def test_a_failed_pack_write_claims_nothing_and_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    io = filled(4)
    t = tier_at(tmp_path, io, pack_blocks=4)
    real = fs_rw.write_pack

    def full(tmp, path, *a, **kw):  # type: ignore[no-untyped-def]
        with open(tmp, "wb") as f:
            f.write(b"partial")
        os.unlink(tmp)  # (write_pack's own cleanup, as on ENOSPC)
        raise OSError(28, "No space left on device", tmp)

    monkeypatch.setattr(fs_rw, "write_pack", full)
    assert not store(t, 1, range(4)).success
    assert t.cached_keys() == set() and t.stats()["store_errors"] == 4 and not t.take_events()
    assert not list(tmp_path.rglob("*.kvp*"))
    monkeypatch.setattr(fs_rw, "write_pack", real)
    assert store(t, 2, range(4)).success and t.cached_keys() == {K(b) for b in range(4)}  # claims were released
    t.shutdown()


def test_write_pack_short_write_is_enospc_and_cleans_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "pwritev", lambda fd, iov, off: 10)
    blocks = [(K(0), memoryview(pattern(0)))]
    with pytest.raises(OSError) as err:
        fs_pack.write_pack(str(tmp_path / "p.tmp"), str(tmp_path / "p"), blocks, fs_pack.PackBuffers(), False, 1, False)
    assert err.value.errno == 28 and not list(tmp_path.iterdir())


def live_units(root: Path) -> int:
    """Units on disk whose header page is not a hole."""
    n = 0
    for p in packs(root):
        raw = p.read_bytes()
        n += sum(1 for off in range(0, len(raw), STRIDE) if raw[off : off + HEADER_SIZE] != bytes(HEADER_SIZE))
    return n


def test_loads_and_evictions_of_one_pack_at_once(tmp_path: Path) -> None:
    """Stores evict units of a pack while loads of it are in flight: every load has its
    bytes (blocks being read are not evicted), and the disk holds exactly the indexed blocks."""
    n = 64
    io = NumpyBlockIO.allocate(2 * n, BLOCK)
    for b in range(2 * n):
        io.write_block(b, pattern(b))
    ref = io.array.copy()
    t = tier_at(tmp_path, io, pack_blocks=64, capacity_blocks=n, load_threads=4)
    assert store(t, 1, range(n)).success
    for b in range(0, n, 2):  # every load first: their blocks are being read from here on
        t.submit_load(JobMetadata(100 + b, [K(b), K(b + 1)], np.array([b, b + 1], dtype=np.int64), True))
    for b in range(n, 2 * n, 2):
        t.submit_store(JobMetadata(200 + b, [K(b), K(b + 1)], np.array([b, b + 1], dtype=np.int64), False))
    assert t.drain_jobs(timeout=30)
    results = t.get_finished_jobs()
    assert len(results) == n and all(r.success for r in results)
    assert np.array_equal(io.array, ref)
    assert t.stats()["evictions"] >= n
    assert live_units(tmp_path) == len(t.cached_keys()) and len(packs(tmp_path)) == t.stats()["packs"]
    t.shutdown()


def test_a_root_of_block_files_is_read_by_a_packing_tier_and_migrates_by_eviction(tmp_path: Path) -> None:
    """An older version's root (a file per block) under today's default: its blocks are found
    and loaded as block files, new stores go into packs, and evicting the old blocks unlinks
    their files."""
    io = filled(8)
    old = tier_at(tmp_path, io, pack_blocks=1)
    assert store(old, 1, range(4)).success
    old.shutdown()
    t = tier_at(tmp_path, io, capacity_blocks=4)  # the default layout: packs
    assert t.stats()["layout"] == "pack" and t.cached_keys() == {K(b) for b in range(4)}
    io.array[:] = 0
    assert load(t, 2, [3, 0], [0, 1]).success and bytes(io.read_block(0)) == pattern(3)
    for b in range(8):
        io.write_block(b, pattern(b))
    t.take_events()
    assert store(t, 3, range(4, 8)).success  # a pack; the four block files evicted (LRU)
    assert sorted(k for e in t.take_events() if e.removed for k in e.keys) == sorted(K(b) for b in range(4))
    assert not list(tmp_path.rglob("*.blk")) and len(packs(tmp_path)) == 1
    t.shutdown()
