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

import os
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
        self._recover()

    # -- files -------------------------------------------------------------------

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

    def _header_ok(self, path: Path) -> OffloadKey | None:
        """Start-up check: header, key and length (payload checksum is verified on load)."""
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                head = f.read(_HEADER.size)
                if len(head) < _HEADER.size:
                    return None
                magic, length, _crc, klen = _HEADER.unpack(head)
                if magic != _MAGIC or size != _HEADER.size + klen + length:
                    return None
                key = f.read(klen)
        except OSError:
            return None
        return key if path.name == key.hex() + _SUFFIX else None

    def _write_file(self, key: OffloadKey, payload: bytes | memoryview) -> None:
        path = self._path(key)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(f"{path.name}.{threading.get_ident()}.tmp")
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
        found: list[tuple[float, OffloadKey]] = []
        for sub in self.root.iterdir():
            if not sub.is_dir():
                continue
            for path in sub.iterdir():
                if path.name.endswith(".tmp"):
                    path.unlink(missing_ok=True)  # an interrupted write
                    continue
                if not path.name.endswith(_SUFFIX):
                    continue
                key = self._header_ok(path)
                if key is None:
                    self.corrupt_files += 1
                    path.unlink(missing_ok=True)
                    continue
                found.append((path.stat().st_mtime, key))
        found.sort()
        for _, key in found:
            self._index[key] = None
        # Announce what was found, then drop what no longer fits (emits removals).
        self._emit(list(self._index), removed=False)
        self._evict_over_capacity()

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
                if got is None:
                    ok = False
                    with self._lock:
                        if key in self._index:  # present in the index but unreadable: corrupt
                            del self._index[key]
                            self.corrupt_files += 1
                            self._emit([key], removed=True)
                            self._delete_file(key)
                    break
                if io is not None and got[1]:
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
