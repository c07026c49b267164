"""``FileSystemSecondaryTierManager`` (type ``"fs"``): blocks as files under a directory.

Layout: ``<root>/<first 2 hex chars of key>/<key hex>.blk``. A file is a 20-byte header
followed by the key and the payload::

    magic b"KVB1" | payload length (u64 BE) | crc32 of payload (u32 BE) | key length (u32 BE)

Writes go to a temporary file in the same directory and are renamed into place, so a reader
sees either no file or a whole one (``fsync=True`` also survives power loss). A torn file
(wrong length) or a corrupt one (bad magic, key or checksum) is a miss, never bad data: it is
skipped at start-up, and a load that finds one fails its job, deletes the file and emits a
removal. All I/O runs on a thread pool: submits never block.

``capacity_blocks`` bounds the number of files; storing beyond it evicts the least recently
used blocks not being read (removal events). On start-up the directory is scanned and its
valid blocks are found again (oldest modification first in LRU order), announced with one
stored event.
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvevents.errors import ConfigError

from ..base import LookupResult, OffloadKey, OffloadPolicy, ReqContext, RequestOffloadingContext
from .base import JobMetadata, JobResult, SecondaryTierManager

__all__ = ["FileSystemSecondaryTierManager"]

_MAGIC = b"KVB1"
_HEADER = struct.Struct(">4sQII")
_SUFFIX = ".blk"
_FANOUT = re.compile(r"[0-9a-f]{2}")
_BLOCK_NAME = re.compile(r"([0-9a-f]{2,})\.blk")
#: ``<block name>.<owner token>.<thread>.tmp``: the token names the tier instance writing it
#: (older versions wrote ``<block name>.<thread>.tmp``: no owner, always stale at start-up).
_TMP_NAME = re.compile(r"[0-9a-f]{2,}\.blk\.(?:([0-9a-f]{16})\.)?\d+\.tmp")
_OWNERS = ".owners"


class FileSystemSecondaryTierManager(SecondaryTierManager):
    def __init__(
        self,
        tier_type: str = "fs",
        *,
        root: str | os.PathLike[str],
        capacity_blocks: int | None = None,
        num_threads: int = 2,
        fsync: bool = False,
        offload_policy: str = "block_level",
        **kw: Any,
    ) -> None:
        super().__init__(tier_type, **kw)
        if capacity_blocks is not None and capacity_blocks <= 0:
            raise ConfigError(f"fs tier: capacity_blocks must be > 0 or None, got {capacity_blocks!r}")
        if num_threads <= 0:
            raise ConfigError(f"fs tier: num_threads must be > 0, got {num_threads!r}")
        try:
            self.policy = OffloadPolicy(offload_policy)
        except ValueError:
            raise ConfigError(
                f"fs tier: offload_policy must be one of {[p.value for p in OffloadPolicy]}, got {offload_policy!r}"
            ) from None
        self.root = Path(root)
        if not self.root.is_dir():  # (an existing read-only root is fine: loads still work)
            self.root.mkdir(parents=True, exist_ok=True)
        self.capacity_blocks = capacity_blocks
        self.fsync = fsync
        self._lock = threading.Condition()
        self._index: OrderedDict[OffloadKey, None] = OrderedDict()  # committed keys, LRU first
        self._writing: set[OffloadKey] = set()
        self._reading: dict[OffloadKey, int] = {}  # key -> loads in flight (not evictable)
        self._finished: list[JobResult] = []
        self._in_flight = 0
        self._pool = ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix=f"kv-{tier_type}")
        self._closed = False
        # Counters.
        self.stores = 0
        self.loads = 0
        self.store_errors = 0
        self.load_errors = 0
        self.corrupt_files = 0
        self.evictions = 0
        self.capacity_overflows = 0  # stores committed while nothing was evictable
        self.foreign_files = 0  # entries under root the start-up scan left alone (not ours)
        self.scan_errors = 0  # entries the start-up scan could not read or delete
        self.payload_mismatches = 0  # files whose payload is not one block of block_io
        self._token = secrets.token_hex(8)
        self._owner_fd = self._take_ownership()
        self._recover()

    # -- files -------------------------------------------------------------------

    def _take_ownership(self) -> int | None:
        """Hold an exclusive ``flock`` on ``<root>/.owners/<token>.lock`` for the tier's
        lifetime: a temp file whose owner still holds its lock is being written (by another
        tier on the same root, in this process or another) and is left alone by the scan."""
        owners = self.root / _OWNERS
        try:
            owners.mkdir(exist_ok=True)
            fd = os.open(owners / f"{self._token}.lock", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o644)
        except OSError:
            return None  # a read-only root: nothing will be written, so no temp files of ours
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a fresh random name: never contended
        return fd

    def _owner_alive(self, token: str) -> bool:
        """Whether the tier that wrote temp files named ``token`` is still running."""
        if token == self._token:
            return True
        lock = self.root / _OWNERS / f"{token}.lock"
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
            lock.unlink()  # a dead owner's lock file
        except OSError:
            pass
        return False

    def _path(self, key: OffloadKey) -> Path:
        h = key.hex()
        return self.root / h[:2] / (h + _SUFFIX)

    def _read_file(self, path: Path, key: OffloadKey | None) -> tuple[OffloadKey, bytes] | None:
        """(key, payload) of a valid file, or None (missing, torn or corrupt)."""
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            return None
        if len(data) < _HEADER.size:
            return None
        magic, length, crc, klen = _HEADER.unpack_from(data)
        if magic != _MAGIC or len(data) != _HEADER.size + klen + length:
            return None
        stored_key = data[_HEADER.size : _HEADER.size + klen]
        if key is not None and stored_key != key:
            return None
        payload = data[_HEADER.size + klen :]
        if zlib.crc32(payload) != crc:
            return None
        return stored_key, payload

    def _header_ok(self, path: str) -> tuple[str, OffloadKey | None, float]:
        """Start-up check of a block file (the payload checksum is verified on load):
        ``("ours", key, mtime)``, ``("torn", …)`` (our magic, wrong length or key),
        ``("foreign", …)`` (not our magic) or ``("error", …)`` (unreadable)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return "error", None, 0.0
        try:
            st = os.fstat(fd)
            head = os.pread(fd, _HEADER.size + 256, 0)
        except OSError:
            return "error", None, 0.0
        finally:
            os.close(fd)
        if len(head) < 4 or head[:4] != _MAGIC:
            return "foreign", None, 0.0
        if len(head) < _HEADER.size:
            return "torn", None, 0.0
        _magic, length, _crc, klen = _HEADER.unpack_from(head)
        key = head[_HEADER.size : _HEADER.size + klen]
        if st.st_size != _HEADER.size + klen + length or len(key) != klen or os.path.basename(path) != key.hex() + _SUFFIX:
            return "torn", None, 0.0
        return "ours", key, st.st_mtime

    def _write_file(self, key: OffloadKey, payload: bytes | memoryview) -> None:
        path = self._path(key)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f"{path.name}.{self._token}.{threading.get_ident()}.tmp")
        header = _HEADER.pack(_MAGIC, len(payload), zlib.crc32(payload), len(key))
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(key)
                f.write(payload)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                tmp.unlink()
            except OSError:
                pass
            raise

    def _delete_file(self, key: OffloadKey) -> None:
        try:
            self._path(key).unlink()
        except OSError:
            pass

    def _recover(self) -> None:
        """Find this root's blocks again. Only regular files in two-hex-digit fan-out
        directories, named like ours, are considered; symlinks are never followed, other
        entries are left alone (``foreign_files``), unreadable ones counted (``scan_errors``).
        A temp file is deleted only when the tier that wrote it is gone; a block file with our
        magic but a wrong length is torn and deleted; one without our magic is not ours."""
        found: list[tuple[float, OffloadKey]] = []
        try:
            subs = [e for e in os.scandir(self.root) if e.name != _OWNERS]
        except OSError:
            self.scan_errors += 1
            subs = []
        for sub in subs:
            try:
                if not (_FANOUT.fullmatch(sub.name) and sub.is_dir(follow_symlinks=False)):
                    self.foreign_files += 1
                    continue
                entries = list(os.scandir(sub.path))
            except OSError:
                self.scan_errors += 1
                continue
            for entry in entries:
                try:
                    regular = entry.is_file(follow_symlinks=False)
                except OSError:
                    regular = False
                tmp = _TMP_NAME.fullmatch(entry.name)
                if tmp is not None and regular:
                    if tmp.group(1) is None or not self._owner_alive(tmp.group(1)):
                        self._unlink_counted(entry.path)  # an interrupted write of a dead tier
                    continue
                m = _BLOCK_NAME.fullmatch(entry.name)
                if m is None or not regular or not m.group(1).startswith(sub.name):
                    self.foreign_files += 1
                    continue
                state, key, mtime = self._header_ok(entry.path)
                if state == "ours":
                    found.append((mtime, key))  # type: ignore[arg-type]
                elif state == "torn":
                    self.corrupt_files += 1
                    self._unlink_counted(entry.path)
                elif state == "foreign":
                    self.foreign_files += 1
                else:
                    self.scan_errors += 1
        found.sort()
        for _, key in found:
            self._index[key] = None
        # Announce what was found, then drop what no longer fits (emits removals).
        self._emit(list(self._index), removed=False)
        self._evict_over_capacity()

    def _unlink_counted(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError:
            self.scan_errors += 1

    # -- role --------------------------------------------------------------------

    def lookup(self, key: OffloadKey, ctx: ReqContext | None = None) -> LookupResult:
        return LookupResult.HIT if key in self._index else LookupResult.MISS

    def cached_keys(self) -> set[OffloadKey]:
        with self._lock:
            return set(self._index)

    def on_new_request(self, ctx: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext(self.policy)

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext | None = None) -> None:
        with self._lock:
            index = self._index
            for key in keys:
                if key in index:
                    index.move_to_end(key)

    def submit_store(self, job: JobMetadata) -> None:
        self._submit(self._run_store, job)

    def submit_load(self, job: JobMetadata) -> None:
        with self._lock:
            for key in job.keys:
                self._reading[key] = self._reading.get(key, 0) + 1
        self._submit(self._run_load, job)

    def _submit(self, fn: Any, job: JobMetadata) -> None:
        with self._lock:
            if self._closed:
                self._finished.append(JobResult(job.job_id, False))
                return
            self._in_flight += 1
        self._pool.submit(fn, job)

    def _done(self, job: JobMetadata, success: bool) -> None:
        with self._lock:
            self._finished.append(JobResult(job.job_id, success))
            self._in_flight -= 1
            self._lock.notify_all()

    def _evict_over_capacity(self) -> list[OffloadKey]:
        """(Lock held.) Drop LRU keys not being read until within capacity; emits removals."""
        cap = self.capacity_blocks
        if cap is None or len(self._index) <= cap:
            return []
        victims = []
        excess = len(self._index) - cap
        for key in self._index:
            if key not in self._reading:
                victims.append(key)
                if len(victims) == excess:
                    break
        if len(victims) < excess:
            self.capacity_overflows += 1
        for key in victims:
            del self._index[key]
            self._delete_file(key)
        self.evictions += len(victims)
        self._emit(victims, removed=True)
        return victims

    def _run_store(self, job: JobMetadata) -> None:
        ok = True
        try:
            io = self.block_io
            for key, block_id in zip(job.keys, job.block_ids.tolist()):
                with self._lock:
                    if key in self._index or key in self._writing:
                        continue
                    self._writing.add(key)
                try:
                    payload = io.read_block(block_id) if io is not None else b""
                    self._write_file(key, payload)
                except Exception:
                    ok = False
                    with self._lock:
                        self._writing.discard(key)
                        self.store_errors += 1
                    continue
                with self._lock:
                    self._writing.discard(key)
                    self._index[key] = None
                    self.stores += 1
                    self._emit([key], removed=False)
                    self._evict_over_capacity()
        except Exception:
            ok = False
            self.store_errors += 1
        self._done(job, ok)

    def _run_load(self, job: JobMetadata) -> None:
        ok = True
        try:
            io = self.block_io
            for key, block_id in zip(job.keys, job.block_ids.tolist()):
                got = self._read_file(self._path(key), key)
                if got is not None and io is not None and len(got[1]) != io.block_nbytes:
                    # e.g. written by a tier without block_io (empty payload): loading it would
                    # leave the slot as it was and report a hit with the wrong bytes
                    self.payload_mismatches += 1
                    got = None
                if got is None:
                    ok = False
                    with self._lock:
                        if key in self._index:  # present in the index but unreadable: corrupt
                            del self._index[key]
                            self.corrupt_files += 1
                            self._emit([key], removed=True)
                            self._delete_file(key)
                    break
                if io is not None:
                    io.write_block(block_id, got[1])
                self.loads += 1
        except Exception:
            ok = False
        finally:
            with self._lock:
                for key in job.keys:
                    n = self._reading.get(key, 0) - 1
                    if n > 0:
                        self._reading[key] = n
                    else:
                        self._reading.pop(key, None)
        if not ok:
            self.load_errors += 1
        self._done(job, ok)

    def get_finished_jobs(self) -> list[JobResult]:
        with self._lock:
            out, self._finished = self._finished, []
        return out

    def has_pending_work(self) -> bool:
        with self._lock:
            return self._in_flight > 0 or bool(self._finished)

    def drain_jobs(self, timeout: float | None = None) -> bool:
        with self._lock:
            return self._lock.wait_for(lambda: self._in_flight == 0, timeout)

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)
        if self._owner_fd is not None:
            try:
                os.unlink(self.root / _OWNERS / f"{self._token}.lock")
            except OSError:
                pass
            os.close(self._owner_fd)
            self._owner_fd = None
