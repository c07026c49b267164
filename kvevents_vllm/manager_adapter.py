"""Our offload manager behind vLLM's ``OffloadingManager`` role (the scheduler side of our spec).

What changes at the boundary, and nothing else (our manager's behaviour is untouched):

- request contexts: vLLM's ``ReqContext`` is handed to our manager as it is (it has our
  ``req_id`` and ``kv_transfer_params``; our manager keeps its request record on it); the CPU
  tier's ``key_positions_of`` reads the token positions vLLM's scheduler records for the
  request (its positions dict, or its ``get_offload_key_position``), so our LRU orders a
  request's blocks by position;
- ``LookupResult`` / ``OffloadPolicy`` members mapped by meaning (ours ``BLOCK_LEVEL`` is vLLM's
  ``CHUNK_LEVEL``; our ``RETRY`` for a block being stored or promoted into the CPU tier is vLLM's
  ``HIT_PENDING``, any other ``RETRY`` stays ``RETRY``);
- load/store specs: our ``LoadStoreSpec`` (medium + int64 ids) -> vLLM's ``CPULoadStoreSpec``
  (over the same int64 ids);
- events: vLLM's ``OffloadingEvent``, with ``Medium`` (CPU for the primary tier, STORAGE for a
  secondary tier), ``Locality.LOCAL`` and ``ownership`` (None for the primary tier, the tier's
  type for a secondary tier), built where our manager and tiers make theirs: the adapter sets
  each one's ``event_factory`` to a constructor for its medium (an event of ours that still
  arrives, from a manager or tier that makes its own, is converted in ``take_events``); our
  ``never_stored`` removal (a failed store's keys) is vLLM's ``metadata_only`` one;
- ``get_load_source``: HOST for a block the CPU tier held, DISK for one promoted from a
  secondary tier (the tiering manager says which keys it promotes);
- ``on_schedule_end(context)``: vLLM's ``ScheduleEndContext`` passed on (ours accepts and
  ignores it); ``get_stats``: vLLM's CPU-tier gauges (blocks pinned by stores / loads in
  flight) and allocation-size histogram, counted here from the calls, and, when the CPU tier
  filters stores by repeat offers, vLLM's skipped-stores counter (our ``stores_not_admitted``);
  our own counters are in :meth:`stats`;
- the admission filter under vLLM's names: ``counts`` (the offer counts, read-only; None
  without a filter) and ``stores_skipped_in_current_batch`` (not admitted since the last
  ``get_stats``).
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
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec, CPUOffloadingMetrics
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from manager.base import LookupResult, OffloadingManager, OffloadPolicy, ReqContext
from manager.tiering import TieringOffloadingManager

_HIT, _MISS = LookupResult.HIT, LookupResult.MISS
_LOCAL = Locality.LOCAL
_V_HIT, _V_MISS, _V_PENDING, _V_RETRY = VLookup.HIT, VLookup.MISS, VLookup.HIT_PENDING, VLookup.RETRY
_REQUEST_LEVEL = OffloadPolicy.REQUEST_LEVEL
#: one vLLM request context per policy, shared: vLLM's connector only reads its ``policy``
_CHUNK_CONTEXT = VRequestContext(policy=VPolicy.CHUNK_LEVEL)
_REQUEST_CONTEXT = VRequestContext(policy=VPolicy.REQUEST_LEVEL)
#: vLLM 0.33's events can say "forget what you noted, announce nothing" (``metadata_only``); on
#: 0.32 a failed store's removal is not made at all (0.32's own CPU manager makes none either)
_HAS_METADATA_ONLY = "metadata_only" in getattr(VEvent, "__dataclass_fields__", {})


def _event_factory(medium: Medium, ownership: str | None) -> Callable[..., VEvent | None]:
    """A constructor of vLLM's events in ``medium`` (our manager's ``event_factory`` signature;
    our medium name is already mapped)."""

    def make(keys: list, _medium: str, removed: bool, never_stored: bool = False) -> VEvent | None:
        if never_stored:
            return VEvent(keys, medium, removed, _LOCAL, ownership, metadata_only=True) if _HAS_METADATA_ONLY else None
        return VEvent(keys, medium, removed, _LOCAL, ownership)

    return make


class _PositionsOf:
    """A key's token position from a vLLM context whose ``get_offload_key_position`` is its own
    (a subclass): the mapping operations our manager uses (``get``, ``in``, truth)."""

    __slots__ = ("get",)

    def __init__(self, req_context: Any) -> None:
        self.get = req_context.get_offload_key_position

    def __contains__(self, key: object) -> bool:
        return self.get(key) is not None

    def __bool__(self) -> bool:
        return True


#: vLLM's ReqContext keeps the positions its scheduler records in this dict (0.33)
_TABLE = "_offload_key_positions" if "_offload_key_positions" in getattr(VReqContext, "__dataclass_fields__", {}) else None


def _key_positions(req_context: Any) -> Any:
    """Where vLLM's scheduler says the request's keys sit: its positions dict itself (filled as
    the request runs; empty: the manager skips positions at once), or the context's own method
    (a context of ours, from a caller of ours: its own ``key_positions``)."""
    if type(req_context) is ReqContext:
        return req_context.key_positions
    if type(req_context) is VReqContext and _TABLE is not None:
        return getattr(req_context, _TABLE)
    if getattr(req_context, "get_offload_key_position", None) is None:
        return None
    return _PositionsOf(req_context)


def _cpu_spec(block_ids: Any) -> CPULoadStoreSpec:
    """vLLM's CPU spec over our int64 ids as they are (its constructor copies them into int32;
    our worker reads either)."""
    spec = CPULoadStoreSpec.__new__(CPULoadStoreSpec)
    spec.block_ids = block_ids
    return spec


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
        for source in (self._primary, *(self._tiering.tiers if self._tiering else ())):
            source.event_factory = _event_factory(*self._media[source.medium])
        self._primary.key_positions_of = _key_positions
        self._promoted: dict[bytes, CacheHitSource] = {}
        # what get_stats reports (vLLM's CPU-tier gauges and allocation histogram): blocks pinned
        # by stores and by loads in flight, and the size of each prepare_store since the last call
        self._writing = 0
        self._reading = 0
        self._allocations: list[int] = []
        self._skipped_reported = 0  # the primary's stores_not_admitted at the last get_stats
        self._lookup = inner.lookup  # (the hottest call: one attribute lookup less per key)
        self.unknown_media = 0  # events in a medium no tier declared (sent as STORAGE)

    def _ensure_bound(self) -> None:
        if not self._bound and self._bind is not None:
            self._bound = self._bind()

    # -- lookups and loads -----------------------------------------------------------------
    def lookup(self, key: Any, req_context: VReqContext) -> VLookup:
        result = self._lookup(key, req_context)
        if result is _HIT:
            return _V_HIT
        if result is _MISS:
            return _V_MISS
        # ours answers RETRY for "ask again later"; vLLM tells apart a block that is found but
        # not readable yet (HIT_PENDING: being stored into, or promoted into, the CPU tier)
        if self._tiering is not None and self._tiering.promoting_from(key) is not None:
            self._promoted[key] = CacheHitSource.DISK
            return _V_PENDING
        block_id = getattr(self._primary, "block_id", None)  # present, whether ready or being written
        if block_id is not None and block_id(key) is not None:
            return _V_PENDING
        return _V_RETRY

    def get_load_source(self, key: Any, req_context: VReqContext) -> CacheHitSource:
        return self._promoted.pop(key, CacheHitSource.HOST)

    def prepare_load(self, keys: Collection[Any], req_context: VReqContext) -> CPULoadStoreSpec:
        spec = self.inner.prepare_load(keys, req_context)
        self._reading += len(keys)
        return _cpu_spec(spec.block_ids)

    def touch(self, keys: Collection[Any], req_context: VReqContext) -> None:
        self.inner.touch(keys, req_context)

    def complete_load(self, keys: Collection[Any], req_context: VReqContext) -> None:
        if self._promoted:
            for key in keys:
                self._promoted.pop(key, None)
        left = self._reading - len(keys)
        self._reading = left if left > 0 else 0
        self.inner.complete_load(keys, req_context)

    # -- stores ----------------------------------------------------------------------------
    def prepare_store(self, keys: Collection[Any], req_context: VReqContext) -> VPrepareStoreOutput | None:
        out = self.inner.prepare_store(keys, req_context)
        if out is None:
            self._allocations.append(len(keys))
            return None
        if out.keys_to_store:
            self._allocations.append(len(out.keys_to_store))
            self._writing += len(out.keys_to_store)
        return VPrepareStoreOutput(out.keys_to_store, _cpu_spec(out.store_spec.block_ids), out.evicted_keys)

    def complete_store(self, keys: Collection[Any], req_context: VReqContext, success: bool = True) -> None:
        if not self._bound:
            self._ensure_bound()
        left = self._writing - len(keys)
        self._writing = left if left > 0 else 0
        self.inner.complete_store(keys, req_context, success)

    # -- requests and steps ----------------------------------------------------------------
    def on_new_request(self, req_context: VReqContext) -> VRequestContext:
        req_context.manager_state = None  # (where our manager keeps its record of the request)
        if self.inner.on_new_request(req_context).policy is _REQUEST_LEVEL:
            return _REQUEST_CONTEXT
        return _CHUNK_CONTEXT

    def on_request_finished(self, req_context: VReqContext) -> None:
        self.inner.on_request_finished(req_context)

    def on_schedule_end(self, context: Any = None) -> None:
        if not self._bound:
            self._ensure_bound()
        self.inner.on_schedule_end(context)

    def take_events(self) -> Iterable[VEvent]:
        events = self.inner.take_events()
        if not events:
            return ()
        for ev in events:
            if type(ev) is not VEvent:  # from a source that makes its own (no event_factory)
                converted = [self._converted(e) for e in events]
                return [e for e in converted if e is not None]
        return events

    def _converted(self, ev: Any) -> VEvent | None:
        if type(ev) is VEvent:
            return ev
        found = self._media.get(ev.medium)
        if found is None:
            self.unknown_media += 1
            found = (Medium.STORAGE, ev.medium)
        return _event_factory(*found)(ev.keys, ev.medium, ev.removed, getattr(ev, "never_stored", False))

    def has_pending_work(self) -> bool:
        return self.inner.has_pending_work()

    def reset_cache(self) -> None:
        self._promoted.clear()
        self.inner.reset_cache()

    def get_stats(self) -> Any:
        """vLLM's CPU-tier metrics (``CPU_METRICS``): the share of CPU blocks pinned by transfers
        in flight (all, stores, loads) and the size of each store reservation since the last
        call."""
        stats = OffloadingConnectorStats()
        n = self._primary.num_blocks or 0
        writing = min(self._writing, n) / n if n else 0.0
        usage = min(self._writing + self._reading, n) / n if n else 0.0
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC, usage)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC, writing)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC, max(usage - writing, 0.0))
        for size in self._allocations:
            stats.observe_histogram(CPUOffloadingMetrics.CPU_ALLOCATION_SIZE, size)
        self._allocations.clear()
        if getattr(self._primary, "admission", None) is not None:
            stats.increase_counter(CPUOffloadingMetrics.STORES_SKIPPED, self.stores_skipped_in_current_batch)
            self._skipped_reported = self._primary.stores_not_admitted
        return stats

    @property
    def counts(self) -> Any:
        """The CPU tier's offer counts (key -> offers, read-only), None without a store threshold."""
        admission = getattr(self._primary, "admission", None)
        return None if admission is None else admission.counts

    @property
    def stores_skipped_in_current_batch(self) -> int:
        """Keys the CPU tier's admission filter left out since the last :meth:`get_stats`."""
        return getattr(self._primary, "stores_not_admitted", 0) - self._skipped_reported

    def stats(self) -> dict[str, int]:
        """Our manager's counters (the tiering manager's, when there are secondary tiers)."""
        inner_stats = getattr(self.inner, "stats", None)
        out = dict(inner_stats()) if callable(inner_stats) else {}
        out["adapter_unknown_media"] = self.unknown_media
        return out

    def shutdown(self) -> None:
        self.inner.shutdown()
