"""The fs tier's C load path (``manager.tiering._fsio``) on its own: its CRC32C against the
standard check value and its own table fallback, its outcomes against the Python path's on
the same damaged files, and its argument checks. (The tier's behaviour on both paths is in
tests/test_manager_fs_direct.py.)"""

from __future__ import annotations

import mmap
import zlib
from pathlib import Path

import numpy as np
import pytest

from manager.tiering import fs_io

native = fs_io.native
pytestmark = pytest.mark.skipif(native is None, reason="the C extension manager.tiering._fsio is not built")
NB = 8192
KEY = b"k" * 12


def test_crc32c_hardware_and_table_agree() -> None:
    assert native.crc32c(b"123456789") == 0xE3069283 == native.crc32c_table(b"123456789")
    data = np.random.default_rng(1).integers(0, 256, 300_000, dtype=np.uint8).tobytes()
    for n in (0, 1, 7, 8, 9, 31, 32, 33, 4096, 65_537, 300_000):
        for off in (0, 1, 5):
            chunk = data[off:n]
            assert native.crc32c(chunk) == native.crc32c_table(chunk)
    assert native.crc32c(data[10:]) == native.crc32c(data[1000:], native.crc32c(data[10:1000]))  # continuation


def _write(tmp_path: Path, name: str, payload: bytes, kind: int, key: bytes = KEY) -> str:
    path = str(tmp_path / name)
    bufs = fs_io.IOBuffers()
    fs_io.write_block_file(path + ".tmp", path, key, payload, bufs, False, kind, False)
    return path


def _slots(n: int, aligned: bool) -> list[memoryview]:
    m = mmap.mmap(-1, n * NB + 4096)
    arr = np.frombuffer(m, np.uint8, n * NB, 0 if aligned else 16).reshape(n, NB)
    return [memoryview(arr[i]) for i in range(n)]


def _python_outcome(path: str, slot: memoryview, direct: bool) -> int:
    try:
        fs_io.read_block_into(path, KEY, slot, NB, fs_io.IOBuffers(), direct)
    except fs_io.BlockFileError as exc:
        return native.REASONS.index(exc.reason)
    except OSError as exc:
        return -(exc.errno or 1)
    return 0


@pytest.mark.parametrize("staged", [False, True], ids=["into_slot", "staged"])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_same_outcome_as_the_python_path(tmp_path: Path, direct: bool, aligned: bool, staged: bool) -> None:
    if direct and not fs_io.probe_o_direct(str(tmp_path)):
        pytest.skip("this filesystem refuses O_DIRECT")
    payload = np.random.default_rng(2).integers(0, 256, NB, dtype=np.uint8).tobytes()
    good = {kind: _write(tmp_path, f"good{kind}", payload, kind) for kind in (fs_io.CRC_CRC32C, fs_io.CRC_CRC32)}
    raw = Path(good[fs_io.CRC_CRC32]).read_bytes()
    cases = {"good_crc32c": (good[fs_io.CRC_CRC32C], "ok"), "good_crc32": (good[fs_io.CRC_CRC32], "ok")}

    def bad(name: str, data: bytes, reason: str) -> None:
        (tmp_path / name).write_bytes(data)
        cases[name] = (str(tmp_path / name), reason)

    flip = bytearray(raw)
    flip[fs_io.HEADER_SIZE + 77] ^= 4
    bad("payload_flip", bytes(flip), "checksum")
    bad("truncated", raw[:-1], "short")
    bad("trailing_bytes", raw + b"x", "short")
    bad("header_only", raw[: fs_io.HEADER_SIZE], "short")
    bad("half_header", raw[:100], "short")
    bad("empty", b"", "short")
    bad("foreign", b"XXXX" + raw[4:], "magic")
    kind = bytearray(raw)
    kind[5] = 9
    bad("unknown_kind", bytes(kind), "unverifiable")
    hdr = bytearray(raw)
    hdr[26] ^= 1  # inside the key: the header checksum
    bad("header_flip", bytes(hdr), "header")
    other = _write(tmp_path, "other", payload, fs_io.CRC_CRC32, key=b"x" * 12)
    cases["wrong_key"] = (other, "key")
    cases["missing"] = (str(tmp_path / "nope"), "missing")
    longer = _write(tmp_path, "longer", payload + payload, fs_io.CRC_CRC32)
    cases["other_size"] = (longer, "length")
    names = sorted(cases)
    slots = _slots(len(names), aligned)
    for slot in slots:
        slot[:] = b"\xab" * NB
    pool = native.IOPool(4)
    got = pool.load([(cases[n][0], slots[i], KEY) for i, n in enumerate(names)], NB, direct, staged)
    pool.close()
    want = [native.REASONS.index(cases[n][1]) for n in names]
    assert dict(zip(names, got)) == dict(zip(names, want))
    py_slots = _slots(len(names), aligned)
    assert [_python_outcome(cases[n][0], py_slots[i], direct) for i, n in enumerate(names)] == want
    for i, n in enumerate(names):
        if cases[n][1] == "ok":
            assert bytes(slots[i]) == payload
        elif direct and (staged or not aligned):  # read elsewhere, copied in only once checked
            assert bytes(slots[i]) == b"\xab" * NB, n
    assert zlib.crc32(payload) != native.crc32c(payload)  # (the two kinds really differ)


def test_argument_checks_and_close(tmp_path: Path) -> None:
    pool = native.IOPool(2)
    assert pool.threads == 2 and pool.load([], NB, False) == []
    slot = _slots(1, True)[0]
    with pytest.raises(TypeError):
        pool.load([("p", slot)], NB, False)
    with pytest.raises(ValueError, match="slot of 8192 bytes"):
        pool.load([("p", slot, KEY)], NB * 2, False)
    with pytest.raises(BufferError):  # a read-only slot
        pool.load([("p", bytes(NB), KEY)], NB, False)
    assert pool.load([(str(tmp_path / "nope"), slot, KEY)], NB, False) == [native.REASONS.index("missing")]
    pool.close()
    pool.close()
    with pytest.raises(ValueError, match="closed"):
        pool.load([(str(tmp_path / "nope"), slot, KEY)], NB, False)
    with pytest.raises(ValueError):
        native.IOPool(0)


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
@pytest.mark.parametrize("kind", [fs_io.CRC_CRC32C, fs_io.CRC_CRC32], ids=["crc32c", "crc32"])
def test_store_writes_the_same_file_as_python(tmp_path: Path, kind: int, direct: bool, aligned: bool) -> None:
    """Byte for byte the file fs_io.write_block_file writes, readable by both paths."""
    if direct and not fs_io.probe_o_direct(str(tmp_path)):
        pytest.skip("this filesystem refuses O_DIRECT")
    slots = _slots(3, aligned)
    for i, s in enumerate(slots):
        s[:] = np.random.default_rng(10 + i).integers(0, 256, NB, dtype=np.uint8).tobytes()
    pool = native.IOPool(2)
    items = [(str(tmp_path / f"c{i}.tmp"), str(tmp_path / f"c{i}"), s, KEY) for i, s in enumerate(slots)]
    assert pool.store(items, NB, direct, kind, True) == [0, 0, 0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c0", "c1", "c2"]  # renamed, no temp file
    for i, s in enumerate(slots):
        py = _write(tmp_path, f"p{i}", bytes(s), kind)
        assert (tmp_path / f"c{i}").read_bytes() == Path(py).read_bytes()
    back = _slots(3, not aligned)
    assert pool.load([(str(tmp_path / f"c{i}"), back[i], KEY) for i in range(3)], NB, direct) == [0, 0, 0]
    assert [bytes(b) for b in back] == [bytes(s) for s in slots]
    assert _python_outcome(str(tmp_path / "c1"), _slots(1, True)[0], direct) == 0
    pool.close()


def test_store_failures_leave_no_temp_file(tmp_path: Path) -> None:
    """A temp name that exists (O_EXCL), a final name taken by a directory (rename), and a short
    write (the file-size limit stands in for a full disk): -errno each, no temp file left by
    the store, the other blocks of the call written."""
    import errno
    import resource

    slots = _slots(4, True)
    (tmp_path / "taken.tmp").write_bytes(b"someone else's")
    (tmp_path / "dir").mkdir()
    pool = native.IOPool(2)
    items = [(str(tmp_path / "taken.tmp"), str(tmp_path / "a"), slots[0], KEY),
             (str(tmp_path / "b.tmp"), str(tmp_path / "dir"), slots[1], KEY),
             (str(tmp_path / "c.tmp"), str(tmp_path / "c"), slots[2], KEY)]
    assert pool.store(items, NB, False, fs_io.CRC_CRC32C, False) == [-errno.EEXIST, -errno.EISDIR, 0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "dir", "taken.tmp"]
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (fs_io.HEADER_SIZE + NB // 2, hard))  # (SIGXFSZ: ignored by Python)
    try:
        got = pool.store([(str(tmp_path / "d.tmp"), str(tmp_path / "d"), slots[3], KEY)], NB, False, fs_io.CRC_CRC32, False)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert got == [-errno.ENOSPC]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "dir", "taken.tmp"]
    with pytest.raises(ValueError, match="does not fit"):
        pool.store([(str(tmp_path / "e.tmp"), str(tmp_path / "e"), slots[0], b"k" * 5000)], NB, False, 1, False)
    with pytest.raises(ValueError, match="checksum kind"):
        pool.store([], NB, False, 9, False)
    pool.close()


def test_a_forked_child_gets_its_own_threads(tmp_path: Path) -> None:
    """Threads do not survive fork: a pool used in the parent starts fresh ones in the child."""
    import os

    payload = bytes(range(256)) * (NB // 256)
    path = _write(tmp_path, "blk", payload, fs_io.CRC_CRC32C)
    pool = native.IOPool(2)
    slot = _slots(1, True)[0]
    assert pool.load([(path, slot, KEY)], NB, False) == [0]  # the parent's threads are running
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 only if the load worked
        ok = False
        try:
            child = _slots(1, True)[0]
            ok = pool.load([(path, child, KEY)], NB, False) == [0] and bytes(child) == payload
        finally:
            os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert pool.load([(path, slot, KEY)], NB, False) == [0]  # and the parent's still work
    pool.close()


def test_the_tier_stages_its_o_direct_loads_by_default(tmp_path: Path) -> None:
    from kvevents import ConfigError
    from tests.test_fs_pack import K, filled, load, pattern, store, tier_at

    if not fs_io.probe_o_direct(str(tmp_path)):
        pytest.skip("this filesystem refuses O_DIRECT")
    io = filled(6)
    t = tier_at(tmp_path / "a", io, pack_blocks=1)  # (a file per block: the C path)
    assert t.stats()["load_staging"] is True and t.stats()["native_io"] is True
    assert store(t, 1, range(6)).success
    io.array[:] = 0
    assert load(t, 2, [5, 0, 3], [0, 1, 2]).success
    assert [bytes(io.read_block(s)) for s in range(3)] == [pattern(5), pattern(0), pattern(3)]
    Path(t._places.file(K(4))).write_bytes(b"")
    io.array[3] = 7
    assert not load(t, 3, [4], [3]).success  # an emptied file: a miss, and the slot untouched
    assert bytes(io.read_block(3)) == b"\x07" * io.block_nbytes
    t.shutdown()
    for kw in ({"load_staging": False}, {"o_direct": False}, {"native_io": False}):
        t = tier_at(tmp_path / "b", filled(2), pack_blocks=1, **kw)
        assert t.stats()["load_staging"] is False, kw
        t.shutdown()
    with pytest.raises(ConfigError, match="load_staging"):
        tier_at(tmp_path / "c", filled(2), load_staging="yes")
