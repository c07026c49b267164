"""Pack files: a store job's blocks in one file (the fs tier's ``"pack"`` layout).

A file per block costs a cold load an inode (and often a directory block) read per block
before the block itself: at 64 KiB blocks that is most of the disk's requests. A pack holds
up to ``pack_blocks`` blocks of one store job, each unit exactly a block file's bytes (the
header page of :mod:`manager.tiering.fs_io`, then the payload), back to back::

    <root>/<1 hex>/<owner token>.<n>.<count>.kvp
    unit i at offset i * stride, stride = HEADER_SIZE + payload length (a page multiple)

so a load reads a run of consecutive units with one file open: buffered, one ``preadv`` per
unit in file order (the kernel's readahead runs ahead of the reads), or ``O_DIRECT``, one
``preadv`` of the whole run scattered into the slots. Every unit keeps its own key, length
and checksums: a damaged unit is a miss, never wrong bytes, as a damaged block file is.

Written like a block file: to ``<name>.tmp`` (``O_EXCL``), ``fdatasync`` with ``fsync=True``,
renamed into place, so a reader or a start-up scan sees no pack or a whole one. An evicted
block's unit is given back to the filesystem with ``fallocate(PUNCH_HOLE)`` (its header page
then reads as zeros: a scan skips it), and the pack is unlinked with its last live unit, so the
disk holds the live blocks and nothing else. Where the filesystem cannot punch holes
(:func:`probe_punch`), the tier keeps a file per block.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import re
import threading
from collections.abc import Sequence
from typing import Any

from .fs_io import ALIGN, HEADER_SIZE, O_DIRECT, BlockFileError, aligned, build_header, check_block, write_renamed

__all__ = [
    "MAX_PACK", "PACK_NAME", "PACK_TMP_NAME", "Pack", "PackBuffers", "pack_name", "probe_punch", "punch", "read_run",
    "write_pack",
]

SUFFIX = ".kvp"
MAX_PACK = 512  # blocks per pack: two iovecs a block, under IOV_MAX (1024)
MAX_PACK_BYTES = 1 << 30  # one pwritev/preadv moves at most 0x7ffff000 bytes on Linux
#: ``<owner token>.<n>.<count>.kvp``, and its temp file ``<that>.tmp``
PACK_NAME = re.compile(r"([0-9a-f]{16})\.([0-9a-f]+)\.([1-9][0-9]{0,2})\.kvp")
PACK_TMP_NAME = re.compile(r"([0-9a-f]{16})\.[0-9a-f]+\.[1-9][0-9]{0,2}\.kvp\.tmp")

_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


class Pack:
    """One pack file as the tier knows it: ``live`` units not yet evicted (the file is
    unlinked when it reaches 0)."""

    __slots__ = ("path", "stride", "count", "live")

    def __init__(self, path: str, stride: int, count: int, live: int) -> None:
        self.path, self.stride, self.count, self.live = path, stride, count, live

    def __repr__(self) -> str:
        return f"Pack({self.path!r}, stride={self.stride}, {self.live}/{self.count} live)"


def pack_name(token: str, n: int, count: int) -> str:
    """The file name of pack ``n`` written by the tier with owner token ``token``."""
    return f"{token}.{n:x}.{count}{SUFFIX}"


def _fallocate() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.fallocate
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    fn.restype = ctypes.c_int
    return fn


_fallocate_fn = _fallocate()


def punch(path: str, offset: int, length: int) -> None:
    """Give ``length`` bytes at ``offset`` of ``path`` back to the filesystem (they read as
    zeros afterwards; the file keeps its size). Raises OSError."""
    if _fallocate_fn is None:
        raise OSError(errno.EOPNOTSUPP, "fallocate is not available here", path)
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        if _fallocate_fn(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"punching {length} bytes at {offset}: {os.strerror(err)}", path)
    finally:
        os.close(fd)


def probe_punch(directory: str) -> bool:
    """Whether files in ``directory`` can have holes punched (ext4, xfs, btrfs, tmpfs can;
    some network and older filesystems cannot)."""
    path = os.path.join(directory, f".punch_probe.{os.getpid()}.{threading.get_ident()}")
    try:
        fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.pwrite(fd, b"\x01" * (2 * ALIGN), 0)
        finally:
            os.close(fd)
        punch(path, 0, ALIGN)
        with open(path, "rb") as f:
            return f.read(ALIGN) == bytes(ALIGN)
    except OSError:
        return False
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


class PackBuffers(threading.local):
    """Per-thread page-aligned header pages (one per unit of a run), grown on demand, and a
    bounce buffer for a unit whose slot cannot be read into."""

    def __init__(self) -> None:
        self._heads: mmap.mmap | None = None
        self._views: list[memoryview] = []  # a view per header page, made once per growth, not per run
        self._bounce: mmap.mmap | None = None

    def heads(self, n: int) -> list[memoryview]:
        if len(self._views) < n:
            for v in self._views:
                v.release()
            if self._heads is not None:
                self._heads.close()
            self._heads = mmap.mmap(-1, max(n, 16) * HEADER_SIZE)
            view = memoryview(self._heads)
            self._views = [view[i * HEADER_SIZE : (i + 1) * HEADER_SIZE] for i in range(max(n, 16))]
            view.release()
        return self._views[:n]

    def bounce(self, nbytes: int) -> memoryview:
        if self._bounce is None or len(self._bounce) < nbytes:
            if self._bounce is not None:
                self._bounce.close()
            self._bounce = mmap.mmap(-1, -(-nbytes // ALIGN) * ALIGN)
        return memoryview(self._bounce)[:nbytes]


def write_pack(tmp: str, path: str, blocks: Sequence[tuple[bytes, Any]], bufs: PackBuffers, direct: bool,
               crc_kind: int, sync: bool) -> None:
    """Write ``blocks`` (key, payload), payloads of one page-multiple length, as the pack
    ``path``: one ``pwritev`` into ``tmp``, ``fdatasync`` if ``sync``, renamed into place.
    Leaves no temp file behind on error."""
    heads = bufs.heads(len(blocks))
    iov: list[Any] = []
    for head, (key, payload) in zip(heads, blocks):
        build_header(head, key, payload, crc_kind)
        iov += (head, payload)
        if direct and not aligned(payload):
            direct = False  # (the whole pack buffered: no bounce copy of every block)
    write_renamed(tmp, path, iov, direct, sync)


def read_run(pack: Pack, first: int, units: Sequence[tuple[bytes, Any]], nbytes: int, bufs: PackBuffers,
             direct: bool) -> list[str | None]:
    """Read units ``first, first + 1, ...`` of ``pack`` into their slots: ``units`` are (key,
    writable slot of ``nbytes`` bytes). ``direct``: one ``O_DIRECT`` ``preadv`` of the run
    (where every slot is aligned); else one buffered ``preadv`` per unit, in file order. One
    outcome per unit: None (the slot holds the block, checked) or a
    :class:`~manager.tiering.fs_io.BlockFileError` reason; an OSError of the open or a read
    is raised (the file says nothing then). A slot whose outcome is not None holds garbage."""
    n, stride = len(units), pack.stride
    if stride != HEADER_SIZE + nbytes:
        return ["length"] * n  # (a pack of another block size: every unit's header would say so)
    if direct and not all(aligned(slot) for _k, slot in units):
        direct = False
    try:
        fd = os.open(pack.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | (O_DIRECT if direct else 0))
    except FileNotFoundError:
        return ["missing"] * n
    heads = bufs.heads(n)
    got = [0] * n
    try:
        # Units past the end of the file are not read: an O_DIRECT read past the end zeroes
        # the rest of the buffer (fs_io), which would clobber a slot.
        whole = max(0, min(n, os.fstat(fd).st_size // stride - first))
        if direct and whole:
            iov = [v for i in range(whole) for v in (heads[i], units[i][1])]
            done = os.preadv(fd, iov, first * stride)
            for i in range(whole):
                got[i] = max(0, min(stride, done - i * stride))
        else:
            for i in range(whole):
                got[i] = os.preadv(fd, [heads[i], units[i][1]], (first + i) * stride)
    finally:
        os.close(fd)
    out: list[str | None] = []
    for i, (key, slot) in enumerate(units):
        try:
            if got[i] < HEADER_SIZE:
                raise BlockFileError("short", f"unit {first + i} of {pack.path}: {got[i]} bytes")
            check_block(heads[i], key, slot, nbytes, got[i] == stride, f"unit {first + i} of {pack.path}")
            out.append(None)
        except BlockFileError as exc:
            out.append(exc.reason)
    return out
