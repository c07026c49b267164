"""Tiers written for vLLM's ``SecondaryTierManager`` (e.g. ``vllm-kvblockd``) in our tiering manager.

A tier config of type ``"vllm"`` names the vLLM-written class, by module and class::

    {"type": "vllm", "module_path": "vllm_kvblockd.tier_manager", "class_name": "KvblockdTierManager",
     "endpoint": "kvblockd://10.0.0.9:9440"}

or by a name registered in vLLM's own ``SecondaryTierFactory`` (``{"type": "vllm", "vllm_type":
"kvblockd"}``); the other entries are the tier's own keyword arguments. :class:`VllmTier` is one
of our :class:`~manager.tiering.SecondaryTierManager`\\ s around it:

- the vLLM tier is built with vLLM's signature ``(offloading_spec, primary_kv_view, tier_type,
  **config)`` once our tiering manager binds the host buffer (``primary_kv_view`` is that buffer
  as ``[num_blocks, block_bytes]``);
- our jobs become vLLM ``TransferJob``\\ s (``chunk_ids``, also as ``block_ids``, the name of
  vLLM <= 0.25 that vllm-kvblockd 0.1.0 reads; vLLM request contexts), vLLM
  ``JobResult``\\ s ours (a failed load job's ``successful_keys`` with it: our manager keeps
  those blocks and frees the others);
- ``on_schedule_end`` is called with a ``ScheduleEndContext`` (vLLM's hook takes one),
  ``drain_jobs(timeout)`` calls vLLM's argument-less ``drain_jobs()``;
- lookups and policies are mapped by meaning (``HIT_PENDING`` is our ``RETRY``), events become
  ours in this tier's medium (``"STORAGE"`` unless the vLLM tier names another).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import numpy as np
from vllm.v1.kv_offload.base import LookupResult as VLookup
from vllm.v1.kv_offload.base import OffloadPolicy as VPolicy
from vllm.v1.kv_offload.base import ReqContext as VReqContext
from vllm.v1.kv_offload.base import ScheduleEndContext
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager as VllmSecondaryTier
from vllm.v1.kv_offload.tiering.base import TransferJob

from kvevents.errors import ConfigError
from manager.base import BlockIO, LookupResult, OffloadingEvent, OffloadPolicy, ReqContext, RequestOffloadingContext
from manager.tiering import SecondaryTierFactory, SecondaryTierManager
from manager.tiering.base import JobMetadata, JobResult

__all__ = ["VllmTier", "register_vllm_tiers"]

_LOOKUP = {VLookup.HIT: LookupResult.HIT, VLookup.MISS: LookupResult.MISS, VLookup.RETRY: LookupResult.RETRY,
           VLookup.HIT_PENDING: LookupResult.RETRY}
_POLICY = {VPolicy.CHUNK_LEVEL: OffloadPolicy.BLOCK_LEVEL, VPolicy.REQUEST_LEVEL: OffloadPolicy.REQUEST_LEVEL}
_NO_STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


class _TransferJob(TransferJob):
    """vLLM's job, also under its earlier field name ``block_ids`` (vLLM <= 0.25, which tiers
    such as vllm-kvblockd 0.1.0 were written against; 0.32 calls it ``chunk_ids``)."""

    @property
    def block_ids(self) -> np.ndarray:
        return self.chunk_ids


def _vllm_class(module_path: str | None, class_name: str | None, vllm_type: str | None) -> type:
    if vllm_type is not None:
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory as VFactory

        registry = getattr(VFactory, "_registry", {})
        if vllm_type not in registry:
            raise ConfigError(f"vllm tier: vLLM's SecondaryTierFactory knows no tier type {vllm_type!r} "
                              f"(known: {', '.join(sorted(registry))})")
        cls = registry[vllm_type]()
    else:
        if not module_path or not class_name:
            raise ConfigError("vllm tier: give 'module_path' and 'class_name' (or 'vllm_type')")
        try:
            cls = getattr(importlib.import_module(module_path), class_name)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"vllm tier: cannot load {module_path}.{class_name}: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, VllmSecondaryTier)):
        raise ConfigError(f"vllm tier: {cls!r} is not a vLLM SecondaryTierManager")
    return cls


class VllmTier(SecondaryTierManager):
    """Our tier role over one vLLM-written tier (see the module's doc)."""

    def __init__(self, tier_type: str = "vllm", *, module_path: str | None = None, class_name: str | None = None,
                 vllm_type: str | None = None, offloading_spec: Any = None, block_io: BlockIO | None = None,
                 medium: str | None = None, enable_events: bool = True, tier: VllmSecondaryTier | None = None,
                 **tier_config: Any) -> None:
        # ``tier``: a vLLM tier built already (vLLM's own TieringOffloadingManager signature)
        self.vllm_class = type(tier) if tier is not None else _vllm_class(module_path, class_name, vllm_type)
        vmedium = getattr(self.vllm_class, "medium", None)
        super().__init__(tier_type, medium=medium or (vmedium.value if vmedium is not None else "STORAGE"),
                         enable_events=enable_events)
        self.vllm_type = vllm_type or tier_type
        self.offloading_spec = offloading_spec
        self.tier_config = tier_config
        self.inner: VllmSecondaryTier | None = tier
        self._contexts: dict[str, VReqContext] = {}
        self._anonymous = VReqContext(req_id="")
        self.partial_results = 0  # failed vLLM results that name successful_keys
        self.block_io = block_io

    # -- construction once the host buffer is known ------------------------------------------
    @property
    def block_io(self) -> BlockIO | None:
        return self._block_io

    @block_io.setter
    def block_io(self, io: BlockIO | None) -> None:
        self._block_io = io
        if io is not None and self.inner is None:
            self.inner = self.vllm_class(self.offloading_spec, primary_view(io), self.vllm_type, **self.tier_config)

    def _tier(self) -> VllmSecondaryTier:
        if self.inner is None:
            raise ConfigError(f"vllm tier {self.vllm_type!r} used before the host buffer was bound")
        return self.inner

    def _ctx(self, ctx: ReqContext | VReqContext | None) -> VReqContext:
        """vLLM's context for the request: the one vLLM made (handed through our adapter), or
        one made from ours (when our own connector drives the tier)."""
        if ctx is None:
            return self._anonymous
        if isinstance(ctx, VReqContext):
            return ctx
        v = self._contexts.get(ctx.req_id)
        if v is None:
            v = VReqContext(req_id=ctx.req_id, kv_transfer_params=ctx.kv_transfer_params)
        return v

    # -- the role ------------------------------------------------------------------------------
    def lookup(self, key: bytes, req_context: ReqContext | None = None) -> LookupResult:
        if self.inner is None:
            return LookupResult.MISS
        return _LOOKUP[self.inner.lookup(key, self._ctx(req_context))]

    def _job(self, job: JobMetadata) -> TransferJob:
        return _TransferJob(job_id=job.job_id, keys=list(job.keys), chunk_ids=np.asarray(job.block_ids, dtype=np.int64),
                           is_promotion=job.is_promotion, req_context=self._ctx(job.req_context))

    def submit_store(self, job: JobMetadata) -> None:
        self._tier().submit_store(self._job(job))

    def submit_load(self, job: JobMetadata) -> None:
        self._tier().submit_load(self._job(job))

    def get_finished_jobs(self) -> list[JobResult]:
        if self.inner is None:
            return []
        out = []
        for r in self.inner.get_finished_jobs():
            ok = bool(r.success)
            loaded = None if ok else getattr(r, "successful_keys", None)
            if loaded:
                self.partial_results += 1
                loaded = tuple(loaded)
            out.append(JobResult(r.job_id, ok, loaded or None))
        self._collect_events()
        return out

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        v = self._ctx(req_context)
        if v is not req_context:  # one of ours: the vLLM context made for it serves its later calls
            self._contexts[req_context.req_id] = v
        if self.inner is None:
            return RequestOffloadingContext()
        return RequestOffloadingContext(_POLICY[self.inner.on_new_request(v).policy])

    def on_request_finished(self, req_context: ReqContext) -> None:
        v = self._contexts.pop(req_context.req_id, None)
        if self.inner is not None:
            self.inner.on_request_finished(v or self._ctx(req_context))

    def on_schedule_end(self, context: Any = None) -> None:
        if self.inner is not None:
            self.inner.on_schedule_end(context if isinstance(context, ScheduleEndContext) else _NO_STEP)
            self._collect_events()

    def touch(self, keys: Sequence[bytes], req_context: ReqContext | None = None) -> None:
        if self.inner is not None:
            self.inner.touch(list(keys), self._ctx(req_context))

    def has_pending_work(self) -> bool:
        return self.inner is not None and bool(self.inner.has_pending_work())

    def drain_jobs(self, timeout: float | None = None) -> bool:
        if self.inner is not None:
            self.inner.drain_jobs()  # vLLM's takes no timeout: it waits for every job
        return True

    def shutdown(self) -> None:
        if self.inner is not None:
            self.inner.shutdown()

    def _collect_events(self) -> None:
        for ev in self.inner.take_events() if self.inner is not None else ():
            self._emit(list(ev.keys), bool(ev.removed))

    def take_events(self) -> list[OffloadingEvent]:
        self._collect_events()
        return super().take_events()


def primary_view(io: BlockIO) -> memoryview:
    """The host buffer as vLLM tiers take it: a writable ``[num_blocks, block_bytes]`` byte view."""
    array = getattr(io, "array", None)
    if array is None and hasattr(io, "contiguous"):
        array = io.contiguous()
    if not isinstance(array, np.ndarray) or not array.flags.c_contiguous:
        raise ConfigError(
            "a vLLM-written tier needs the host buffer as one array: this engine's KV cache is split "
            "over several tensors (use our own tiers, e.g. 'fs', for it)")
    return memoryview(array.reshape(array.shape[0], -1).view(np.uint8))


def register_vllm_tiers() -> None:
    """Make tier type ``"vllm"`` known to our SecondaryTierFactory (idempotent)."""
    if "vllm" not in SecondaryTierFactory.supported_types():
        SecondaryTierFactory.register_tier("vllm", __name__, "VllmTier")
