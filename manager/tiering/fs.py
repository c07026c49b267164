"""``FileSystemSecondaryTierManager`` (type ``"fs"``): blocks as files under a directory.

Layout and file format: :mod:`manager.tiering.fs_io` (a one-page header with length, key and
CRC32C, then the payload) and :mod:`manager.tiering.fs_scan` (fan-out directories, owner
locks, the start-up scan, the previous layout's files moved over). The 16 fan-out
directories (the key's first hex digit) are created when the tier starts; ``spread_dirs``
(default on) marks the root ``chattr +T`` first, so that ext4 spreads them, and their files'
inodes, over its block groups (a file create then does not walk past a group full of
recently deleted inodes; see ``fs_io.spread_directories``).

* Loads read header + payload with one ``preadv`` straight into the primary's slot, with
  ``O_DIRECT`` where the filesystem takes it (probed once; ``o_direct`` forces it on or off),
  then check the CRC over the slot. A missing, torn, corrupt or mismatched file fails the
  job (never a hit with wrong or missing bytes); a damaged file is deleted with a removal.
  Where the C extension is built (``native_io``, default on then) a load or store job is one
  call into it: ``load_threads`` / ``store_threads`` C threads read and check, or write, its
  blocks without the GIL (:mod:`manager.tiering.fs_rw`).
* Stores write a temp file (one ``pwritev``) and rename it into place: a reader sees no file
  or a whole one. Durability when a store job reports success: every block is a whole file
  under its final name (survives a crash of the process); with ``fsync=True`` the data
  (``fdatasync``) and the directory entries (``fsync`` of each fan-out directory touched, once
  per task) are on stable storage (survives power loss).
* Loads and stores have their own thread pools (``load_threads``, ``store_threads``): a load
  never waits behind queued stores. A job is split into up to one task per thread of its
  pool (a disk needs queue depth). A store job's blocks become loadable and are announced
  together, in key order, when its last task is done.
* Store backpressure: the tiering manager asks :meth:`admit_store` before submitting; the
  default policy skips a job while ``max_store_backlog_blocks`` blocks are queued (counted
  in ``stores_skipped`` / ``blocks_skipped``).
* Lookups answer from memory. With ``shared_root=True`` (other tiers, e.g. other engines,
  write the same root) a miss in memory starts an asynchronous header probe and answers
  RETRY; the answer is there in a later step (a file found is indexed and announced).
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
from itertools import count
from pathlib import Path
from typing import Any

from kvevents.errors import ConfigError

from ..base import LookupResult, OffloadKey, OffloadPolicy, ReqContext, RequestOffloadingContext
from . import fs_io
from .base import JobMetadata, JobResult, SecondaryTierManager
from .fs_pack import MAX_PACK, MAX_PACK_BYTES, Pack, PackBuffers, pack_name, probe_punch, punch, read_run, write_pack
from .fs_rw import OS_ERROR, BlockFilesIO, NativeFilesIO, PythonFilesIO
from .fs_scan import OwnerLock, block_path, make_fanout_dirs, probe_block, scan_root

__all__ = ["FileSystemSecondaryTierManager"]

_HIT, _MISS, _RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
_MAX_ANSWERS = 65536  # bound on asynchronous lookup answers held for the next step
_PACK_READS = ("auto", "direct", "buffered")
#: ``pack_reads="auto"``: pack runs of blocks this large or larger are read with O_DIRECT (where
#: the tier has it), smaller ones buffered (README "fs tier": measured at 64 and 256 KiB)
DIRECT_RUN_MIN_BLOCK = 256 * 1024


def _spans(n: int, threads: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` spans splitting ``n`` blocks into up to ``threads`` tasks (one, empty, for n = 0)."""
    step = -(-n // max(1, min(threads, n))) if n else 1
    return [(i, min(i + step, n)) for i in range(0, max(n, 1), step)]


class _JobState:
    __slots__ = ("job", "tasks_left", "ok", "parts")

    def __init__(self, job: JobMetadata, tasks: int) -> None:
        self.job = job
        self.tasks_left = tasks
        self.ok = True
        self.parts: dict[int, list[OffloadKey]] = {}  # store: first index of a task -> keys it wrote


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
        pack_reads: str = "auto",
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
        if not isinstance(pack_blocks, int) or not 1 <= pack_blocks <= MAX_PACK:
            raise ConfigError(f"fs tier: pack_blocks must be an int in 1..{MAX_PACK}, got {pack_blocks!r}")
        if pack_reads not in _PACK_READS:
            raise ConfigError(f"fs tier: pack_reads must be one of {list(_PACK_READS)}, got {pack_reads!r}")
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
        # Packs (a store job's blocks in one file, fs_pack) where evicted units can be punched
        # out; a shared root keeps a file per block (another tier's lookup probes a key's path).
        self.punch_holes = pack_blocks > 1 and not shared_root and probe_punch(self._root)
        self.pack_blocks = pack_blocks if self.punch_holes else 1
        self.pack_reads = pack_reads
        self._loc: dict[OffloadKey, tuple[Pack, int]] = {}  # packed keys -> (pack, unit)
        self._pack_ids = count()
        self._pack_bufs = PackBuffers()
        self._lock = threading.Condition()
        self._index: OrderedDict[OffloadKey, None] = OrderedDict()  # committed keys, LRU first
        self._writing: set[OffloadKey] = set()
        self._deleting: set[OffloadKey] = set()  # evicted or damaged, file not unlinked yet
        self._to_delete: list[OffloadKey] = []
        self._reading: dict[OffloadKey, int] = {}  # key -> loads in flight (not evictable)
        self._finished: list[JobResult] = []
        self._in_flight = 0
        self._backlog = 0  # blocks of store jobs submitted and not finished
        self._probing: set[OffloadKey] = set()
        self._answers: OrderedDict[OffloadKey, bool] = OrderedDict()
        self._tmp_ids = count()
        self._closed = False
        self._loads = ThreadPoolExecutor(load_threads, thread_name_prefix=f"kv-{tier_type}-load")
        self._stores = ThreadPoolExecutor(store_threads, thread_name_prefix=f"kv-{tier_type}-store")
        self._probes = ThreadPoolExecutor(1, thread_name_prefix=f"kv-{tier_type}-lookup") if shared_root else None
        native = fs_io.native is not None if native_io is None else native_io
        self._rw: BlockFilesIO = (NativeFilesIO if native else PythonFilesIO)(self.o_direct, load_threads, store_threads)
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
        self.packs = 0  # pack files holding live blocks
        self.packs_written = 0
        self.packs_removed = 0  # unlinked with their last live unit
        self.units_punched = 0  # evicted or damaged pack units given back to the filesystem
        self.punch_errors = 0  # punches or unlinks that failed (the space stays taken until a restart's scan)
        self.lookups_pending = 0  # lookups answered RETRY while a disk probe ran
        self.lookups_found_on_disk = 0  # probes that found a block written by another tier
        self._owner = OwnerLock(self._root)
        self._token = self._owner.token
        self._dirs: set[str] = set()  # fan-out directories known to exist
        self._dirs.update(make_fanout_dirs(self._root, fsync))
        self._recover()

    # -- files -------------------------------------------------------------------

    def _fanout_dir(self, key: OffloadKey) -> None:
        """Create the key's fan-out directory once per tier lifetime (not per block)."""
        sub = key[:1].hex()[:1]
        if sub not in self._dirs:
            os.makedirs(os.path.join(self._root, sub), exist_ok=True)
            self._dirs.add(sub)

    def _path(self, key: OffloadKey) -> Path:
        return Path(self._file(key))

    def _file(self, key: OffloadKey) -> str:
        return block_path(self._root, key)

    def _delete_file(self, key: OffloadKey) -> None:
        """(Lock held.) Queue the block's deletion: its file's unlink, or its pack unit's punch
        (the pack's unlink with its last live unit), runs after the lock is released
        (:meth:`_flush_deletes`), so a slow disk never holds the lock the scheduler's calls
        take. Until then the key is in ``_deleting`` and a store of it is left out."""
        self._deleting.add(key)
        where = self._loc.pop(key, None)
        if where is None:
            self._to_delete.append((key, None, 0))
        else:
            self._drop_unit(key, *where)

    def _drop_unit(self, key: OffloadKey | None, pack: Pack, unit: int) -> None:
        """(Lock held.) Queue the punch of ``pack``'s ``unit`` (no longer counted live), or
        the pack's unlink when it was the last live one."""
        pack.live -= 1
        if pack.live <= 0:
            self.packs -= 1
        self._to_delete.append((key, pack, unit if pack.live > 0 else -1))

    def _flush_deletes(self) -> None:
        """(Lock not held.) Unlink the queued files, punch the queued pack units."""
        while True:
            with self._lock:
                if not self._to_delete:
                    return
                batch, self._to_delete = self._to_delete, []
            punched = removed = failed = 0
            for key, pack, unit in batch:
                try:
                    if pack is None:
                        os.unlink(self._file(key))  # type: ignore[arg-type]
                    elif unit < 0:
                        os.unlink(pack.path)
                        removed += 1
                    else:
                        punch(pack.path, unit * pack.stride, pack.stride)
                        punched += 1
                except FileNotFoundError:
                    pass
                except OSError:
                    failed += pack is not None
            with self._lock:
                self._deleting.difference_update(k for k, _p, _u in batch if k is not None)
                self.units_punched += punched
                self.packs_removed += removed
                self.punch_errors += failed

    def _recover(self) -> None:
        res = scan_root(self._root, self._owner)
        self.corrupt_files += res.torn
        self.foreign_files += res.foreign
        self.scan_errors += res.errors
        self.migrated_files += res.migrated
        self._dirs.update(res.dirs)
        packs = {path: Pack(path, stride, n, 0) for path, (stride, n) in res.packs.items()}
        for _, key, where in res.found:
            self._index[key] = None
            if where is not None:
                pack = packs[where[0]]
                pack.live += 1
                self._loc[key] = (pack, where[1])
        self.packs = sum(1 for p in packs.values() if p.live)
        for key, where in res.shadowed:  # older copies of a key found twice: deleted
            if where is None:
                self._to_delete.append((key, None, 0))
            else:
                self._to_delete.append((None, packs[where[0]], where[1]))
        self._to_delete.extend((None, p, -1) for p in packs.values() if not p.live)
        # Announce what was found, then drop what no longer fits (emits removals).
        self._emit(list(self._index), removed=False)
        self._evict_over_capacity()
        self._flush_deletes()

    # -- role --------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext | None = None) -> LookupResult:
        if key in self._index:
            return _HIT
        if self._probes is None:
            return _MISS
        with self._lock:
            if key in self._index:
                return _HIT
            answer = self._answers.pop(key, None)
            if answer is not None:
                return _MISS  # (a found file is in the index already)
            if key not in self._probing:
                if self._closed:
                    return _MISS
                self._probing.add(key)
                self._probes.submit(self._probe, key)
            self.lookups_pending += 1
        return _RETRY

    def holds(self, key: OffloadKey) -> bool:
        return key in self._index

    def _probe(self, key: OffloadKey) -> None:
        io = self.block_io
        found = probe_block(self._root, key, io.block_nbytes if io is not None else None)
        with self._lock:
            self._probing.discard(key)
            if found and key not in self._index and key not in self._writing and key not in self._deleting:
                self._index[key] = None
                self.lookups_found_on_disk += 1
                self._emit([key], removed=False)
                self._evict_over_capacity()
            elif not found:
                self._answers[key] = False
                if len(self._answers) > _MAX_ANSWERS:
                    self._answers.popitem(last=False)  # (that key is probed again if asked)
            self._lock.notify_all()
        self._flush_deletes()

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

    def _pack_size(self) -> int:
        """Blocks per pack file for a store job now (1: a file per block)."""
        io = self.block_io
        if self.pack_blocks == 1 or io is None or io.block_nbytes <= 0 or io.block_nbytes % fs_io.ALIGN:
            return 1
        return max(1, min(self.pack_blocks, MAX_PACK_BYTES // (fs_io.HEADER_SIZE + io.block_nbytes)))

    def submit_store(self, job: JobMetadata) -> None:
        with self._lock:
            self._backlog += len(job.keys)
        n, size = len(job.keys), self._pack_size()
        if size > 1:
            self._submit(self._stores, job, [(self._store_pack_task, (lo, min(lo + size, n))) for lo in range(0, n, size)])
        else:
            self._submit(self._stores, job, [(self._store_task, span) for span in _spans(n, self._rw.store_tasks)])

    def submit_load(self, job: JobMetadata) -> None:
        with self._lock:
            for key in job.keys:
                self._reading[key] = self._reading.get(key, 0) + 1
            runs, files = self._plan_load(job)
        tasks: list[tuple[Any, tuple[Any, ...]]] = [(self._load_run_task, run) for run in runs]
        if files or not runs:
            for lo, hi in _spans(len(files), self._rw.load_tasks):
                tasks.append((self._load_task, (files[lo:hi],)))
        self._submit(self._loads, job, tasks)

    def _plan_load(self, job: JobMetadata) -> tuple[list[tuple[Pack, int, list[int]]], list[int]]:
        """(Lock held.) The job's packed blocks as runs of consecutive units of one pack
        ``(pack, first unit, job indexes in unit order)`` (one file open, one read each), and
        the job indexes of its block files."""
        files: list[int] = []
        by_pack: dict[Pack, list[tuple[int, int]]] = {}
        loc = self._loc
        for j, key in enumerate(job.keys):
            where = loc.get(key)
            if where is None:
                files.append(j)
            else:
                by_pack.setdefault(where[0], []).append((where[1], j))
        runs: list[tuple[Pack, int, list[int]]] = []
        for pack, units in by_pack.items():
            units.sort()
            start = 0
            for i in range(1, len(units) + 1):
                if i == len(units) or units[i][0] != units[i - 1][0] + 1:
                    runs.append((pack, units[start][0], [j for _u, j in units[start:i]]))
                    start = i
        return runs, files

    def _submit(self, pool: ThreadPoolExecutor, job: JobMetadata, tasks: list[tuple[Any, tuple[Any, ...]]]) -> None:
        state = _JobState(job, len(tasks))
        with self._lock:
            if self._closed:
                self._finish(state, fail=True, blocks=len(job.keys))
                return
            self._in_flight += 1
        for fn, args in tasks:
            pool.submit(fn, state, *args)

    def _task_done(self, state: _JobState, ok: bool, store_blocks: int = 0, loaded: int = 0) -> None:
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

    def _finish(self, state: _JobState, fail: bool = False, blocks: int = 0) -> None:
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

    def _store_task(self, state: _JobState, lo: int, hi: int) -> None:
        job, ok = state.job, True
        io = self.block_io
        written: list[OffloadKey] = []
        dirs: set[str] = set()
        durable = True
        todo: list[tuple[OffloadKey, int]] = []
        try:
            todo = self._claim(job, lo, hi)
            items, failed = [], []
            for key, block_id in todo:
                path = self._file(key)
                try:
                    self._fanout_dir(key)
                except OSError:
                    failed.append(key)
                    continue
                items.append((f"{path}.{self._token}.{next(self._tmp_ids)}.tmp", path, key, block_id))
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
                self._sync_dir(d)
            durable = True
        except Exception:
            ok = False
            with self._lock:
                self.store_errors += 1
                done = set(written)  # (claimed keys neither written nor released yet: released)
                self._writing.difference_update([k for k, _ in todo if k not in done])
        finally:
            with self._lock:
                if durable:
                    state.parts[lo] = written  # committed with the job's other tasks
                else:
                    self._writing.difference_update(written)
                    for key in written:  # not known durable: not claimed
                        self._delete_file(key)
            self._task_done(state, ok, hi - lo)

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

    def _sync_dir(self, d: str) -> None:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _store_pack_task(self, state: _JobState, lo: int, hi: int) -> None:
        """Write the task's unclaimed blocks as one pack file (fs_pack.write_pack)."""
        io = self.block_io
        assert io is not None
        todo: list[tuple[OffloadKey, int]] = []
        pack: Pack | None = None
        durable = False
        try:
            todo = self._claim(state.job, lo, hi)
            if todo:
                n = next(self._pack_ids)
                sub = f"{n % 16:x}"  # (packs spread over the fan-out directories)
                if sub not in self._dirs:
                    os.makedirs(os.path.join(self._root, sub), exist_ok=True)
                    self._dirs.add(sub)
                path = os.path.join(self._root, sub, pack_name(self._token, n, len(todo)))
                write_pack(f"{path}.tmp", path, [(k, io.read_block(b)) for k, b in todo], self._pack_bufs, self.o_direct,
                           self.crc_kind, self.fsync)
                pack = Pack(path, fs_io.HEADER_SIZE + io.block_nbytes, len(todo), len(todo))
                if self.fsync:  # the rename itself, durable before success is reported
                    self._sync_dir(os.path.dirname(path))
            durable = True
        except Exception:
            pass
        finally:
            with self._lock:
                keys = [k for k, _b in todo]
                if pack is not None:
                    self.packs += 1
                    self.packs_written += 1
                    for i, key in enumerate(keys):
                        self._loc[key] = (pack, i)
                if durable:
                    state.parts[lo] = keys  # committed with the job's other tasks
                else:
                    self.store_errors += len(keys) or 1
                    self._writing.difference_update(keys)
                    for key in keys if pack is not None else ():  # written, not known durable: not claimed
                        self._delete_file(key)
            self._task_done(state, durable, hi - lo)

    def _load_task(self, state: _JobState, idxs: list[int]) -> None:
        job = state.job
        keys = [job.keys[j] for j in idxs]
        try:
            items = [(self._file(k), k, int(job.block_ids[j])) for k, j in zip(keys, idxs)]
            outcomes = self._rw.load(items, self.block_io, lambda: not state.ok)
        except Exception:
            outcomes = []
        self._loaded(state, keys, outcomes)

    def _load_run_task(self, state: _JobState, pack: Pack, first: int, idxs: list[int]) -> None:
        """Read a run of consecutive units of one pack (fs_pack.read_run)."""
        job, io = state.job, self.block_io
        keys = [job.keys[j] for j in idxs]
        outcomes: list[str | None] = []
        try:
            if io is not None and state.ok:
                nbytes = io.block_nbytes
                direct = self.o_direct and (self.pack_reads == "direct"
                                            or (self.pack_reads == "auto" and nbytes >= DIRECT_RUN_MIN_BLOCK))
                slots = [io.writable_block(int(job.block_ids[j])) for j in idxs]
                if all(s is not None for s in slots):
                    outcomes = read_run(pack, first, list(zip(keys, slots)), nbytes, self._pack_bufs, direct)
                else:  # a BlockIO without writable views: unit by unit through a bounce buffer
                    for i, (key, j) in enumerate(zip(keys, idxs)):
                        tmp = self._pack_bufs.bounce(nbytes)
                        (reason,) = read_run(pack, first + i, [(key, tmp)], nbytes, self._pack_bufs, False)
                        if reason is None:
                            io.write_block(int(job.block_ids[j]), tmp)
                        outcomes.append(reason)
        except OSError:
            outcomes = [OS_ERROR] * len(keys)
        except Exception:
            outcomes = []
        self._loaded(state, keys, outcomes)

    def _loaded(self, state: _JobState, keys: list[OffloadKey], outcomes: list[str | None]) -> None:
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
            return self._in_flight > 0 or bool(self._finished) or bool(self._probing)

    def drain_jobs(self, timeout: float | None = None) -> bool:
        """Wait until no job and no asynchronous lookup is in flight."""
        with self._lock:
            return self._lock.wait_for(lambda: self._in_flight == 0 and not self._probing, timeout)

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
                "native_io": isinstance(self._rw, NativeFilesIO),
                "layout": "pack" if self.pack_blocks > 1 else "block", "pack_blocks": self.pack_blocks,
                "packs": self.packs, "packs_written": self.packs_written, "packs_removed": self.packs_removed,
                "units_punched": self.units_punched, "punch_errors": self.punch_errors,
            }

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._probes is not None:
            self._probes.shutdown(wait=True)
        self._loads.shutdown(wait=True)
        self._stores.shutdown(wait=True)
        self._rw.close()
        self._owner.release()
