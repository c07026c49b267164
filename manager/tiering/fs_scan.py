"""What the fs tier owns under its root: the owner locks of live tiers, the start-up scan,
and the header probe used by asynchronous lookups.

Layout: ``<root>/<1 hex>/<key hex>.blk`` block files (the fan-out directory is the key's
first hex digit: 16 directories), ``<token>.<n>.<count>.kvp`` pack files (a store job's blocks,
:mod:`manager.tiering.fs_pack`) in the same directories, ``<block name>.<token>.<n>.tmp`` and
``<pack name>.tmp`` temp files being written by
the tier whose token they carry, ``<root>/.owners/<token>.lock`` held (``flock``) by each live
tier. The scan never follows a symlink, never leaves the root, and deletes only what is
provably ours and dead: a temp file whose owner's lock is free, and a block file with our
magic that is torn (wrong length, key or header checksum) or of the previous format.

The previous layout, ``<root>/<2 hex>/<key hex>.blk`` (256 fan-out directories), is still
read: the scan moves each whole block file it finds there into its new directory (one
``rename``, atomic: a crash leaves the file in one place or the other, and the next scan goes
on) and removes the old directory once it is empty; an asynchronous lookup on a shared root
looks there too (a tier of the older version may still write it). Why fewer directories:
each fan-out directory sits in its own ext4 block group (``spread_dirs``), so a cold load
pays a directory inode, a directory block and an inode-table read per directory touched, and
with 16 directories a cold load costs about one disk request per block (the runs:
benchmarks/NOTES.md, "benchmarks/fs_tier.py runs").
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
from dataclasses import dataclass, field

from .fs_io import HEADER_SIZE, LEGACY_MAGIC, MAGIC, BlockFileError, read_header
from .fs_pack import PACK_NAME, PACK_TMP_NAME, punch

__all__ = [
    "FANOUT_DIRS", "OWNERS", "OwnerLock", "ScanResult", "block_path", "legacy_block_path", "make_fanout_dirs", "probe_block",
    "probe_block_file", "scan_root",
]

SUFFIX = ".blk"
OWNERS = ".owners"
FANOUT_DIRS = [f"{i:x}" for i in range(16)]
_FANOUT = re.compile(r"[0-9a-f]")
_LEGACY_FANOUT = re.compile(r"[0-9a-f]{2}")
_BLOCK_NAME = re.compile(r"([0-9a-f]{2,})\.blk")
#: ``<block name>.<owner token>.<n>.tmp`` (older versions: ``<block name>.<n>.tmp``, no owner)
_TMP_NAME = re.compile(r"[0-9a-f]{2,}\.blk\.(?:([0-9a-f]{16})\.)?\d+\.tmp")


def block_path(root: str, key: bytes) -> str:
    """Where the block file of ``key`` lives."""
    h = key.hex()
    return f"{root}/{h[:1]}/{h}{SUFFIX}"


def legacy_block_path(root: str, key: bytes) -> str:
    """Where the previous layout (256 fan-out directories) kept it."""
    h = key.hex()
    return f"{root}/{h[:2]}/{h}{SUFFIX}"


def make_fanout_dirs(root: str, sync: bool) -> set[str]:
    """Create the 16 fan-out directories (those missing) and return the ones that exist; best
    effort: a read-only root still loads. ``sync``: the root is ``fsync``ed after a creation,
    so the directories survive a power loss with the blocks later written in them."""
    have, made = set(), False
    for sub in FANOUT_DIRS:
        try:
            os.mkdir(os.path.join(root, sub))
            made = True
        except FileExistsError:
            pass
        except OSError:
            continue
        have.add(sub)
    if made and sync:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return have


class OwnerLock:
    """An exclusive ``flock`` on ``<root>/.owners/<token>.lock`` held for a tier's lifetime
    (released by the kernel when the process dies, whatever its pid). ``fd`` is None where
    the lock could not be created (a read-only root: such a tier writes nothing)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.token = secrets.token_hex(8)
        self.fd: int | None = None
        try:
            os.makedirs(os.path.join(root, OWNERS), exist_ok=True)
            fd = os.open(self._lock_path(self.token), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o644)
        except OSError:
            return
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh random name: never contended
        self.fd = fd

    def _lock_path(self, token: str) -> str:
        return os.path.join(self.root, OWNERS, f"{token}.lock")

    def alive(self, token: str) -> bool:
        """Whether the tier that writes temp files named ``token`` still runs."""
        if token == self.token:
            return True
        lock = self._lock_path(token)
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return False
        except OSError:
            return True  # cannot tell: keep its files
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True  # held: the owner runs
        finally:
            os.close(fd)  # (closing drops the lock we may have taken)
        try:
            os.unlink(lock)  # a dead owner's lock file
        except OSError:
            pass
        return False

    def release(self) -> None:
        if self.fd is not None:
            try:
                os.unlink(self._lock_path(self.token))
            except OSError:
                pass
            os.close(self.fd)
            self.fd = None


@dataclass(slots=True)
class ScanResult:
    #: (mtime, key, where): where is None for a block file, else (pack path, unit index)
    found: list[tuple[float, bytes, tuple[str, int] | None]] = field(default_factory=list)
    packs: dict[str, tuple[int, int]] = field(default_factory=dict)  # pack path -> (stride, count)
    shadowed: list[tuple[bytes, tuple[str, int] | None]] = field(default_factory=list)  # a key's older copies
    torn: int = 0  # ours but damaged (deleted)
    foreign: int = 0  # left alone: not ours
    errors: int = 0  # could not read, move or delete
    migrated: int = 0  # block files moved from the previous layout's directories
    dirs: list[str] = field(default_factory=list)  # fan-out directories present


def _unlink(path: str, res: ScanResult) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        res.errors += 1


def _check_file(path: str) -> tuple[str, bytes | None, float]:
    """``("ours", key, mtime)``, ``("torn", …)``, ``("foreign", …)`` or ``("error", …)``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return "error", None, 0.0
    try:
        st = os.fstat(fd)
        head = os.pread(fd, HEADER_SIZE, 0)
    except OSError:
        return "error", None, 0.0
    finally:
        os.close(fd)
    if head[:4] == LEGACY_MAGIC:
        return "torn", None, 0.0  # the previous format: ours, no longer readable
    if head[:4] != MAGIC:
        return "foreign", None, 0.0
    try:
        key, length, _crc, _kind = read_header(head)
    except BlockFileError as exc:
        # a checksum this process cannot compute: not damaged, not loadable here: left alone
        return ("foreign" if exc.reason == "unverifiable" else "torn"), None, 0.0
    if st.st_size != HEADER_SIZE + length or os.path.basename(path) != key.hex() + SUFFIX:
        return "torn", None, 0.0
    return "ours", key, st.st_mtime


def scan_root(root: str, owner: OwnerLock) -> ScanResult:
    """Find the blocks under ``root`` (see the module docstring for what is touched)."""
    res = ScanResult()
    try:
        subs = [e for e in os.scandir(root) if e.name != OWNERS]
    except OSError:
        res.errors += 1
        return res
    # (the new layout's directories first: a block moved from an old one is not seen twice)
    subs.sort(key=lambda e: len(e.name))
    for sub in subs:
        try:
            legacy = _LEGACY_FANOUT.fullmatch(sub.name) is not None
            if not ((legacy or _FANOUT.fullmatch(sub.name)) and sub.is_dir(follow_symlinks=False)):
                res.foreign += 1
                continue
            entries = list(os.scandir(sub.path))
        except OSError:
            res.errors += 1
            continue
        if not legacy:
            res.dirs.append(sub.name)
        for entry in entries:
            _scan_entry(root, sub.name, entry, legacy, owner, res)
        if legacy:
            try:
                os.rmdir(sub.path)  # (only once empty: foreign files and live temp files stay)
            except OSError:
                pass
    # One copy of each key: the newest (a block in both old and new block-file places was
    # moved over its copy: the same file); the others are the tier's to delete.
    newest: dict[bytes, tuple[float, bytes, tuple[str, int] | None]] = {}
    for item in sorted(res.found, key=lambda f: (f[0], f[1])):
        old = newest.get(item[1])
        if old is not None and old[2] != item[2]:
            res.shadowed.append((old[1], old[2]))
        newest[item[1]] = item
    res.found = sorted(newest.values(), key=lambda f: (f[0], f[1]))
    return res


def _scan_entry(root: str, sub: str, entry: os.DirEntry[str], legacy: bool, owner: OwnerLock, res: ScanResult) -> None:
    try:
        regular = entry.is_file(follow_symlinks=False)
    except OSError:
        regular = False
    tmp = _TMP_NAME.fullmatch(entry.name) or PACK_TMP_NAME.fullmatch(entry.name)
    if tmp is not None and regular:
        if tmp.group(1) is None or not owner.alive(tmp.group(1)):
            _unlink(entry.path, res)  # an interrupted write of a tier that is gone
        return
    pack = PACK_NAME.fullmatch(entry.name)
    if pack is not None and regular and not legacy:
        _scan_pack(entry.path, int(pack.group(3)), res)
        return
    m = _BLOCK_NAME.fullmatch(entry.name)
    if m is None or not regular or not m.group(1).startswith(sub):
        res.foreign += 1
        return
    state, key, mtime = _check_file(entry.path)
    if state == "ours":
        if legacy and not _migrate(root, entry.path, key, res):  # type: ignore[arg-type]
            return
        res.found.append((mtime, key, None))  # type: ignore[arg-type]
    elif state == "torn":
        res.torn += 1
        _unlink(entry.path, res)
    elif state == "foreign":
        res.foreign += 1
    else:
        res.errors += 1


def _scan_pack(path: str, count: int, res: ScanResult) -> None:
    """Index a pack's live units; punch out damaged or cut ones (counted torn), unlink a pack
    with none left. A unit whose header page reads as zeros was evicted (punched). The stride
    is unit 0's (header + payload length), or, where unit 0 was evicted or is damaged, the
    file's size over its count (a hole keeps the size); a pack that gives neither is dropped
    whole."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        res.errors += 1
        return
    units: list[tuple[int, bytes]] = []
    damaged: list[int] = []
    try:
        st = os.fstat(fd)
        stride = _pack_stride(os.pread(fd, HEADER_SIZE, 0), st.st_size, count)
        if stride is None:
            res.torn += 1
            _unlink(path, res)
            return
        for i in range(count):
            if (i + 1) * stride > st.st_size:
                damaged.append(i)  # cut short
                continue
            head = os.pread(fd, HEADER_SIZE, i * stride)
            if head.count(0) == len(head):
                continue  # evicted
            try:
                key, length, _crc, _kind = read_header(head)
            except BlockFileError as exc:
                if exc.reason == "unverifiable":
                    res.foreign += 1  # a checksum this process cannot compute: left alone
                else:
                    damaged.append(i)
                continue
            if HEADER_SIZE + length != stride:
                damaged.append(i)
                continue
            units.append((i, key))
    except OSError:
        res.errors += 1
        return
    finally:
        os.close(fd)
    res.torn += len(damaged)
    if not units:
        _unlink(path, res)
        return
    try:
        if st.st_size < count * stride:  # cut short: the missing tail becomes a hole (units that read as evicted)
            os.truncate(path, count * stride)
        for i in damaged:
            punch(path, i * stride, stride)
    except OSError:
        res.errors += 1
    res.packs[path] = (stride, count)
    res.found.extend((st.st_mtime, key, (path, i)) for i, key in units)


def _pack_stride(head0: bytes, size: int, count: int) -> int | None:
    stride = None
    if head0.count(0) != len(head0):
        try:
            stride = HEADER_SIZE + read_header(head0)[1]
        except BlockFileError:
            pass  # unit 0 damaged: the size may still tell
    if stride is None and size % count == 0:
        stride = size // count
    return stride if stride is not None and stride > HEADER_SIZE and stride % HEADER_SIZE == 0 else None


def _migrate(root: str, path: str, key: bytes, res: ScanResult) -> bool:
    """Move a whole block file of the previous layout to its place in this one (``rename``
    keeps its mtime, so its LRU rank). False (counted in ``errors``) where it cannot move: it
    is then not indexed, as this tier reads only the new place."""
    dest = block_path(root, key)
    try:
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        os.rename(path, dest)  # (a file already there holds the same block: replaced)
    except OSError:
        res.errors += 1
        return False
    res.migrated += 1
    return True


def probe_block(root: str, key: bytes, nbytes: int | None) -> bool:
    """Whether ``root`` holds a whole block file of ``key`` in its place; one found in the
    previous layout's place (written by a tier of the older version) is moved there first."""
    if probe_block_file(block_path(root, key), key, nbytes):
        return True
    old = legacy_block_path(root, key)
    if not probe_block_file(old, key, nbytes):
        return False
    return _migrate(root, old, key, ScanResult())


def probe_block_file(path: str, key: bytes, nbytes: int | None) -> bool:
    """Whether ``path`` holds a whole block file of ``key`` (header checked, size matching,
    payload ``nbytes`` long if given); the payload checksum is left to the load."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, HEADER_SIZE, 0)
    except OSError:
        return False
    finally:
        os.close(fd)
    try:
        _k, length, _crc, _kind = read_header(head, key)
    except BlockFileError:
        return False
    return size == HEADER_SIZE + length and (nbytes is None or length == nbytes)
