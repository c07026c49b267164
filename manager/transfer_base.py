"""Block-copy jobs between a device KV cache and a host buffer: the torch-free half.

A *store* copies device blocks to host blocks, a *load* copies host blocks back to the
device. Block ids are counted in device-block units on both sides (an offloaded block
that spans ``k`` device blocks occupies ``k`` consecutive host rows; see
:func:`expand_block_ids`).

This module holds what every worker shares and needs no torch: the typed errors, the
result struct, the :class:`TransferWorker` role, the thread that runs copies off the
caller's thread, and :class:`NumpyTransferWorker`, which copies numpy arrays (the path the
simulated engine takes when torch is not installed). The torch worker (CPU thread or
CUDA streams) lives in :mod:`manager.transfer`.
"""

from __future__ import annotations

import abc
import collections
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from kvevents.errors import KVEventsError

LOAD = "load"  # host -> device
STORE = "store"  # device -> host


class TransferError(KVEventsError):
    """Base of the transfer worker's errors."""


class BlockIdError(TransferError, IndexError):
    """Block ids that are not a 1-D integer list, out of range, of unequal length or duplicated."""


class ShapeMismatchError(TransferError, ValueError):
    """The host buffer does not match the device cache (block shape, dtype or layout)."""


class DuplicateJobError(TransferError, ValueError):
    """A job id that is still in flight was submitted again."""


class WorkerClosedError(TransferError, RuntimeError):
    """A job was submitted after ``shutdown()``."""


@dataclass(slots=True, frozen=True)
class TransferResult:
    """What became of one job: ``success`` False carries the reason in ``error``."""

    job_id: int
    direction: str
    success: bool
    num_blocks: int = 0
    error: str | None = None


def as_block_ids(ids: Any, *, what: str, limit: int) -> np.ndarray:
    """``ids`` as a 1-D int64 array of values in ``[0, limit)``; BlockIdError naming ``what`` if not."""
    if hasattr(ids, "detach") and hasattr(ids, "cpu"):  # a torch tensor, without importing torch
        ids = ids.detach().cpu().numpy()
    arr = np.asarray(ids)
    if arr.size == 0:
        arr = arr.reshape(0).astype(np.int64)
    if arr.ndim != 1:
        raise BlockIdError(f"{what}: block ids must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise BlockIdError(f"{what}: block ids must be integers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64, copy=False)
    if arr.size:
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= limit:
            bad = lo if lo < 0 else hi
            raise BlockIdError(f"{what}: block id {bad} out of range [0, {limit})")
    return arr


def expand_block_ids(ids: Any, blocks_per_id: int, *, skip: int = 0) -> np.ndarray:
    """Offloaded-block ids to device-block-unit rows: id ``b`` covers rows ``b*k .. b*k+k-1``.

    ``skip`` drops that many leading rows (the part of the first offloaded block the device
    already holds, for a load that starts mid-block).
    """
    k = int(blocks_per_id)
    if k < 1:
        raise ValueError(f"blocks_per_id must be >= 1, got {blocks_per_id}")
    base = np.asarray(ids, dtype=np.int64).reshape(-1)
    rows = (base[:, None] * k + np.arange(k, dtype=np.int64)[None, :]).reshape(-1)
    return rows[skip:] if skip else rows


def contiguous_runs(src: np.ndarray, dst: np.ndarray) -> list[tuple[int, int, int]]:
    """Split paired ids into ``(src_start, dst_start, length)`` runs where both advance by one."""
    n = len(src)
    if n == 0:
        return []
    if n == 1:
        return [(int(src[0]), int(dst[0]), 1)]
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [n]))
    return [(int(src[s]), int(dst[s]), int(e - s)) for s, e in zip(starts, ends)]


def run_count(src: np.ndarray, dst: np.ndarray) -> int:
    """How many runs :func:`contiguous_runs` would return, without building them."""
    n = len(src)
    if n < 2:
        return n
    return 1 + int(np.count_nonzero((np.diff(src) != 1) | (np.diff(dst) != 1)))


def copy_runs(dst: np.ndarray, src: np.ndarray, src_ids: np.ndarray, dst_ids: np.ndarray) -> None:
    """``dst[dst_ids] = src[src_ids]`` as one slice copy per contiguous run.

    Fancy indexing would gather into a temporary and scatter it (two passes over the bytes,
    measured 1.5-10x slower than per-run memcpy on this machine's CPUs)."""
    for s, d, n in contiguous_runs(src_ids, dst_ids):
        dst[d : d + n] = src[s : s + n]


@dataclass(slots=True)
class _Job:
    job_id: int
    direction: str
    src: np.ndarray
    dst: np.ndarray


class TransferWorker(abc.ABC):
    """Executes load and store jobs asynchronously and reports finished job ids.

    ``submit_*`` validate their input at once (raising a :class:`TransferError`) and return
    without waiting for the copy; a job that fails while running is reported by
    :meth:`get_finished` with ``success=False``, never left hanging.
    """

    def __init__(self, num_device_blocks: int, num_host_blocks: int) -> None:
        self.num_device_blocks = int(num_device_blocks)
        self.num_host_blocks = int(num_host_blocks)
        self.jobs_submitted = 0
        self.jobs_succeeded = 0
        self.jobs_failed = 0
        self.blocks_copied = 0
        self.bytes_copied = 0
        self.bytes_per_block = 0
        self._closed = False
        #: who hears of each job (telemetry): ``job_submitted(job_id, direction, blocks)`` when a
        #: job is accepted, ``job_finished(job_id, success, error)`` as get_finished reports it
        self.job_observers: tuple[Any, ...] = ()

    # --- the role -------------------------------------------------------------------------
    def submit_store(self, job_id: int, device_block_ids: Any, host_block_ids: Any) -> None:
        """Copy device blocks to host blocks (pairwise, in order)."""
        self._submit(job_id, STORE, device_block_ids, host_block_ids)

    def submit_load(self, job_id: int, host_block_ids: Any, device_block_ids: Any) -> None:
        """Copy host blocks to device blocks (pairwise, in order)."""
        self._submit(job_id, LOAD, host_block_ids, device_block_ids)

    @abc.abstractmethod
    def get_finished(self) -> list[TransferResult]:
        """Results of the jobs that finished since the last call (a drain; never blocks)."""

    @abc.abstractmethod
    def wait(self, job_ids: Iterable[int] | None = None, timeout: float | None = None) -> bool:
        """Block until the given jobs (default: every job in flight) are done; False on timeout."""

    @abc.abstractmethod
    def in_flight(self) -> set[int]:
        """Ids of the jobs submitted and not yet finished."""

    @abc.abstractmethod
    def shutdown(self, timeout: float | None = 5.0) -> None:
        """Stop; a job that never ran is reported failed by the next ``get_finished``."""

    def add_job_observer(self, observer: Any) -> None:
        """``observer`` hears every job from now on (see :attr:`job_observers`)."""
        self.job_observers = (*self.job_observers, observer)

    def remove_job_observer(self, observer: Any) -> None:
        self.job_observers = tuple(o for o in self.job_observers if o is not observer)

    def _report(self, results: list[TransferResult]) -> list[TransferResult]:
        """What ``get_finished`` returns, told to the job observers first."""
        for o in self.job_observers:
            for r in results:
                o.job_finished(r.job_id, r.success, r.error)
        return results

    def host_array(self) -> np.ndarray:
        """The host buffer as a numpy array sharing its memory (``host_cache``: a numpy array,
        or a CPU torch tensor, pinned or not)."""
        return np.asarray(self.host_cache)  # type: ignore[attr-defined]

    def stats(self) -> dict[str, int]:
        return {
            "jobs_submitted": self.jobs_submitted,
            "jobs_succeeded": self.jobs_succeeded,
            "jobs_failed": self.jobs_failed,
            "blocks_copied": self.blocks_copied,
            "bytes_copied": self.bytes_copied,
            "jobs_in_flight": len(self.in_flight()),
        }

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # --- shared plumbing ------------------------------------------------------------------
    def _validate(self, job_id: int, direction: str, src: Any, dst: Any) -> _Job:
        if self._closed:
            raise WorkerClosedError(f"job {job_id}: the transfer worker is shut down")
        if isinstance(job_id, bool) or not isinstance(job_id, (int, np.integer)):
            raise TypeError(f"job id must be an int, got {type(job_id).__name__}")
        if direction == STORE:
            s = as_block_ids(src, what=f"store job {job_id} device ids", limit=self.num_device_blocks)
            d = as_block_ids(dst, what=f"store job {job_id} host ids", limit=self.num_host_blocks)
        else:
            s = as_block_ids(src, what=f"load job {job_id} host ids", limit=self.num_host_blocks)
            d = as_block_ids(dst, what=f"load job {job_id} device ids", limit=self.num_device_blocks)
        if len(s) != len(d):
            raise BlockIdError(
                f"{direction} job {job_id}: {len(s)} source block ids but {len(d)} destination ids"
            )
        if len(np.unique(d)) != len(d):
            raise BlockIdError(f"{direction} job {job_id}: duplicate destination block ids")
        return _Job(int(job_id), direction, s, d)

    def _submit(self, job_id: int, direction: str, src: Any, dst: Any) -> None:
        job = self._validate(job_id, direction, src, dst)
        for o in self.job_observers:
            o.job_submitted(job.job_id, direction, len(job.src))
        self._enqueue(job)

    @abc.abstractmethod
    def _enqueue(self, job: _Job) -> None: ...

    def _count(self, result: TransferResult) -> None:
        if result.success:
            self.jobs_succeeded += 1
            self.blocks_copied += result.num_blocks
            self.bytes_copied += result.num_blocks * self.bytes_per_block
        else:
            self.jobs_failed += 1


class ThreadedTransferWorker(TransferWorker):
    """A worker whose copies run, in submission order, on one background thread."""

    def __init__(self, num_device_blocks: int, num_host_blocks: int, *, name: str = "kv-transfer") -> None:
        super().__init__(num_device_blocks, num_host_blocks)
        self._cv = threading.Condition()
        self._queue: collections.deque[_Job] = collections.deque()
        self._pending: set[int] = set()
        self._results: list[TransferResult] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @abc.abstractmethod
    def _copy(self, job: _Job) -> None:
        """Perform the copy of one job (on the worker thread); raise on failure."""

    def _enqueue(self, job: _Job) -> None:
        with self._cv:
            if self._stop:
                raise WorkerClosedError(f"job {job.job_id}: the transfer worker is shut down")
            if job.job_id in self._pending:
                raise DuplicateJobError(f"job id {job.job_id} is already in flight")
            self._pending.add(job.job_id)
            self._queue.append(job)
            self.jobs_submitted += 1
            self._cv.notify_all()

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                job = self._queue.popleft()
            try:
                self._copy(job)
                result = TransferResult(job.job_id, job.direction, True, len(job.src))
            except Exception as exc:  # reported, never raised on this thread
                result = TransferResult(
                    job.job_id, job.direction, False, len(job.src), f"{type(exc).__name__}: {exc}"
                )
            with self._cv:
                self._pending.discard(job.job_id)
                self._results.append(result)
                self._count(result)
                self._cv.notify_all()

    def get_finished(self) -> list[TransferResult]:
        with self._cv:
            out, self._results = self._results, []
        return self._report(out) if self.job_observers else out

    def in_flight(self) -> set[int]:
        with self._cv:
            return set(self._pending)

    def wait(self, job_ids: Iterable[int] | None = None, timeout: float | None = None) -> bool:
        wanted = None if job_ids is None else set(job_ids)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while True:
                busy = self._pending if wanted is None else (self._pending & wanted)
                if not busy:
                    return True
                if deadline is None:
                    self._cv.wait()
                else:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cv.wait(left)

    def shutdown(self, timeout: float | None = 5.0) -> None:
        with self._cv:
            if self._closed:
                return
            self._closed = True
        # let queued jobs finish within the deadline, then stop the thread
        self.wait(timeout=timeout)
        with self._cv:
            self._stop = True
            never_ran = list(self._queue)
            self._queue.clear()
            for job in never_ran:
                self._pending.discard(job.job_id)
                result = TransferResult(job.job_id, job.direction, False, len(job.src), "worker shut down")
                self._results.append(result)
                self._count(result)
            self._cv.notify_all()
        self._thread.join(timeout)


class LayeredCache:
    """What a worker over a KV cache given as layers knows of it: ``layers`` ``[(device layer,
    host layer), ...]`` (see :func:`layer_pairs`), ``device_cache`` / ``host_cache`` the first
    (or only) layer's, ``bytes_per_block`` a block's bytes over every layer."""

    layers: list[tuple[Any, Any]]
    bytes_per_block: int

    def _take_layers(self, layers: list[tuple[Any, Any]]) -> None:
        self.layers = layers
        self.bytes_per_block = sum(int(d[0].nbytes) for d, _ in layers) if layers[0][0].shape[0] else 0

    @property
    def device_cache(self) -> Any:
        return self.layers[0][0]

    @property
    def host_cache(self) -> Any:
        return self.layers[0][1]


class NumpyTransferWorker(LayeredCache, ThreadedTransferWorker):
    """Copies between numpy arrays ``[num_blocks, ...]``; needs no torch.

    ``device_cache`` is one array or a list of *layers* (arrays with the same number of
    blocks, e.g. one per model layer): a job copies its block ids in every layer. The host
    side is a number of host blocks to allocate, or one array per layer."""

    def __init__(self, device_cache: Any, host_cache: Any) -> None:
        def make_host(dev: Any, host: Any) -> np.ndarray:
            return np.zeros((host, *dev.shape[1:]), dtype=dev.dtype) if isinstance(host, int) else host

        for d in as_layers(device_cache):
            if not isinstance(d, np.ndarray) or d.ndim < 1:
                raise ShapeMismatchError("device_cache must be a numpy array shaped [num_blocks, ...] (or a list of them)")
        layers = layer_pairs(device_cache, host_cache, make_host)
        super().__init__(layers[0][0].shape[0], layers[0][1].shape[0], name="kv-transfer-numpy")
        self._take_layers(layers)

    def _copy(self, job: _Job) -> None:
        for dev, host in self.layers:
            if job.direction == STORE:
                copy_runs(host, dev, job.src, job.dst)
            else:
                copy_runs(dev, host, job.src, job.dst)


def as_layers(device_cache: Any) -> list[Any]:
    """A device cache given as one array/tensor or a list of layers, as a list."""
    return list(device_cache) if isinstance(device_cache, (list, tuple)) else [device_cache]


def layer_pairs(device_cache: Any, host_cache: Any, make_host: Any) -> list[tuple[Any, Any]]:
    """``[(device layer, host layer), ...]``: ``host_cache`` is a number of host blocks or one
    host array per layer, each passed through ``make_host(device layer, int or array)`` (which
    allocates, or checks/pins a given one); every layer has the same number of device blocks
    and of host blocks, and each host layer the block shape and dtype of its device layer."""
    devs = as_layers(device_cache)
    if not devs:
        raise ShapeMismatchError("device_cache is an empty list of layers")
    if len({d.shape[0] for d in devs}) != 1:
        raise ShapeMismatchError(f"layers with different numbers of device blocks: {sorted({d.shape[0] for d in devs})}")
    if isinstance(host_cache, (bool, np.bool_)):
        raise ValueError(f"host blocks must be a positive int or host arrays, got {host_cache!r}")
    if isinstance(host_cache, (int, np.integer)):
        if host_cache < 1:
            raise ValueError(f"number of host blocks must be >= 1, got {host_cache}")
        hosts = [make_host(d, int(host_cache)) for d in devs]
    else:
        given = as_layers(host_cache)
        if len(given) != len(devs):
            raise ShapeMismatchError(f"{len(given)} host layers for {len(devs)} device layers")
        hosts = [make_host(d, h) for d, h in zip(devs, given)]
    for d, h in zip(devs, hosts):
        check_host_layout(d.shape, d.dtype, h.shape, h.dtype)
    if len({h.shape[0] for h in hosts}) != 1:
        raise ShapeMismatchError(f"host layers with different numbers of blocks: {sorted({h.shape[0] for h in hosts})}")
    return list(zip(devs, hosts))


def check_host_layout(dev_shape: Sequence[int], dev_dtype: Any, host_shape: Sequence[int], host_dtype: Any) -> None:
    """ShapeMismatchError unless host blocks have the device blocks' shape and dtype."""
    dev_shape, host_shape = tuple(dev_shape), tuple(host_shape)
    if len(host_shape) < 1 or host_shape[0] < 1:
        raise ShapeMismatchError(f"host buffer must be shaped [num_blocks >= 1, ...], got {host_shape}")
    if host_shape[1:] != dev_shape[1:]:
        raise ShapeMismatchError(
            f"host block shape {host_shape[1:]} != device block shape {dev_shape[1:]} "
            f"(host buffer {host_shape}, device cache {dev_shape})"
        )
    if str(host_dtype) != str(dev_dtype):
        raise ShapeMismatchError(f"host dtype {host_dtype} != device dtype {dev_dtype}")
