"""``FileSystemSecondaryTierManager`` (type ``"fs"``): blocks as files under a directory.

Format: :mod:`manager.tiering.fs_io` (a one-page header with length, key and CRC32C, then the
payload); layout: :mod:`manager.tiering.fs_scan` (16 fan-out directories, owner locks, the
start-up scan; ``spread_dirs`` marks the root ``chattr +T`` so ext4 spreads them over its block
groups, ``fs_io.spread_directories``) and :mod:`manager.tiering.fs_places` (which file holds a block).

* Layout: with ``pack_blocks`` > 1 (default 64) where the filesystem punches holes and the root
  is not shared, a store job's page-multiple blocks under ``pack_below`` bytes (256 KiB) go in
  one pack file (:mod:`manager.tiering.fs_pack`), read back a run of units per file open and
  read; an evicted block's unit is punched out. Otherwise a file per block.
* Loads read header + payload into the primary's slot (``O_DIRECT`` where the filesystem takes
  it; ``o_direct`` forces it; C path: via a huge-page staging area, ``load_staging``), CRC-checked. A
  missing, torn, corrupt or mismatched file or unit fails the job (never a hit with wrong or
  missing bytes) and is deleted with a removal. Block files go through the C extension where
  built (``native_io``: ``load_threads`` / ``store_threads`` C threads, no GIL; ``fs_rw``).
* Stores write a temp file (one ``pwritev``) renamed into place: a reader sees no file or a
  whole one. When a store job reports success every block is whole under its final name
  (survives a process crash); with ``fsync=True`` the data (``fdatasync``) and the directory
  entries (``fsync`` of each directory touched) are on stable storage (survives power loss).
* Loads and stores have their own thread pools (``load_threads``, ``store_threads``): a load
  never waits behind queued stores. A job is split into up to one task per thread of its
  pool (a disk needs queue depth). A store job's blocks become loadable and are announced
  together, in key order, when its last task is done.
* Store backpressure: the tiering manager asks :meth:`admit_store` before submitting; the
  default policy skips a job while ``max_store_backlog_blocks`` blocks are queued (counted
  in ``stores_skipped`` / ``blocks_skipped``).
* Lookups answer from memory; with ``shared_root=True`` a miss starts an asynchronous disk
  probe and answers RETRY (:mod:`manager.tiering.fs_lookup`).
* ``capacity_blocks`` bounds the number of files (LRU eviction of blocks not being read,
  removal events). A restart finds the blocks again (oldest first in LRU order), announced
  with one stored event.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvevents.errors import ConfigError

from ..base import LookupResult, OffloadKey, OffloadPolicy, ReqContext, RequestOffloadingContext
from . import fs_io
from .base import JobMetadata, JobResult, SecondaryTierManager
from .fs_pack import Pack
from .fs_lookup import DiskLookups
from .fs_places import PACK_BELOW, BlockPlaces, check_pack_config, sync_dir
from .fs_rw import OS_ERROR, BlockFilesIO, JobState, NativeFilesIO, PythonFilesIO, spans
from .fs_scan import OwnerLock, block_path, probe_block, scan_root

__all__ = ["FileSystemSecondaryTierManager"]

_HIT, _MISS, _RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY


class FileSystemSecondaryTierManager(SecondaryTierManager):
    def __init__(
        self,
        tier_type: str = "fs",
        *,
        root: str | os.PathLike[str],
        capacity_blocks: int | None = None,
        load_threads: int = 64,
        store_threads: int = 16,
        num_threads: int | None = None,
        fsync: bool = False,
        o_direct: bool | None = None,
        max_store_backlog_blocks: int = 512,
        shared_root: bool = False,
        spread_dirs: bool = True,
        native_io: bool | None = None,
        offload_policy: str = "block_level",
        pack_blocks: int = 64,
        pack_below: int = PACK_BELOW,
        load_staging: bool = True,
        **kw: Any,
    ) -> None:
        if kw.get("store_policy") is None:
            kw["store_policy_args"] = {"max_backlog_blocks": max_store_backlog_blocks, **(kw.get("store_policy_args") or {})}
        super().__init__(tier_type, **kw)
        if capacity_blocks is not None and capacity_blocks <= 0:
            raise ConfigError(f"fs tier: capacity_blocks must be > 0 or None, got {capacity_blocks!r}")
        if num_threads is not None:  # one number for both pools (the older knob)
            load_threads = store_threads = num_threads
        for name, n in (("load_threads", load_threads), ("store_threads", store_threads)):
            if not isinstance(n, int) or n <= 0:
                raise ConfigError(f"fs tier: {name} must be an int > 0, got {n!r}")
        check_pack_config(pack_blocks, pack_below)
        if not isinstance(load_staging, bool):
            raise ConfigError(f"fs tier: load_staging must be True or False, got {load_staging!r}")
        if native_io and fs_io.native is None:
            raise ConfigError("fs tier: native_io=True, but the C extension manager.tiering._fsio is not built")
        try:
            self.policy = OffloadPolicy(offload_policy)
        except ValueError:
            raise ConfigError(
                f"fs tier: offload_policy must be one of {[p.value for p in OffloadPolicy]}, got {offload_policy!r}"
            ) from None
        self.root = Path(root)
        if not self.root.is_dir():  # (an existing read-only root is fine: loads still work)
            self.root.mkdir(parents=True, exist_ok=True)
        self._root = str(self.root)
        # (before any fan-out directory exists; see fs_io.spread_directories)
        self.spread_dirs = spread_dirs and fs_io.spread_directories(self._root)
        self.capacity_blocks = capacity_blocks
        self.fsync = fsync
        self.shared_root = shared_root
        self.load_threads, self.store_threads = load_threads, store_threads
        self.o_direct = fs_io.probe_o_direct(self._root) if o_direct is None else bool(o_direct)
        self.crc_kind = fs_io.default_crc_kind()
        self._lock = threading.Condition()
        self._index: OrderedDict[OffloadKey, None] = OrderedDict()  # committed keys, LRU first
        self._writing: set[OffloadKey] = set()
        self._reading: dict[OffloadKey, int] = {}  # key -> loads in flight (not evictable)
        self._finished: list[JobResult] = []
        self._in_flight = 0
        self._backlog = 0  # blocks of store jobs submitted and not finished
        self._closed = False
        self._loads = ThreadPoolExecutor(load_threads, thread_name_prefix=f"kv-{tier_type}-load")
        self._stores = ThreadPoolExecutor(store_threads, thread_name_prefix=f"kv-{tier_type}-store")
        self._disk = DiskLookups(self._lock, self._probe, self._found_on_disk, self._flush_deletes, tier_type) if shared_root else None
        native = fs_io.native is not None if native_io is None else native_io
        self._rw: BlockFilesIO = (NativeFilesIO if native else PythonFilesIO)(self.o_direct, load_threads, store_threads)
        self._rw.staged = load_staging and native and self.o_direct
        # Counters.
        self.stores = 0
        self.loads = 0
        self.store_errors = 0
        self.load_errors = 0
        self.corrupt_files = 0
        self.evictions = 0
        self.capacity_overflows = 0  # stores committed while nothing was evictable
        self.foreign_files = 0  # entries under root the start-up scan left alone (not ours)
        self.scan_errors = 0  # entries the start-up scan could not read, move or delete
        self.migrated_files = 0  # block files of the previous layout moved to their new place
        self.payload_mismatches = 0  # files whose payload is not one block of block_io
        self._owner = OwnerLock(self._root)
        self._token = self._owner.token
        # (under _lock) which file or pack unit holds each block
        self._places = BlockPlaces(self._root, self._token, fsync, pack_blocks if not shared_root else 1, pack_below)
        self._deleting = self._places.deleting  # evicted or damaged, not unlinked / punched yet
        self._recover()

    # -- files -------------------------------------------------------------------

    def _path(self, key: OffloadKey) -> Path:
        return Path(self._file(key))

    def _file(self, key: OffloadKey) -> str:
        return block_path(self._root, key)

    def _delete_file(self, key: OffloadKey) -> None:
        """(Lock held.) Queue the block's deletion (its file's unlink or its pack unit's
        punch, run by :meth:`_flush_deletes`); until then a store of it is left out."""
        self._places.delete(key)

    def _flush_deletes(self) -> None:
        """(Lock not held.) Run the queued deletions."""
        self._places.flush(self._lock)

    def _recover(self) -> None:
        res = scan_root(self._root, self._owner)
        self.corrupt_files += res.torn
        self.foreign_files += res.foreign
        self.scan_errors += res.errors
        self.migrated_files += res.migrated
        self._places.dirs.update(res.dirs)
        for key in self._places.recover(res):
            self._index[key] = None
        # Announce what was found, then drop what no longer fits (emits removals).
        self._emit(list(self._index), removed=False)
        self._evict_over_capacity()
        self._flush_deletes()

    # -- role --------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext | None = None) -> LookupResult:
        if key in self._index:
            return _HIT
        if self._disk is None:
            return _MISS
        with self._lock:
            return _HIT if key in self._index else self._disk.lookup(key)

    def holds(self, key: OffloadKey) -> bool:
        return key in self._index

    def _probe(self, key: OffloadKey) -> bool:
        io = self.block_io
        return probe_block(self._root, key, io.block_nbytes if io is not None else None)

    def _found_on_disk(self, key: OffloadKey) -> None:
        """(Lock held.) A block another tier wrote: indexed and announced."""
        if key not in self._index and key not in self._writing and key not in self._deleting:
            self._index[key] = None
            self._emit([key], removed=False)
            self._evict_over_capacity()

    @property
    def lookups_pending(self) -> int:
        return self._disk.pending if self._disk is not None else 0

    @property
    def lookups_found_on_disk(self) -> int:
        return self._disk.found_on_disk if self._disk is not None else 0

    def cached_keys(self) -> set[OffloadKey]:
        with self._lock:
            return set(self._index)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext(self.policy)

    def touch(self, keys: Sequence[OffloadKey], req_context: ReqContext | None = None) -> None:
        with self._lock:
            index = self._index
            for key in keys:
                if key in index:
                    index.move_to_end(key)

    def store_backlog(self) -> int:
        return self._backlog

    def submit_store(self, job: JobMetadata) -> None:
        with self._lock:
            self._backlog += len(job.keys)
        n, size = len(job.keys), self._places.pack_size(self.block_io)
        if size > 1:
            self._submit(self._stores, job, [(self._store_pack_task, (lo, min(lo + size, n))) for lo in range(0, n, size)])
        else:
            self._submit(self._stores, job, [(self._store_task, span) for span in spans(n, self._rw.store_tasks)])

    def submit_load(self, job: JobMetadata) -> None:
        with self._lock:
            for key in job.keys:
                self._reading[key] = self._reading.get(key, 0) + 1
            runs, files = self._places.plan_load(job.keys)
        tasks: list[tuple[Any, tuple[Any, ...]]] = [(self._load_run_task, run) for run in runs]
        if files or not runs:
            for lo, hi in spans(len(files), self._rw.load_tasks):
                tasks.append((self._load_task, (files[lo:hi],)))
        self._submit(self._loads, job, tasks)

    def _submit(self, pool: ThreadPoolExecutor, job: JobMetadata, tasks: list[tuple[Any, tuple[Any, ...]]]) -> None:
        state = JobState(job, len(tasks))
        with self._lock:
            if self._closed:
                self._finish(state, fail=True, blocks=len(job.keys))
                return
            self._in_flight += 1
        for fn, args in tasks:
            pool.submit(fn, state, *args)

    def _task_done(self, state: JobState, ok: bool, store_blocks: int = 0, loaded: int = 0) -> None:
        with self._lock:
            self._backlog -= store_blocks
            self.loads += loaded
            if not ok:
                state.ok = False
            state.tasks_left -= 1
            last = state.tasks_left == 0
            if last and state.parts:
                self._commit([k for lo in sorted(state.parts) for k in state.parts[lo]])
        self._flush_deletes()  # (before the result: a finished job's evictions are gone from disk)
        if last:
            with self._lock:
                self._in_flight -= 1
                self._finish(state)
                self._lock.notify_all()

    def _commit(self, keys: list[OffloadKey]) -> None:
        """(Lock held.) A store job's written blocks become loadable and are announced, in
        the job's key order, when its last task is done."""
        self._writing.difference_update(keys)
        new = [k for k in keys if k not in self._index]  # (a lookup probe may have been first)
        for key in keys:
            self._index[key] = None
        self.stores += len(keys)
        self._emit(new, removed=False)
        self._evict_over_capacity()

    def _finish(self, state: JobState, fail: bool = False, blocks: int = 0) -> None:
        """(Lock held.) The job's one result."""
        job = state.job
        ok = state.ok and not fail
        if fail:
            self._backlog -= blocks if not job.is_promotion else 0
        if job.is_promotion:
            for key in job.keys:
                n = self._reading.get(key, 0) - 1
                if n > 0:
                    self._reading[key] = n
                else:
                    self._reading.pop(key, None)
            if not ok:
                self.load_errors += 1
        self._finished.append(JobResult(job.job_id, ok))

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

    # -- the I/O tasks (pool threads) ------------------------------------------------

    def _store_task(self, state: JobState, lo: int, hi: int) -> None:
        job, ok = state.job, True
        io = self.block_io
        written: list[OffloadKey] = []
        dirs: set[str] = set()
        durable = True
        todo: list[tuple[OffloadKey, int]] = []
        try:
            todo = self._claim(job, lo, hi)
            items, failed = self._places.file_targets(todo)
            for (_tmp, path, key, _b), good in zip(items, self._rw.store(items, io, self.crc_kind, self.fsync)):
                if good:
                    written.append(key)
                    if self.fsync:
                        dirs.add(os.path.dirname(path))
                else:
                    failed.append(key)
            if failed:
                ok = False
                with self._lock:
                    self._writing.difference_update(failed)
                    self.store_errors += len(failed)
            durable = False
            for d in dirs:  # the renames themselves, durable before success is reported
                sync_dir(d)
            durable = True
        except Exception:
            ok = False
            with self._lock:
                self.store_errors += 1
                done = set(written)  # (claimed keys neither written nor released yet: released)
                self._writing.difference_update([k for k, _ in todo if k not in done])
        finally:
            self._stored(state, lo, hi, written, durable, ok)

    def _stored(self, state: JobState, lo: int, hi: int, written: list[OffloadKey], durable: bool, ok: bool) -> None:
        """A store task's end: what it wrote is committed with the job's other tasks, or, not
        known durable, released and deleted."""
        with self._lock:
            if durable:
                state.parts[lo] = written
            else:
                self._writing.difference_update(written)
                for key in written:
                    self._delete_file(key)
        self._task_done(state, ok and durable, hi - lo)

    def _claim(self, job: JobMetadata, lo: int, hi: int) -> list[tuple[OffloadKey, int]]:
        """Claim a store task's keys at once (one lock round, not one per block): those not
        stored, not being stored, and whose old file or unit is gone."""
        todo = []
        with self._lock:
            for key, block_id in zip(job.keys[lo:hi], job.block_ids[lo:hi].tolist()):
                if key in self._index or key in self._writing or key in self._deleting:
                    continue
                self._writing.add(key)
                todo.append((key, block_id))
        return todo

    def _store_pack_task(self, state: JobState, lo: int, hi: int) -> None:
        """Write the task's unclaimed blocks as one pack file (fs_pack.write_pack)."""
        io = self.block_io
        assert io is not None
        todo: list[tuple[OffloadKey, int]] = []
        pack: Pack | None = None
        durable = False
        try:
            todo = self._claim(state.job, lo, hi)
            if todo:
                path = self._places.new_pack_path(len(todo))
                self._rw.store_pack(f"{path}.tmp", path, todo, io, self.crc_kind, self.fsync)
                pack = Pack(path, fs_io.HEADER_SIZE + io.block_nbytes, len(todo), len(todo))
                if self.fsync:  # the rename itself, durable before success is reported
                    sync_dir(os.path.dirname(path))
            durable = True
        except Exception:
            with self._lock:
                self.store_errors += len(todo) or 1
                self._writing.difference_update(k for k, _b in todo)  # (the written ones: deleted below)
        finally:
            keys = [k for k, _b in todo] if pack is not None else []
            if keys:
                with self._lock:
                    self._places.add_pack(pack, keys)  # type: ignore[arg-type]
            self._stored(state, lo, hi, keys, durable, True)

    def _load_task(self, state: JobState, idxs: list[int]) -> None:
        job = state.job
        keys = [job.keys[j] for j in idxs]
        try:
            items = [(self._file(k), k, int(job.block_ids[j])) for k, j in zip(keys, idxs)]
            outcomes = self._rw.load(items, self.block_io, lambda: not state.ok)
        except Exception:
            outcomes = []
        self._loaded(state, keys, outcomes)

    def _load_run_task(self, state: JobState, pack: Pack, first: int, idxs: list[int]) -> None:
        """Read a run of consecutive units of one pack (fs_pack.read_run)."""
        job, io = state.job, self.block_io
        keys = [job.keys[j] for j in idxs]
        outcomes: list[str | None] = []
        try:
            if io is not None and state.ok:
                items = [(k, int(job.block_ids[j])) for k, j in zip(keys, idxs)]
                outcomes = self._rw.load_run(pack, first, items, io)
        except OSError:
            outcomes = [OS_ERROR] * len(keys)
        except Exception:
            outcomes = []
        self._loaded(state, keys, outcomes)

    def _loaded(self, state: JobState, keys: list[OffloadKey], outcomes: list[str | None]) -> None:
        for key, reason in zip(keys, outcomes):
            if reason is not None and reason != OS_ERROR:
                self._load_failed(key, reason)
        done = outcomes.count(None)
        self._task_done(state, done == len(keys), loaded=done)

    def _load_failed(self, key: OffloadKey, reason: str) -> None:
        """A block file that is not a whole block of ``key``: dropped, with a removal."""
        with self._lock:
            if reason == "length":
                self.payload_mismatches += 1
            if key in self._index and reason != "unverifiable":  # indexed but unreadable
                del self._index[key]
                self.corrupt_files += 1
                self._emit([key], removed=True)
                self._delete_file(key)

    # -- results and shutdown --------------------------------------------------------

    def get_finished_jobs(self) -> list[JobResult]:
        with self._lock:
            out, self._finished = self._finished, []
        return out

    def has_pending_work(self) -> bool:
        with self._lock:
            return self._in_flight > 0 or bool(self._finished) or self._probing()

    def drain_jobs(self, timeout: float | None = None) -> bool:
        """Wait until no job and no asynchronous lookup is in flight."""
        with self._lock:
            return self._lock.wait_for(lambda: self._in_flight == 0 and not self._probing(), timeout)

    def _probing(self) -> bool:
        return self._disk is not None and self._disk.busy()

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                "blocks": len(self._index), "store_backlog_blocks": self._backlog, "jobs_in_flight": self._in_flight,
                "stores": self.stores, "loads": self.loads, "store_errors": self.store_errors,
                "load_errors": self.load_errors, "corrupt_files": self.corrupt_files, "evictions": self.evictions,
                "stores_skipped": self.stores_skipped, "blocks_skipped": self.blocks_skipped,
                "lookups_pending": self.lookups_pending, "lookups_found_on_disk": self.lookups_found_on_disk,
                "payload_mismatches": self.payload_mismatches, "foreign_files": self.foreign_files,
                "scan_errors": self.scan_errors, "migrated_files": self.migrated_files, "o_direct": self.o_direct, "spread_dirs": self.spread_dirs,
                "checksum": "crc32c" if self.crc_kind == fs_io.CRC_CRC32C else "crc32",
                "native_io": isinstance(self._rw, NativeFilesIO), "load_staging": self._rw.staged,
                **self._places.stats(),
            }

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._disk is not None:
            self._disk.shutdown()
        self._loads.shutdown(wait=True)
        self._stores.shutdown(wait=True)
        self._rw.close()
        self._owner.release()
