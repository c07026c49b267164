"""The fs tier's block files and the direct read/write path (no intermediate bytes).

A block file is one page of header followed by the payload, so the payload starts at an
offset every ``O_DIRECT`` device accepts::

    offset 0     magic b"KVB2" | version u8 | checksum kind u8 | reserved u16
                 | payload length u64 | payload checksum u32 | key length u32     (24 bytes, BE)
                 | key | header checksum u32 (CRC32C/CRC32 of everything before it)
                 | zeros up to HEADER_SIZE (4096)
    offset 4096  payload (one block of the primary tier)

A load is one ``preadv`` of header page + payload straight into the destination slot (a
bounce buffer only when ``O_DIRECT`` needs an alignment the slot lacks); the checksum is
then computed over the slot in place. A store is one ``pwritev`` of header page + slot into a
temp file, renamed into place.

Checksum kinds (each file's header says which): CRC32C, written where this project's C
extension :mod:`manager.tiering._fsio` is built (one routine: SSE4.2, a table where the CPU
lacks it; the same one its load path verifies with), and zlib's CRC32 otherwise. Every process
reads both kinds: a CRC32C file where the extension is not built is verified by
:func:`crc32c_python`, the table-driven reference the tests compare the C routine with (slow,
but correct).

:data:`native` is the C extension (None where it was not built): its ``IOPool`` runs the
load path above — open, ``preadv``, header and checksum checks — on C threads without the
GIL, one call per job (see ``_fsio.c``); this module's :func:`read_block_into` is the same
path in Python, and the two must agree on every outcome.
"""

from __future__ import annotations

import errno
import mmap
import os
import struct
import sys
import threading
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = [
    "ALIGN",
    "CRC_CRC32",
    "CRC_CRC32C",
    "HEADER_SIZE",
    "BlockFileError",
    "IOBuffers",
    "check_block",
    "checksum_for",
    "crc32c",
    "crc32c_python",
    "default_crc_kind",
    "native",
    "probe_o_direct",
    "read_block_into",
    "read_header",
    "spread_directories",
    "write_block_file",
    "write_renamed",
]

MAGIC = b"KVB2"
LEGACY_MAGIC = b"KVB1"  # the previous format (header + key + payload): dropped at start-up
VERSION = 2
HEADER_SIZE = 4096
ALIGN = 4096  # O_DIRECT alignment of buffers, offsets and lengths (the safe value)
_FIXED = struct.Struct(">4sBBHQII")
_U32 = struct.Struct(">I")
MAX_KEY = HEADER_SIZE - _FIXED.size - _U32.size

CRC_CRC32C = 1
CRC_CRC32 = 2

O_DIRECT = getattr(os, "O_DIRECT", 0)


try:
    from . import _fsio as native  # type: ignore[attr-defined]
except ImportError:  # not built (no compiler or no zlib.h): the Python path
    native = None


#: CRC32C of a buffer, the C routine (None where the extension is not built; files get CRC32).
crc32c: Callable[[Any], int] | None = native.crc32c if native is not None else None

_CRC32C_TABLE: list[int] = []


def crc32c_python(data: Any) -> int:
    """CRC32C in pure Python, one table lookup per byte (~10 MB/s): the reference the C routine
    is tested against, and the verifier of CRC32C files where the extension is not built."""
    table = _CRC32C_TABLE
    if not table:
        for i in range(256):
            c = i
            for _ in range(8):
                c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
            table.append(c)
    c = 0xFFFFFFFF
    for b in bytes(data):
        c = (c >> 8) ^ table[(c ^ b) & 0xFF]
    return c ^ 0xFFFFFFFF


def default_crc_kind() -> int:
    return CRC_CRC32C if crc32c is not None else CRC_CRC32


def checksum_for(kind: int) -> Callable[[Any], int] | None:
    """The checksum function of ``kind``, or None for a kind this format does not know."""
    if kind == CRC_CRC32C:
        return crc32c if crc32c is not None else crc32c_python
    if kind == CRC_CRC32:
        return zlib.crc32
    return None


class BlockFileError(Exception):
    """A block file that is not a whole, valid block: ``reason`` says which check failed
    (``missing``, ``short``, ``magic``, ``header``, ``key``, ``length``, ``checksum``,
    ``unverifiable``)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def probe_o_direct(directory: str) -> bool:
    """Whether an aligned ``O_DIRECT`` write and read work in ``directory`` (tmpfs and some
    overlay/network filesystems refuse it with EINVAL)."""
    if not O_DIRECT:
        return False
    path = os.path.join(directory, f".o_direct_probe.{os.getpid()}.{threading.get_ident()}")
    page = mmap.mmap(-1, ALIGN)
    try:
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC | O_DIRECT | os.O_CLOEXEC, 0o600)
        try:
            return os.pwrite(fd, page, 0) == ALIGN and os.preadv(fd, [page], 0) == ALIGN
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        page.close()
        try:
            os.unlink(path)
        except OSError:
            pass


_FS_IOC_GETFLAGS, _FS_IOC_SETFLAGS = 0x80086601, 0x40086602  # (Linux, 64-bit: _IOR/_IOW('f', 1/2, long))
_FS_TOPDIR_FL = 0x00020000  # `chattr +T`: ext2/3/4's Orlov allocator spreads this directory's subdirectories


def spread_directories(directory: str) -> bool:
    """Mark ``directory`` as the top of a hierarchy (``chattr +T``) so that ext4 places the
    fan-out directories made in it afterwards in different block groups, with their files'
    inodes. Without it every fan-out directory lands in its parent's block group, and on
    ext4 without a journal each new file's inode search then walks past every inode of that
    group deleted in the last minute (``recently_deleted`` in the kernel's ``find_inode_bit``):
    measured here, 8,192 stores right after 8,192 deletions took 3.8 s of kernel CPU in one
    group against 0.8 s spread. Best effort: False where the filesystem or the caller's
    rights do not allow it (nothing else depends on it)."""
    try:
        import fcntl

        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except (ImportError, OSError):
        return False
    try:
        buf = bytearray(4)
        fcntl.ioctl(fd, _FS_IOC_GETFLAGS, buf)
        flags = int.from_bytes(buf, sys.byteorder)
        if not flags & _FS_TOPDIR_FL:
            fcntl.ioctl(fd, _FS_IOC_SETFLAGS, (flags | _FS_TOPDIR_FL).to_bytes(4, sys.byteorder))
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _address(buf: Any) -> int:
    return int(np.frombuffer(buf, np.uint8).ctypes.data) if len(buf) else 0


def aligned(buf: Any) -> bool:
    """Whether ``buf`` can be handed to an ``O_DIRECT`` read or write as it is."""
    return len(buf) % ALIGN == 0 and _address(buf) % ALIGN == 0


class IOBuffers(threading.local):
    """Per-thread page-aligned buffers (anonymous mmaps): the header page, and a bounce
    buffer for O_DIRECT transfers of slots that are not aligned."""

    def __init__(self) -> None:
        self.header = mmap.mmap(-1, HEADER_SIZE)
        self.header_view = memoryview(self.header)
        self._bounce: mmap.mmap | None = None

    def bounce(self, nbytes: int) -> memoryview:
        size = -(-nbytes // ALIGN) * ALIGN
        if self._bounce is None or len(self._bounce) < size:
            if self._bounce is not None:
                self._bounce.close()
            self._bounce = mmap.mmap(-1, size)
        return memoryview(self._bounce)[:nbytes]


def build_header(buf: memoryview, key: bytes, payload: Any, crc_kind: int) -> None:
    """Write the header page for ``key``/``payload`` into ``buf`` (HEADER_SIZE bytes)."""
    if len(key) > MAX_KEY:
        raise ValueError(f"fs tier: key of {len(key)} bytes does not fit the header ({MAX_KEY} max)")
    fn = checksum_for(crc_kind)
    assert fn is not None
    _FIXED.pack_into(buf, 0, MAGIC, VERSION, crc_kind, 0, len(payload), fn(payload), len(key))
    end = _FIXED.size + len(key)
    buf[_FIXED.size : end] = key
    _U32.pack_into(buf, end, fn(buf[:end]))
    buf[end + 4 :] = bytes(HEADER_SIZE - end - 4)


def read_header(head: Any, key: bytes | None = None) -> tuple[bytes, int, int, int]:
    """``(key, payload length, payload checksum, checksum kind)`` of a header page; raises
    :class:`BlockFileError`."""
    if len(head) < _FIXED.size:
        raise BlockFileError("short", f"{len(head)} header bytes")
    magic, version, kind, _r, length, crc, klen = _FIXED.unpack_from(head)
    if magic != MAGIC:
        raise BlockFileError("magic", repr(bytes(magic)))
    end = _FIXED.size + klen
    if version != VERSION or klen > MAX_KEY or len(head) < end + 4:
        raise BlockFileError("header", f"version {version}, key length {klen}")
    fn = checksum_for(kind)
    if fn is None:
        raise BlockFileError("unverifiable", f"checksum kind {kind} unknown here")
    if fn(head[:end]) != _U32.unpack_from(head, end)[0]:
        raise BlockFileError("header", "header checksum")
    stored = bytes(head[_FIXED.size : end])
    if key is not None and stored != key:
        raise BlockFileError("key", "the file holds another key")
    return stored, length, crc, kind


def check_block(head: Any, key: bytes, payload: Any, nbytes: int, complete: bool, where: str) -> None:
    """Check one block as read: its header page ``head`` names ``key`` with a payload of
    ``nbytes`` bytes, the read was ``complete`` (header + whole payload, nothing missing or
    trailing), and ``payload`` has the header's checksum; raises :class:`BlockFileError`.
    Shared by block files and pack units (:mod:`manager.tiering.fs_pack`)."""
    _k, length, crc, kind = read_header(head, key)
    if length != nbytes:
        raise BlockFileError("length", f"payload of {length} bytes, a block holds {nbytes}")
    if not complete:
        raise BlockFileError("short", f"{where} is not header + {nbytes} payload bytes")
    fn = checksum_for(kind)
    assert fn is not None  # read_header checked it
    if fn(payload) != crc:
        raise BlockFileError("checksum", where)


def read_block_into(path: str, key: bytes, slot: memoryview | None, nbytes: int, bufs: IOBuffers,
                    direct: bool) -> memoryview | None:
    """Read the block file ``path`` of ``key`` (payload ``nbytes`` long) and check it.

    ``slot`` (writable, ``nbytes`` long) receives the payload straight from the kernel; with
    ``slot=None`` the payload lands in the thread's bounce buffer, which is returned (the
    caller copies it where it belongs). Raises :class:`BlockFileError` (or OSError): then the
    slot holds garbage and must not be used."""
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
    dest = slot
    if direct:
        if slot is None or not aligned(slot):
            dest = bufs.bounce(nbytes)
            if not aligned(dest):
                direct = False
    elif dest is None:
        dest = bufs.bounce(nbytes)
    try:
        fd = os.open(path, flags | (O_DIRECT if direct else 0))
    except FileNotFoundError:
        raise BlockFileError("missing", path) from None
    try:
        # A file of another size is read as far as its header only: an O_DIRECT read past the
        # end of a file zeroes the rest of the buffer (seen here), which would clobber the slot.
        whole = os.fstat(fd).st_size == HEADER_SIZE + nbytes
        got = os.preadv(fd, [bufs.header_view, dest] if whole else [bufs.header_view], 0)
    finally:
        os.close(fd)
    if got < HEADER_SIZE:
        raise BlockFileError("short", f"{got} bytes")
    check_block(bufs.header_view, key, dest, nbytes, whole and got == HEADER_SIZE + nbytes, path)
    if slot is not None and dest is not slot:
        slot[:] = dest
        return None
    return None if slot is not None else dest


def write_block_file(tmp: str, path: str, key: bytes, payload: Any, bufs: IOBuffers, direct: bool,
                     crc_kind: int, sync: bool) -> None:
    """Write ``payload`` as the block file of ``key``: to ``tmp``, then renamed to ``path``
    (a reader sees no file or a whole one). ``sync``: the data reaches stable storage
    (``fdatasync``) before the rename. Leaves no temp file behind on error."""
    build_header(bufs.header_view, key, payload, crc_kind)
    src = payload
    if direct and not aligned(payload):
        if len(payload) % ALIGN:
            direct = False  # the length cannot be padded without changing the file
        else:
            src = bufs.bounce(len(payload))
            src[:] = payload
    write_renamed(tmp, path, [bufs.header_view, src], direct, sync)


def write_renamed(tmp: str, path: str, iov: list[Any], direct: bool, sync: bool) -> None:
    """Write ``iov`` with one ``pwritev`` into the new file ``tmp`` (``O_EXCL``; ``O_DIRECT``
    if ``direct``), ``fdatasync`` it if ``sync``, and rename it to ``path``: a reader sees no
    file or a whole one. A short write is ENOSPC; on any error no temp file is left behind."""
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (O_DIRECT if direct else 0), 0o644)
    try:
        try:
            want = sum(len(v) for v in iov)
            n = os.pwritev(fd, iov, 0)
            if n != want:  # a short write: the disk is full
                raise OSError(errno.ENOSPC, f"short write: {n} of {want} bytes", tmp)
            if sync:
                os.fdatasync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
