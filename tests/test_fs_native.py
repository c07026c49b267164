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


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_same_outcome_as_the_python_path(tmp_path: Path, direct: bool, aligned: bool) -> None:
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
    pool = native.IOPool(4)
    got = pool.load([(cases[n][0], slots[i], KEY) for i, n in enumerate(names)], NB, direct)
    pool.close()
    want = [native.REASONS.index(cases[n][1]) for n in names]
    assert dict(zip(names, got)) == dict(zip(names, want))
    py_slots = _slots(len(names), aligned)
    assert [_python_outcome(cases[n][0], py_slots[i], direct) for i, n in enumerate(names)] == want
    for i, n in enumerate(names):
        if cases[n][1] == "ok":
            assert bytes(slots[i]) == payload
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
