"""The fs tier under damaged or odd directories (issue 10, items 4 and 6): never a hit with
wrong or missing bytes; the start-up scan deletes only what it owns and never crashes."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from manager import LookupResult, NumpyBlockIO, make_offload_key
from manager.tiering import JobMetadata, JobResult, SecondaryTierFactory
from manager.tiering.fs import FileSystemSecondaryTierManager

BLOCK = 4096


def K(i: int) -> bytes:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def ids(*b: int) -> np.ndarray:
    return np.array(b, dtype=np.int64)


def tier_at(root: Path, io: NumpyBlockIO | None = None, **kw) -> FileSystemSecondaryTierManager:  # type: ignore[no-untyped-def]
    t = SecondaryTierFactory.create_secondary_tier({"type": "fs", "root": str(root), "pack_blocks": 1, **kw}, block_io=io)
    assert isinstance(t, FileSystemSecondaryTierManager)
    return t


def run(t: FileSystemSecondaryTierManager, job: JobMetadata, load: bool = False) -> JobResult:
    (t.submit_load if load else t.submit_store)(job)
    assert t.drain_jobs(timeout=10)
    (res,) = t.get_finished_jobs()
    return res


def test_empty_payload_is_not_a_hit(tmp_path: Path) -> None:
    """A tier without block_io writes valid files with an empty payload; a tier with block_io
    on the same root must fail the load (the slot would keep its old bytes), not report it."""
    meta_only = tier_at(tmp_path)
    assert run(meta_only, JobMetadata(1, [K(1)], ids(0), False)).success
    meta_only.shutdown()
    io = NumpyBlockIO.allocate(2, BLOCK)
    io.write_block(0, b"\x5a" * BLOCK)
    t = tier_at(tmp_path, io)
    assert t.lookup(K(1)) is LookupResult.HIT
    t.take_events()
    assert run(t, JobMetadata(2, [K(1)], ids(0), True), load=True) == JobResult(2, False)
    assert bytes(io.read_block(0)) == b"\x5a" * BLOCK
    assert t.lookup(K(1)) is LookupResult.MISS  # dropped, with a removal
    assert [(e.keys, e.removed) for e in t.take_events()] == [([K(1)], True)]
    assert t.payload_mismatches == 1
    t.shutdown()


def test_scan_never_leaves_its_root_or_deletes_foreign_files(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (outside / "00").mkdir(parents=True)
    victims = [outside / "00" / "0000000000000001.blk.7.tmp", outside / "00" / "00000000000000010000000a.blk",
               outside / "junk.tmp"]
    for v in victims:
        v.write_bytes(b"KVB1 not ours")
    root.mkdir()
    (root / "ab").symlink_to(outside / "00", target_is_directory=True)  # a fan-out name, a link out
    (root / "00").mkdir()
    (root / "00" / "00000000000000020000000b.blk").symlink_to(victims[1])  # a block-named link
    (root / "00" / "0000000000000003.blk").mkdir()  # a directory named like a block
    (root / "00" / "notes.blk").write_bytes(b"someone else's")  # not our name
    (root / "00" / "00000000000000040000000c.blk").write_bytes(b"XXXXforeign magic")  # our name, not ours
    (root / "readme.blk").write_bytes(b"top level")
    t = tier_at(root, NumpyBlockIO.allocate(1, BLOCK))
    assert t.cached_keys() == set()
    for v in victims:
        assert v.exists(), v
    assert (root / "00" / "0000000000000003.blk").is_dir()
    assert (root / "00" / "notes.blk").exists() and (root / "readme.blk").exists()
    assert (root / "00" / "00000000000000040000000c.blk").exists()
    assert (root / "00" / "00000000000000020000000b.blk").is_symlink()
    assert t.foreign_files >= 6 and t.corrupt_files == 0
    t.shutdown()


def test_scan_survives_a_read_only_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Deleting (a torn file, a stale temp file) and creating (the owner lock) fail with
    PermissionError, as on a read-only root (simulated: the tests may run as root)."""
    io = NumpyBlockIO.allocate(2, BLOCK)
    io.write_block(0, b"\x01" * BLOCK)
    io.write_block(1, b"\x02" * BLOCK)
    t = tier_at(tmp_path, io)
    assert run(t, JobMetadata(1, [K(1), K(2)], ids(0, 1), False)).success
    t.shutdown()
    p2 = t._path(K(2))
    p2.write_bytes(p2.read_bytes()[:-5])  # torn
    (p2.parent / (p2.name + ".99.tmp")).write_bytes(b"stale")

    def denied(*a, **k):  # type: ignore[no-untyped-def]
        raise PermissionError(13, "Read-only file system")

    import manager.tiering.fs as fsmod

    monkeypatch.setattr(fsmod.os, "unlink", denied)
    monkeypatch.setattr(fsmod.os, "mkdir", denied)
    monkeypatch.setattr(Path, "mkdir", denied)
    monkeypatch.setattr(Path, "unlink", denied)
    io2 = NumpyBlockIO.allocate(2, BLOCK)
    t2 = tier_at(tmp_path, io2)
    assert t2.cached_keys() == {K(1)}  # the torn one is a miss even when it cannot be deleted
    assert t2.scan_errors >= 2 and t2.corrupt_files == 1
    assert run(t2, JobMetadata(2, [K(1)], ids(1), True), load=True).success
    assert bytes(io2.read_block(1)) == b"\x01" * BLOCK
    t2.shutdown()


def test_two_tiers_on_one_root_keep_each_others_temp_files(tmp_path: Path) -> None:
    a = tier_at(tmp_path, NumpyBlockIO.allocate(1, BLOCK))
    (tmp_path / "00").mkdir(exist_ok=True)
    # a's write in flight: the temp file name it would use
    tmp = Path(str(a._path(K(5))) + f".{a._token}.1.tmp")
    tmp.write_bytes(b"half")
    b = tier_at(tmp_path, NumpyBlockIO.allocate(1, BLOCK))
    assert tmp.exists()  # a still runs: b's scan left its temp file alone
    b.shutdown()
    a.shutdown()  # a is gone: its temp file is stale now
    c = tier_at(tmp_path, NumpyBlockIO.allocate(1, BLOCK))
    assert not tmp.exists()
    c.shutdown()
    assert not list((tmp_path / ".owners").iterdir())


def test_a_dead_process_temp_files_are_removed(tmp_path: Path) -> None:
    """The owner lock dies with its process (flock), whatever its pid was."""
    import subprocess
    import sys

    code = (
        "import os, sys\n"
        "from manager.tiering.fs import FileSystemSecondaryTierManager as T\n"
        f"t = T(root={str(tmp_path)!r})\n"
        "p = str(t._path(bytes(12))) + f'.{t._token}.1.tmp'\n"
        "os.makedirs(os.path.dirname(p), exist_ok=True)\n"
        "open(p, 'wb').write(b'x')\n"
        "print(p, flush=True)\n"
        "os._exit(0)\n"  # no shutdown: as if killed
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    tmp = Path(out.stdout.strip())
    assert tmp.exists()
    t = tier_at(tmp_path)
    assert not tmp.exists()
    t.shutdown()
