"""Our transfer workers as one vLLM ``OffloadingWorker`` (the worker side of our spec).

vLLM hands the worker its KV cache as ``CanonicalKVCaches``: a list of int8 tensors shaped
``[num_blocks, page_bytes]`` and, per KV-cache group, which tensors its layers use. For each
tensor we run one of our transfer workers (:func:`manager.spec.create_transfer_worker`: a numpy
thread on vLLM's CPU backend, CUDA streams on a GPU) between that tensor and its region of the
shared host buffer (:mod:`kvevents_vllm.host`). A vLLM job (``GPULoadStoreSpec`` <->
``CPULoadStoreSpec``) becomes one job on each tensor's worker; it is reported finished, as a
vLLM ``TransferResult``, once every one of them is.

Block mapping (vLLM's semantics): per group ``g`` the GPU spec lists ``group_sizes[g]`` device
blocks starting at logical block ``block_indices[g]`` of the request; the CPU spec lists the
offloaded blocks (chunks of ``blocks_per_chunk`` device blocks) covering them, the first one
entered ``block_indices[g] % blocks_per_chunk`` rows in.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
from vllm.v1.kv_offload.base import CanonicalKVCaches, GPULoadStoreSpec, LoadStoreSpec, OffloadingWorker
from vllm.v1.kv_offload.base import TransferResult as VllmTransferResult

from manager.spec import create_transfer_worker
from manager.transfer_base import TransferError, TransferWorker, expand_block_ids

from .host import HostRegions, create_regions

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Pending:
    started: float
    nbytes: int
    waiting: set[int] = field(default_factory=set)  # KV-cache groups still copying
    success: bool = True


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVEventsOffloadingWorker(OffloadingWorker):
    """vLLM's worker role over one of our transfer workers per KV tensor."""

    def __init__(self, kv_caches: CanonicalKVCaches, *, blocks_per_chunk: int, num_chunks: int,
                 engine_id: str, rank: int, shared: bool = True) -> None:
        self.k = int(blocks_per_chunk)
        self.num_chunks = int(num_chunks)
        tensors = [t.tensor for t in kv_caches.tensors]
        pages = [int(t.shape[1]) for t in tensors]
        self.regions: HostRegions = create_regions(engine_id, rank, self.num_chunks, self.k, pages, shared=shared)
        #: per group, the tensor indexes its layers use
        self.group_tensors = [sorted({ref.tensor_idx for ref in refs}) for refs in kv_caches.group_data_refs]
        #: per group, the bytes one of its device blocks spans over its tensors
        self.group_bytes = [sum(pages[t] for t in ts) for ts in self.group_tensors]
        self.workers: list[TransferWorker | None] = []  # per group (None: a group with no tensor)
        self._registered: _CudaHostRegistration | None = None
        try:
            if any(t.device.type == "cuda" for t in tensors):
                self._registered = _CudaHostRegistration(self.regions.whole())
            for ts in self.group_tensors:
                if not ts:
                    self.workers.append(None)
                elif tensors[ts[0]].device.type == "cpu":
                    self.workers.append(create_transfer_worker(
                        [tensors[t].numpy() for t in ts], [self.regions.arrays[t] for t in ts]))
                else:
                    self.workers.append(create_transfer_worker(
                        [tensors[t] for t in ts], [self._registered.view(self.regions.arrays[t]) for t in ts]))
        except Exception:
            self.shutdown()
            raise
        self._pending: dict[int, _Pending] = {}
        self._done: list[VllmTransferResult] = []
        self.jobs_rejected = 0  # jobs whose specs did not fit (submit_* returned False)

    # -- vLLM's role ---------------------------------------------------------------------
    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._submit(job_id, src_spec, dst_spec, store=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._submit(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> list[VllmTransferResult]:
        for g, w in enumerate(self.workers):
            if w is not None:
                for r in w.get_finished():
                    self._finish_part(r.job_id, g, r.success, r.error)
        out, self._done = self._done, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        for w in self.workers:
            if w is not None:
                w.wait(job_ids)

    def shutdown(self) -> None:
        for w in self.workers:
            if w is not None:
                w.shutdown()
        if self._registered is not None:
            self._registered.release()  # after the workers: no copy is in flight
            self._registered = None
        self.regions.remove()

    # -- the mapping -------------------------------------------------------------------------
    def rows_per_group(self, gpu: GPULoadStoreSpec, host: LoadStoreSpec) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """``{group: (device block ids, host rows)}`` for one job (see the module's doc)."""
        dev_ids = np.asarray(gpu.block_ids, dtype=np.int64)
        chunks = np.asarray(host.block_ids, dtype=np.int64)
        sizes = list(gpu.group_sizes) if gpu.group_sizes is not None else [len(dev_ids)]
        starts = list(gpu.block_indices) if gpu.block_indices is not None else [0] * len(sizes)
        if len(sizes) != len(self.group_tensors):
            raise TransferError(f"job has {len(sizes)} KV groups, the worker {len(self.group_tensors)}")
        out: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        d_off = c_off = 0
        for g, (n, start) in enumerate(zip(sizes, starts)):
            if n == 0:
                continue
            skip = int(start) % self.k
            n_chunks = _cdiv(n + skip, self.k)
            rows = expand_block_ids(chunks[c_off:c_off + n_chunks], self.k, skip=skip)[:n]
            dev = dev_ids[d_off:d_off + n]
            if len(rows) != n or len(dev) != n:
                raise TransferError(f"group {g}: {len(dev)} device blocks for {len(rows)} host rows")
            if self.workers[g] is not None:
                out[g] = (dev, rows)
            d_off += n
            c_off += n_chunks
        if d_off != len(dev_ids) or c_off != len(chunks):
            raise TransferError(f"job covers {d_off}/{len(dev_ids)} device blocks, {c_off}/{len(chunks)} chunks")
        return out

    def _submit(self, job_id: int, gpu: GPULoadStoreSpec, host: LoadStoreSpec, *, store: bool) -> bool:
        try:
            parts = self.rows_per_group(gpu, host)
        except (TransferError, ValueError, TypeError) as exc:
            self.jobs_rejected += 1
            log.error("kvevents_vllm: job %s rejected: %s", job_id, exc)
            return False
        pending = _Pending(time.perf_counter(), sum(len(d) * self.group_bytes[g] for g, (d, _) in parts.items()))
        self._pending[job_id] = pending
        if not parts:
            self._finish(job_id, pending)
            return True
        pending.waiting.update(parts)
        for g, (dev, rows) in parts.items():
            try:
                if store:
                    self.workers[g].submit_store(job_id, dev, rows)
                else:
                    self.workers[g].submit_load(job_id, rows, dev)
            except TransferError as exc:
                self._finish_part(job_id, g, False, str(exc))
        return True

    def _finish_part(self, job_id: int, group: int, success: bool, error: str | None) -> None:
        pending = self._pending.get(job_id)
        if pending is None:
            return
        if not success:
            pending.success = False
            log.error("kvevents_vllm: job %s failed on KV-cache group %d: %s", job_id, group, error)
        pending.waiting.discard(group)
        if not pending.waiting:
            self._finish(job_id, pending)

    def _finish(self, job_id: int, pending: _Pending) -> None:
        del self._pending[job_id]
        self._done.append(VllmTransferResult(job_id=job_id, success=pending.success, transfer_size=pending.nbytes,
                                             transfer_time=time.perf_counter() - pending.started))


class _CudaHostRegistration:
    """The shared host buffer registered with CUDA in place (page-locked and addressable from
    the GPU), so our CUDA workers copy straight into the pages the scheduler side maps; a
    pinned copy would never be seen there. Registered once as a whole; released at shutdown."""

    def __init__(self, whole: np.ndarray) -> None:
        import torch

        self._cudart = torch.cuda.cudart()
        self._base = torch.from_numpy(whole)
        self.ptr = self._base.data_ptr() if whole.size else 0
        if self.ptr:
            rc = int(self._cudart.cudaHostRegister(self.ptr, whole.size, 0))
            if rc != 0:
                raise TransferError(f"cudaHostRegister of the {whole.size}-byte shared host buffer failed (CUDA error {rc})")

    def view(self, region: np.ndarray):
        """A torch view of one region of the registered buffer (torch sees it as pinned)."""
        import torch

        t = torch.from_numpy(region)
        if t.numel() and not t.is_pinned():
            raise TransferError("the registered host buffer is not seen as pinned by torch")
        return t

    def release(self) -> None:
        if self.ptr:
            rc = int(self._cudart.cudaHostUnregister(self.ptr))
            self.ptr = 0
            if rc != 0:
                log.error("kvevents_vllm: cudaHostUnregister of the shared host buffer failed (CUDA error %d)", rc)
