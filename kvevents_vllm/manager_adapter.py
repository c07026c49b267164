"""Our offload manager behind vLLM's ``OffloadingManager`` role (the scheduler side of our spec).

What changes at the boundary, and nothing else (our manager's behaviour is untouched):

- request contexts: vLLM's ``ReqContext`` -> ours (made once per request, kept in vLLM's
  per-request state);
- ``LookupResult`` / ``OffloadPolicy`` members mapped by meaning (ours ``BLOCK_LEVEL`` is vLLM's
  ``CHUNK_LEVEL``; our ``RETRY`` for a block being stored or promoted into the CPU tier is vLLM's
  ``HIT_PENDING``, any other ``RETRY`` stays ``RETRY``);
- load/store specs: our ``LoadStoreSpec`` (medium + int64 ids) -> vLLM's ``CPULoadStoreSpec``;
- events: our ``OffloadingEvent(keys, medium: str, removed)`` -> vLLM's, with ``Medium`` (CPU for
  the primary tier, STORAGE for a secondary tier), ``Locality.LOCAL`` and ``ownership`` (None for
  the primary tier, the tier's type for a secondary tier);
- ``get_load_source``: HOST for a block the CPU tier held, DISK for one promoted from a
  secondary tier (the tiering manager says which keys it promotes);
- ``on_schedule_end(context)``: vLLM's ``ScheduleEndContext`` passed on (ours accepts and
  ignores it); ``get_stats``: None (our counters are in :meth:`stats`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from typing import Any

from vllm.v1.kv_offload.base import LookupResult as VLookup
from vllm.v1.kv_offload.base import Locality, Medium
from vllm.v1.kv_offload.base import OffloadingEvent as VEvent
from vllm.v1.kv_offload.base import OffloadingManager as VManager
from vllm.v1.kv_offload.base import OffloadPolicy as VPolicy
from vllm.v1.kv_offload.base import PrepareStoreOutput as VPrepareStoreOutput
from vllm.v1.kv_offload.base import ReqContext as VReqContext
from vllm.v1.kv_offload.base import RequestOffloadingContext as VRequestContext
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from manager.base import LookupResult, OffloadingManager, OffloadPolicy, ReqContext
from manager.tiering import TieringOffloadingManager

_LOOKUP = {LookupResult.HIT: VLookup.HIT, LookupResult.MISS: VLookup.MISS, LookupResult.RETRY: VLookup.RETRY}
_POLICY = {OffloadPolicy.BLOCK_LEVEL: VPolicy.CHUNK_LEVEL, OffloadPolicy.REQUEST_LEVEL: VPolicy.REQUEST_LEVEL}


class KVEventsManagerAdapter(VManager):
    """vLLM's manager role over ``inner`` (a CPU manager or a tiering manager).

    ``bind``: called before calls that may move bytes through secondary tiers until it returns
    True (the spec binds the shared host buffer once the worker side has made it)."""

    def __init__(self, inner: OffloadingManager, *, bind: Callable[[], bool] | None = None) -> None:
        self.inner = inner
        self._bind = bind
        self._bound = bind is None
        self._tiering = inner if isinstance(inner, TieringOffloadingManager) else None
        self._primary: Any = self._tiering.primary if self._tiering is not None else inner
        #: vLLM's managers name their medium (Medium.CPU for a CPU tier and the tiers behind it)
        self.medium = Medium.CPU
        # our medium string -> (vLLM medium, ownership)
        self._media: dict[str, tuple[Medium, str | None]] = {inner.medium: (Medium.CPU, None)}
        for tier in (self._tiering.tiers if self._tiering else ()):
            self._media.setdefault(tier.medium, (Medium.STORAGE, getattr(tier, "tier_type", None)))
        self._promoted: dict[bytes, CacheHitSource] = {}
        self.unknown_media = 0  # events in a medium no tier declared (sent as STORAGE)

    # -- contexts --------------------------------------------------------------------------
    @staticmethod
    def ours(req_context: VReqContext) -> ReqContext:
        ctx = req_context.get_state(ReqContext)
        if ctx is None:
            ctx = ReqContext(req_context.req_id, req_context.kv_transfer_params)
            req_context.set_state(ctx)
        return ctx

    def _ensure_bound(self) -> None:
        if not self._bound and self._bind is not None:
            self._bound = self._bind()

    # -- lookups and loads -----------------------------------------------------------------
    def lookup(self, key: Any, req_context: VReqContext) -> VLookup:
        result = self.inner.lookup(key, self.ours(req_context))
        if result is not LookupResult.RETRY:
            return _LOOKUP[result]
        # ours answers RETRY for "ask again later"; vLLM tells apart a block that is found but
        # not readable yet (HIT_PENDING: being stored into, or promoted into, the CPU tier)
        if self._tiering is not None and self._tiering.promoting_from(key) is not None:
            self._promoted[key] = CacheHitSource.DISK
            return VLookup.HIT_PENDING
        block_id = getattr(self._primary, "block_id", None)  # present, whether ready or being written
        if block_id is not None and block_id(key) is not None:
            return VLookup.HIT_PENDING
        return VLookup.RETRY

    def get_load_source(self, key: Any, req_context: VReqContext) -> CacheHitSource:
        return self._promoted.pop(key, CacheHitSource.HOST)

    def prepare_load(self, keys: Collection[Any], req_context: VReqContext) -> CPULoadStoreSpec:
        spec = self.inner.prepare_load(list(keys), self.ours(req_context))
        return CPULoadStoreSpec(spec.block_ids)

    def touch(self, keys: Collection[Any], req_context: VReqContext) -> None:
        self.inner.touch(list(keys), self.ours(req_context))

    def complete_load(self, keys: Collection[Any], req_context: VReqContext) -> None:
        for key in keys:
            self._promoted.pop(key, None)
        self.inner.complete_load(list(keys), self.ours(req_context))

    # -- stores ----------------------------------------------------------------------------
    def prepare_store(self, keys: Collection[Any], req_context: VReqContext) -> VPrepareStoreOutput | None:
        out = self.inner.prepare_store(list(keys), self.ours(req_context))
        if out is None:
            return None
        return VPrepareStoreOutput(out.keys_to_store, CPULoadStoreSpec(out.store_spec.block_ids), out.evicted_keys)

    def complete_store(self, keys: Collection[Any], req_context: VReqContext, success: bool = True) -> None:
        self._ensure_bound()
        self.inner.complete_store(list(keys), self.ours(req_context), success)

    # -- requests and steps ----------------------------------------------------------------
    def on_new_request(self, req_context: VReqContext) -> VRequestContext:
        return VRequestContext(policy=_POLICY[self.inner.on_new_request(self.ours(req_context)).policy])

    def on_request_finished(self, req_context: VReqContext) -> None:
        self.inner.on_request_finished(self.ours(req_context))

    def on_schedule_end(self, context: Any = None) -> None:
        self._ensure_bound()
        self.inner.on_schedule_end(context)

    def take_events(self) -> Iterable[VEvent]:
        out = []
        for ev in self.inner.take_events():
            medium, owner = self._media.get(ev.medium, (None, None))
            if medium is None:
                self.unknown_media += 1
                medium, owner = Medium.STORAGE, ev.medium
            out.append(VEvent(keys=ev.keys, medium=medium, removed=ev.removed, locality=Locality.LOCAL,
                              ownership=owner))
        return out

    def has_pending_work(self) -> bool:
        return self.inner.has_pending_work()

    def reset_cache(self) -> None:
        self._promoted.clear()
        self.inner.reset_cache()

    def get_stats(self) -> None:
        return None

    def stats(self) -> dict[str, int]:
        """Our manager's counters (the tiering manager's, when there are secondary tiers)."""
        inner_stats = getattr(self.inner, "stats", None)
        out = dict(inner_stats()) if callable(inner_stats) else {}
        out["adapter_unknown_media"] = self.unknown_media
        return out

    def shutdown(self) -> None:
        self.inner.shutdown()
