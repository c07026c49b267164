"""What the fs tier owns under its root: the owner locks of live tiers, the start-up scan,
and the header probe used by asynchronous lookups.

Layout: ``<root>/<2 hex>/<key hex>.blk`` block files, ``<block name>.<token>.<n>.tmp`` temp
files being written by the tier whose token they carry, ``<root>/.owners/<token>.lock``
held (``flock``) by each live tier. The scan never follows a symlink, never leaves the root,
and deletes only what is provably ours and dead: a temp file whose owner's lock is free, and
a block file with our magic that is torn (wrong length, key or header checksum) or of the
previous format.
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
from dataclasses import dataclass, field

from .fs_io import HEADER_SIZE, LEGACY_MAGIC, MAGIC, BlockFileError, read_header

__all__ = ["OWNERS", "OwnerLock", "ScanResult", "probe_block_file", "scan_root"]

SUFFIX = ".blk"
OWNERS = ".owners"
_FANOUT = re.compile(r"[0-9a-f]{2}")
_BLOCK_NAME = re.compile(r"([0-9a-f]{2,})\.blk")
#: ``<block name>.<owner token>.<n>.tmp`` (older versions: ``<block name>.<n>.tmp``, no owner)
_TMP_NAME = re.compile(r"[0-9a-f]{2,}\.blk\.(?:([0-9a-f]{16})\.)?\d+\.tmp")


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
    found: list[tuple[float, bytes]] = field(default_factory=list)  # (mtime, key)
    torn: int = 0  # ours but damaged (deleted)
    foreign: int = 0  # left alone: not ours
    errors: int = 0  # could not read or delete
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
    for sub in subs:
        try:
            if not (_FANOUT.fullmatch(sub.name) and sub.is_dir(follow_symlinks=False)):
                res.foreign += 1
                continue
            entries = list(os.scandir(sub.path))
        except OSError:
            res.errors += 1
            continue
        res.dirs.append(sub.name)
        for entry in entries:
            try:
                regular = entry.is_file(follow_symlinks=False)
            except OSError:
                regular = False
            tmp = _TMP_NAME.fullmatch(entry.name)
            if tmp is not None and regular:
                if tmp.group(1) is None or not owner.alive(tmp.group(1)):
                    _unlink(entry.path, res)  # an interrupted write of a tier that is gone
                continue
            m = _BLOCK_NAME.fullmatch(entry.name)
            if m is None or not regular or not m.group(1).startswith(sub.name):
                res.foreign += 1
                continue
            state, key, mtime = _check_file(entry.path)
            if state == "ours":
                res.found.append((mtime, key))  # type: ignore[arg-type]
            elif state == "torn":
                res.torn += 1
                _unlink(entry.path, res)
            elif state == "foreign":
                res.foreign += 1
            else:
                res.errors += 1
    res.found.sort()
    return res


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
