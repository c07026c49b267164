"""The torch transfer worker: copies KV blocks between a device cache and a host buffer.

``TorchTransferWorker(device_cache, host_blocks)``:

* ``device_cache`` is a tensor ``[num_blocks, ...]`` (one row per device block, whatever the
  rest of the layout);
* ``host_blocks`` is either a number of host rows to allocate or a ready host tensor of the
  same block shape and dtype. The host buffer is pinned when the device is CUDA.

On CUDA each direction has its own stream: a store first waits for the work already queued
on the current stream (so it copies what the model wrote), then issues non-blocking copies
of contiguous runs; an event recorded after the job tells ``get_finished`` when it is done.
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
    ThreadedTransferWorker,
    TransferError,
    TransferResult,
    TransferWorker,
    WorkerClosedError,
    _Job,
    check_host_layout,
    contiguous_runs,
    copy_runs,
    expand_block_ids,
)

__all__ = [
    "LOAD",
    "STORE",
    "BlockIdError",
    "DuplicateJobError",
    "NumpyTransferWorker",
    "ShapeMismatchError",
    "TorchTransferWorker",
    "TransferError",
    "TransferResult",
    "TransferWorker",
    "WorkerClosedError",
    "create_transfer_worker",
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


class _CpuTorchWorker(ThreadedTransferWorker):
    def __init__(self, device_cache: "torch.Tensor", host: "torch.Tensor") -> None:
        self.device_cache = device_cache
        self.host_cache = host
        super().__init__(device_cache.shape[0], host.shape[0], name="kv-transfer-torch")
        self._dev_bytes = device_cache.view(device_cache.shape[0], -1).view(torch.uint8).numpy()
        self._host_bytes = host.view(host.shape[0], -1).view(torch.uint8).numpy()
        self.bytes_per_block = device_cache[0].numel() * device_cache.element_size() if device_cache.shape[0] else 0

    def _copy(self, job: _Job) -> None:
        # byte views of both buffers: one memcpy per contiguous run of ids (index_select +
        # index_copy_ measured 5-10x slower on CPU, float16 worst)
        if job.direction == STORE:
            copy_runs(self._host_bytes, self._dev_bytes, job.src, job.dst)
        else:
            copy_runs(self._dev_bytes, self._host_bytes, job.src, job.dst)


class _CudaTorchWorker(TransferWorker):
    def __init__(self, device_cache: "torch.Tensor", host: "torch.Tensor") -> None:
        super().__init__(device_cache.shape[0], host.shape[0])
        self.device_cache = device_cache
        self.host_cache = host
        self.bytes_per_block = device_cache[0].numel() * device_cache.element_size() if device_cache.shape[0] else 0
        dev = device_cache.device
        self._streams = {LOAD: torch.cuda.Stream(device=dev), STORE: torch.cuda.Stream(device=dev)}
        self._inflight: dict[int, tuple[Any, _Job]] = {}
        self._results: list[TransferResult] = []

    def _enqueue(self, job: _Job) -> None:
        if job.job_id in self._inflight:
            raise DuplicateJobError(f"job id {job.job_id} is already in flight")
        self.jobs_submitted += 1
        stream = self._streams[job.direction]
        try:
            if job.direction == STORE:
                # copy what the model wrote: order after the work already on the current stream
                stream.wait_stream(torch.cuda.current_stream(self.device_cache.device))
                src, dst = self.device_cache, self.host_cache
            else:
                src, dst = self.host_cache, self.device_cache
            with torch.cuda.stream(stream):
                for s, d, n in contiguous_runs(job.src, job.dst):
                    dst[d : d + n].copy_(src[s : s + n], non_blocking=True)
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
        return out

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


def TorchTransferWorker(device_cache: "torch.Tensor", host_blocks: "int | torch.Tensor") -> TransferWorker:
    """A transfer worker for ``device_cache``: CUDA streams on a GPU, a thread on the CPU."""
    _check_device_cache(device_cache)
    host = _make_host_buffer(device_cache, host_blocks)
    if device_cache.device.type == "cuda":
        return _CudaTorchWorker(device_cache, host)
    if device_cache.device.type != "cpu":
        raise TransferError(f"unsupported device {device_cache.device} (cuda or cpu)")
    return _CpuTorchWorker(device_cache, host)


def create_transfer_worker(device_cache: Any, host_blocks: Any) -> TransferWorker:
    """A torch worker for a tensor, a numpy worker for a numpy array."""
    if isinstance(device_cache, np.ndarray):
        return NumpyTransferWorker(device_cache, host_blocks)
    return TorchTransferWorker(device_cache, host_blocks)
