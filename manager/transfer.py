"""The torch transfer worker: copies KV blocks between a device cache and a host buffer.

``TorchTransferWorker(device_cache, host_blocks)``:

* ``device_cache`` is a tensor ``[num_blocks, ...]`` (one row per device block, whatever the
  rest of the layout), or a list of such *layers* with the same number of blocks (vLLM hands
  a worker one tensor per layer): a job copies its block ids in every layer, as one job
  (one id transfer and one event on CUDA, however many layers);
* ``host_blocks`` is either a number of host rows to allocate or a ready host tensor of the
  same block shape and dtype (one per layer). The host buffer is pinned when the device is
  CUDA.

On CUDA each direction has its own stream: a store first waits for the work already queued
on the current stream (so it copies what the model wrote); an event recorded after the job
tells ``get_finished`` when it is done. A job is copied one of two ways (``copy_mode``):

* ``"kernel"``: one gather kernel and one scatter kernel per job that read or write the
  pinned host buffer directly through CUDA's unified addressing (the host buffer is seen by
  the GPU as a device tensor at the same address). Scattered block ids cost nothing extra,
  so this reaches the link's rate even for small blocks; the price is a few SMs' time;
* ``"dma"``: one ``copy_`` per contiguous run of ids, on the copy engines (no SM time, but
  each run pays the copy's launch cost: blocks of 256 KiB at random ids measured half the
  link's rate on an H100).

``"auto"`` (the default) takes the copy engines for a job whose ids form few long runs
(mean run >= ``dma_min_run_bytes``, 4 MiB by default) and the kernel for the rest.
On CPU the copies run on a background thread. Either way the ``submit_*`` calls return at
once and ``get_finished()`` reports finished job ids (failed ones with ``success=False``).

torch is an optional extra: ``pip install 'kvevents[torch]'`` (or ``pip install
torch==2.13.0`` for the CPU build).
"""

from __future__ import annotations

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "manager.transfer needs torch, an optional extra: pip install 'kvevents[torch]' "
        "(or pip install torch==2.13.0 for the CPU build)"
    ) from exc

from typing import Any, Iterable

import numpy as np

from .transfer_base import (
    LOAD,
    STORE,
    BlockIdError,
    DuplicateJobError,
    NumpyTransferWorker,
    ShapeMismatchError,
    LayeredCache,
    ThreadedTransferWorker,
    TransferError,
    TransferResult,
    TransferWorker,
    WorkerClosedError,
    _Job,
    check_host_layout,
    as_layers,
    layer_pairs,
    contiguous_runs,
    copy_runs,
    run_count,
    expand_block_ids,
)

__all__ = [
    "LOAD",
    "STORE",
    "BlockIdError",
    "DuplicateJobError",
    "NumpyTransferWorker",
    "ShapeMismatchError",
    "COPY_MODES",
    "TorchTransferWorker",
    "TransferError",
    "TransferResult",
    "TransferWorker",
    "WorkerClosedError",
    "expand_block_ids",
]


def _make_host_buffer(device_cache: "torch.Tensor", host_blocks: "int | torch.Tensor") -> "torch.Tensor":
    pin = device_cache.device.type == "cuda"
    if isinstance(host_blocks, torch.Tensor):
        host = host_blocks
        if host.device.type != "cpu":
            raise ShapeMismatchError(f"host buffer must live on the CPU, got device {host.device}")
        check_host_layout(device_cache.shape, device_cache.dtype, host.shape, host.dtype)
        if not host.is_contiguous():
            raise ShapeMismatchError("host buffer must be contiguous")
        if pin and not host.is_pinned():
            host = host.pin_memory()
        return host
    if isinstance(host_blocks, bool) or not isinstance(host_blocks, (int, np.integer)) or host_blocks < 1:
        raise ValueError(f"host_blocks must be a positive int or a CPU tensor, got {host_blocks!r}")
    return torch.zeros((int(host_blocks), *device_cache.shape[1:]), dtype=device_cache.dtype, pin_memory=pin)


def _check_device_cache(device_cache: Any) -> None:
    if not isinstance(device_cache, torch.Tensor) or device_cache.dim() < 1:
        raise ShapeMismatchError("device_cache must be a torch tensor shaped [num_blocks, ...]")
    if not device_cache.is_contiguous():
        raise ShapeMismatchError("device_cache must be contiguous")


def _byte_rows(t: "torch.Tensor") -> np.ndarray:
    return t.view(t.shape[0], -1).view(torch.uint8).numpy()


class _CpuTorchWorker(LayeredCache, ThreadedTransferWorker):
    def __init__(self, layers: list[tuple["torch.Tensor", "torch.Tensor"]]) -> None:
        super().__init__(layers[0][0].shape[0], layers[0][1].shape[0], name="kv-transfer-torch")
        self._take_layers(layers)
        self._bytes = [(_byte_rows(d), _byte_rows(h)) for d, h in layers]

    def _copy(self, job: _Job) -> None:
        # byte views of both buffers: one memcpy per contiguous run of ids (index_select +
        # index_copy_ measured 5-10x slower on CPU, float16 worst)
        for dev, host in self._bytes:
            if job.direction == STORE:
                copy_runs(host, dev, job.src, job.dst)
            else:
                copy_runs(dev, host, job.src, job.dst)


COPY_MODES = ("auto", "kernel", "dma")

_TYPESTR = {torch.int64: "<i8", torch.int32: "<i4", torch.int16: "<i2", torch.uint8: "|u1"}


def block_rows(t: "torch.Tensor") -> "torch.Tensor":
    """``t`` (contiguous, ``[num_blocks, ...]``) as ``[num_blocks, words]`` of the widest integer
    type that divides a block's bytes: index kernels then move 8 bytes per element, whatever
    the cache's dtype (float16 rows seen as int64 words)."""
    rows = t.reshape(t.shape[0], -1)
    if rows.shape[1] == 0:
        return rows.view(torch.uint8) if rows.element_size() == 1 else rows
    raw = rows.view(torch.uint8)
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = torch.empty((), dtype=dtype).element_size()
        if raw.shape[1] % size == 0 and t.data_ptr() % size == 0:
            return raw.view(dtype)
    return raw


def gather_copy(dst_rows: "torch.Tensor", src_rows: "torch.Tensor", src_ids: "torch.Tensor",
                dst_ids: "torch.Tensor") -> None:
    """``dst_rows[dst_ids] = src_rows[src_ids]``: a gather kernel, then a scatter kernel."""
    dst_rows.index_copy_(0, dst_ids, src_rows.index_select(0, src_ids))


class _HostAsDevice:
    """Pinned host memory described as CUDA memory (``__cuda_array_interface__``).

    With unified virtual addressing (every 64-bit CUDA platform) a pinned host allocation has
    the same address on the host and the GPU, so ``torch.as_tensor(self, device=...)`` yields a
    CUDA tensor whose kernels read and write the host buffer over the link."""

    def __init__(self, rows: "torch.Tensor") -> None:
        self.__cuda_array_interface__ = {
            "shape": tuple(rows.shape),
            "typestr": _TYPESTR[rows.dtype],
            "data": (rows.data_ptr(), False),
            "strides": None,
            "version": 2,
        }


def host_rows_on_device(host_rows: "torch.Tensor", device: "torch.device") -> "torch.Tensor | None":
    """A CUDA tensor aliasing the pinned ``host_rows``, or None where this CUDA setup offers none."""
    if host_rows.dtype not in _TYPESTR or not host_rows.is_pinned():
        return None
    try:
        view = torch.as_tensor(_HostAsDevice(host_rows), device=device)
    except Exception:
        return None
    if view.device != device or view.data_ptr() != host_rows.data_ptr() or view.shape != host_rows.shape:
        return None
    return view


class _CudaTorchWorker(LayeredCache, TransferWorker):
    def __init__(self, layers: list[tuple["torch.Tensor", "torch.Tensor"]], *, copy_mode: str = "auto",
                 dma_min_run_bytes: int = 4 << 20) -> None:
        super().__init__(layers[0][0].shape[0], layers[0][1].shape[0])
        self._take_layers(layers)
        dev = layers[0][0].device
        self._device = dev
        self._streams = {LOAD: torch.cuda.Stream(device=dev), STORE: torch.cuda.Stream(device=dev)}
        self._inflight: dict[int, tuple[Any, _Job]] = {}
        self._results: list[TransferResult] = []
        self._dev_rows = [block_rows(d) for d, _ in layers]
        host_on_dev = [host_rows_on_device(block_rows(h), dev) for _, h in layers]
        self._host_on_dev = None if any(v is None for v in host_on_dev) else host_on_dev
        if copy_mode == "kernel" and self._host_on_dev is None:
            raise TransferError(
                "copy_mode='kernel' needs the pinned host buffer to be addressable from the GPU "
                "(unified addressing); this CUDA setup offers none: use copy_mode='dma'"
            )
        self.copy_mode = copy_mode if self._host_on_dev is not None else "dma"
        self.dma_min_run_bytes = int(dma_min_run_bytes)
        self.kernel_jobs = 0
        self.dma_jobs = 0

    def stats(self) -> dict[str, int]:
        out = super().stats()
        out["kernel_jobs"] = self.kernel_jobs
        out["dma_jobs"] = self.dma_jobs
        return out

    def _use_kernel(self, job: _Job) -> bool:
        if self.copy_mode == "dma" or len(job.src) < 2:
            return False
        runs = run_count(job.src, job.dst)
        if runs == 1:
            return False
        if self.copy_mode == "kernel":
            return True
        # the copy engines take one copy per run per layer: their mean size decides
        return len(job.src) * self.bytes_per_block < self.dma_min_run_bytes * runs * len(self.layers)

    def _enqueue(self, job: _Job) -> None:
        if job.job_id in self._inflight:
            raise DuplicateJobError(f"job id {job.job_id} is already in flight")
        self.jobs_submitted += 1
        stream = self._streams[job.direction]
        try:
            store = job.direction == STORE
            if store:
                # copy what the model wrote: order after the work already on the current stream
                stream.wait_stream(torch.cuda.current_stream(self._device))
            with torch.cuda.stream(stream):
                if self._use_kernel(job):
                    # the ids travel with the job, once for every layer: pinned, copied on this
                    # stream (torch's host allocator keeps the pinned block until the copy ran)
                    n = len(job.src)
                    ids = torch.from_numpy(np.concatenate((job.src, job.dst))).pin_memory()
                    ids = ids.to(self._device, non_blocking=True)
                    for dev_rows, host_rows in zip(self._dev_rows, self._host_on_dev):
                        if store:
                            gather_copy(host_rows, dev_rows, ids[:n], ids[n:])
                        else:
                            gather_copy(dev_rows, host_rows, ids[:n], ids[n:])
                    self.kernel_jobs += 1
                else:
                    for s, d, n in contiguous_runs(job.src, job.dst):
                        for dev, host in self.layers:
                            if store:
                                host[d : d + n].copy_(dev[s : s + n], non_blocking=True)
                            else:
                                dev[d : d + n].copy_(host[s : s + n], non_blocking=True)
                    self.dma_jobs += 1
                event = torch.cuda.Event()
                event.record(stream)
        except Exception as exc:
            result = TransferResult(job.job_id, job.direction, False, len(job.src), f"{type(exc).__name__}: {exc}")
            self._results.append(result)
            self._count(result)
            return
        self._inflight[job.job_id] = (event, job)

    def _poll(self, block: bool, wanted: set[int] | None = None) -> None:
        for job_id in list(self._inflight):
            if wanted is not None and job_id not in wanted:
                continue
            event, job = self._inflight[job_id]
            try:
                if block:
                    event.synchronize()
                elif not event.query():
                    continue
                result = TransferResult(job_id, job.direction, True, len(job.src))
            except Exception as exc:
                result = TransferResult(job_id, job.direction, False, len(job.src), f"{type(exc).__name__}: {exc}")
            del self._inflight[job_id]
            self._results.append(result)
            self._count(result)

    def get_finished(self) -> list[TransferResult]:
        self._poll(block=False)
        out, self._results = self._results, []
        return self._report(out) if self.job_observers else out

    def wait(self, job_ids: Iterable[int] | None = None, timeout: float | None = None) -> bool:
        # CUDA copies always complete; an event synchronize is the wait (timeout not needed).
        self._poll(block=True, wanted=None if job_ids is None else set(job_ids))
        return True

    def in_flight(self) -> set[int]:
        return set(self._inflight)

    def shutdown(self, timeout: float | None = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._poll(block=True)


def TorchTransferWorker(device_cache: "torch.Tensor", host_blocks: "int | torch.Tensor", *,
                        copy_mode: str = "auto", dma_min_run_bytes: int = 4 << 20) -> TransferWorker:
    """A transfer worker for ``device_cache``: CUDA streams on a GPU, a thread on the CPU.

    ``copy_mode`` (CUDA only): ``"auto"``, ``"kernel"`` or ``"dma"``, see the module's doc."""
    if copy_mode not in COPY_MODES:
        raise ValueError(f"copy_mode must be one of {', '.join(COPY_MODES)}; got {copy_mode!r}")
    if isinstance(dma_min_run_bytes, bool) or not isinstance(dma_min_run_bytes, int) or dma_min_run_bytes < 0:
        raise ValueError(f"dma_min_run_bytes must be an int >= 0, got {dma_min_run_bytes!r}")
    for d in as_layers(device_cache):
        _check_device_cache(d)
    layers = layer_pairs(device_cache, host_blocks, _make_host_buffer)
    devices = {d.device for d, _ in layers}
    if len(devices) != 1:
        raise ShapeMismatchError(f"layers on different devices: {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type == "cuda":
        return _CudaTorchWorker(layers, copy_mode=copy_mode, dma_min_run_bytes=dma_min_run_bytes)
    if device.type != "cpu":
        raise TransferError(f"unsupported device {device} (cuda or cpu)")
    return _CpuTorchWorker(layers)
