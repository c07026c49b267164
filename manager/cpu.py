"""The CPU primary tier: a fixed pool of host blocks under a cache policy.

Per block a ref count (a plain list indexed by block id): ``-1`` being written, ``0`` ready
and evictable, ``> 0`` pinned by that many loads. Blocks being written or loaded, and every
key of the current ``prepare_store``, are never evicted. ``prepare_store`` is all or nothing;
a failed ``complete_store`` frees its blocks (no stored event for them).

Requests: each request's :class:`~manager.policies.RequestRecord` lives in its context
(``ReqContext.manager_state``, set on whatever context object the caller hands over: ours, or
vLLM's through the plugin's adapter), made on its first call, so a request never announced
still counts and one never finished leaves nothing behind here. It lists the keys the request stored
or used; ``on_request_finished`` refreshes them tail to head (head most recent), ordered by
token position when the context gives every key's. ``reset_cache`` starts a new generation:
records from before it are dropped, with the recency they held.

Events (``enable_events=True``): stored keys when a store completes, removed keys when blocks
are evicted, and on ``reset_cache()`` removals for everything dropped. A failed store's keys
leave in a removal marked ``never_stored`` (they were never announced: the wire sends nothing
for it, vLLM's connector only drops what it noted for them); a key that a later
``prepare_store`` took again before the drain is left out of it, and an event left with no key
is not handed out.

Store admission (``store_threshold`` >= 2): a key not yet present is stored only once
``store_threshold`` ``prepare_store`` calls have offered it (:mod:`manager.admission`, counts
kept for the ``max_tracker_size`` most recently offered keys); the others are left out of
``keys_to_store`` and counted in ``stores_not_admitted``. Keys already present are unaffected.

``num_blocks=0`` is a tier that holds nothing: every store that needs a block is refused
(``store_rejections``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvevents.errors import ConfigError

from .admission import RepeatOfferAdmission, check_admission_settings
from .base import (
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from .policies import CachePolicy, RequestRecord, create_cache_policy

__all__ = ["CPUOffloadingManager"]

_HIT = LookupResult.HIT
_MISS = LookupResult.MISS
_RETRY = LookupResult.RETRY
_int64 = np.int64
_EMPTY_IDS = np.empty(0, dtype=np.int64)
_EMPTY_IDS.flags.writeable = False


class CPUOffloadingManager(OffloadingManager):
    """A fixed pool of ``num_blocks`` host blocks managed by ``cache_policy``."""

    def __init__(
        self,
        num_blocks: int,
        cache_policy: str | CachePolicy = "lru",
        enable_events: bool = False,
        medium: str = "CPU",
        *,
        store_threshold: int = 0,
        max_tracker_size: int = 64_000,
    ) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ConfigError(f"CPUOffloadingManager: num_blocks must be an int >= 0, got {num_blocks!r}")
        check_admission_settings(store_threshold, max_tracker_size, "CPUOffloadingManager: ")
        self.num_blocks = num_blocks
        self.medium = medium
        if isinstance(cache_policy, CachePolicy):
            self.policy = cache_policy
        else:
            # a tier of 0 blocks never inserts: its policy is built for one (policies need >= 1)
            self.policy = create_cache_policy(cache_policy, num_blocks or 1)
        #: the store admission filter; None: every offered key not present is stored
        self.admission = RepeatOfferAdmission(store_threshold, max_tracker_size) if store_threshold >= 2 else None
        self._blocks = self.policy.blocks  # key -> block id (owned by the policy)
        self._ref: list[int] = [0] * num_blocks
        # Blocks never handed out are [_fresh, num_blocks), given in ascending order before any
        # freed block; freed blocks are reused last-freed first (vLLM's CPU manager's order).
        self._fresh = 0
        self._free: list[int] = []
        self.enable_events = enable_events
        self._events: list[OffloadingEvent] = []
        self._cleanups: list[int] = []  # indexes in _events of never_stored removals
        self._generation = 0  # bumped by reset_cache: older request records are stale
        self.key_positions_of = None  # (see OffloadingManager.key_positions_of)
        # Counters (plain ints).
        self.lookups = 0
        self.hits = 0
        self.stores_prepared = 0
        self.stores_completed = 0
        self.stores_failed = 0
        self.store_rejections = 0  # prepare_store returned None
        self.stores_not_admitted = 0  # keys offered for store and left out by the admission filter
        self.evictions = 0
        self.loads = 0

    # -- queries ----------------------------------------------------------------

    def __contains__(self, key: object) -> bool:
        b = self._blocks.get(key)  # type: ignore[arg-type]
        return b is not None and self._ref[b] >= 0

    def cached_keys(self) -> set[OffloadKey]:
        """Every key stored and ready (ref count >= 0)."""
        ref = self._ref
        return {k for k, b in self._blocks.items() if ref[b] >= 0}

    def block_id(self, key: OffloadKey) -> int | None:
        return self._blocks.get(key)

    def ref_count(self, key: OffloadKey) -> int | None:
        b = self._blocks.get(key)
        return None if b is None else self._ref[b]

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + self.num_blocks - self._fresh

    # -- OffloadingManager ------------------------------------------------------

    def _live_record(self, req_context: ReqContext) -> RequestRecord | None:
        """The request's record, if this manager made it since the last reset and the request
        has not finished (else None)."""
        try:
            rec = req_context.manager_state
        except AttributeError:  # another framework's context, never seen here
            return None
        if rec is None or rec.owner is not self or rec.generation != self._generation:
            return None
        return rec

    def _record(self, req_context: ReqContext) -> RequestRecord:
        """The request's record, made on first use (or after a reset)."""
        rec = self._live_record(req_context)
        if rec is None:
            reader = self.key_positions_of
            positions = req_context.key_positions if reader is None else reader(req_context)
            rec = req_context.manager_state = RequestRecord(self, self._generation, positions)
        return rec

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._record(req_context)
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        rec = self._live_record(req_context)
        if rec is None:
            return  # never seen, finished already, or from before a reset
        req_context.manager_state = None
        keys = rec.keys  # (a key used twice: its first use decides, as refresh ends in order)
        positions = rec.positions
        if positions and keys and keys[0] in positions:
            get = positions.get
            where = [get(k) for k in keys]
            if None not in where and where != sorted(where):
                order = sorted(range(len(keys)), key=where.__getitem__)
                keys = [keys[i] for i in order]
        keys.reverse()
        self.policy.refresh(keys)

    def lookup(self, key: OffloadKey, req_context: ReqContext | None = None) -> LookupResult:
        self.lookups += 1
        b = self._blocks.get(key)
        if b is None:
            return _MISS
        if self._ref[b] < 0:
            return _RETRY  # being written: readable once its store completes
        self.hits += 1
        return _HIT

    def lookup_prefix(self, keys: Sequence[OffloadKey], req_context: ReqContext | None = None) -> int:
        """How many leading ``keys`` are HITs (stops at the first non-HIT)."""
        blocks, ref = self._blocks, self._ref
        n = 0
        for key in keys:
            b = blocks.get(key)
            if b is None or ref[b] < 0:
                break
            n += 1
        self.lookups += n + (n < len(keys))
        self.hits += n
        return n

    def prepare_load(self, keys: Sequence[OffloadKey], req_context: ReqContext | None = None) -> LoadStoreSpec:
        blocks, ref = self._blocks, self._ref
        ids = []
        append = ids.append
        for key in keys:
            b = blocks.get(key)
            if b is None or ref[b] < 0:
                # Undo the pins taken so far: all or nothing.
                for done in ids:
                    ref[done] -= 1
                raise KeyError(f"prepare_load: key {key.hex()[:24]}... is not stored and ready")
            ref[b] += 1
            append(b)
        self.loads += len(ids)
        if req_context is not None:
            self._used(keys, self._record(req_context))
        return LoadStoreSpec(self.medium, np.array(ids, dtype=_int64))

    def _used(self, keys: Sequence[OffloadKey], rec: RequestRecord) -> None:
        """The request loads or offers ``keys``: recorded, and told to the policy when the
        request knows positions (the policy heeds the resident, positioned ones)."""
        if rec.positions:
            self.policy.access(keys, rec)
        rec.keys.extend(keys)

    def touch(self, keys: Sequence[OffloadKey], req_context: ReqContext | None = None) -> None:
        self.policy.touch(keys, self._ref)  # (a request's use is recorded by its load or store)

    def complete_load(self, keys: Sequence[OffloadKey], req_context: ReqContext | None = None) -> None:
        blocks, ref = self._blocks, self._ref
        for key in keys:
            b = blocks.get(key)
            if b is None or ref[b] <= 0:
                raise KeyError(f"complete_load: key {key.hex()[:24]}... is not pinned by a load")
            ref[b] -= 1

    def prepare_store(self, keys: Sequence[OffloadKey], req_context: ReqContext | None = None) -> PrepareStoreOutput | None:
        blocks = self._blocks
        to_store = [k for k in keys if k not in blocks]
        if len(to_store) != len(set(to_store)):
            to_store = list(dict.fromkeys(to_store))
        if self.admission is not None:
            to_store = self._admit(keys, to_store)
        rec = None
        if req_context is not None:
            rec = self._record(req_context)
            if len(to_store) == len(keys):
                rec.keys.extend(keys)
            else:  # some present: a use of the ready ones (not of those being written); not admitted: none
                ref = self._ref
                kept = set(to_store) if self.admission is not None else None
                used = [k for k in keys if (ref[blocks[k]] >= 0 if k in blocks else kept is None or k in kept)]
                self._used(used, rec)
        if not to_store:
            return PrepareStoreOutput([], LoadStoreSpec(self.medium, _EMPTY_IDS), [])
        n = len(to_store)
        free = self._free
        fresh = self._fresh
        available = len(free) + self.num_blocks - fresh
        evicted_keys: list[OffloadKey] = []
        if n > available:
            if n > self.num_blocks:
                self.store_rejections += 1
                return None
            protected = set(keys) if len(to_store) < len(keys) else ()
            evicted = self.policy.evict(n - available, self._ref, protected)
            if evicted is None:
                self.store_rejections += 1
                return None
            for key, b in evicted:
                evicted_keys.append(key)
                free.append(b)
            self.evictions += len(evicted)
            if self.enable_events:
                self._events.append(self.event_factory(evicted_keys, self.medium, True))
        ref = self._ref
        if fresh < self.num_blocks:
            self._fresh = min(self.num_blocks, fresh + n)
            ids = list(range(fresh, self._fresh))
            rest = n - len(ids)
        else:
            ids, rest = [], n
        if rest:
            reused = free[-rest:]
            del free[-rest:]
            reused.reverse()
            ids += reused
        for b in ids:
            ref[b] = -1
        self.policy.insert_many(to_store, ids, rec)
        self.stores_prepared += n
        return PrepareStoreOutput(to_store, LoadStoreSpec(self.medium, np.array(ids, dtype=_int64)), evicted_keys)

    def _admit(self, keys: Sequence[OffloadKey], to_store: list[OffloadKey]) -> list[OffloadKey]:
        """The keys of ``to_store`` (no repeats) the admission filter lets through (this offer counted)."""
        admitted = self.admission.offer(keys, to_store)  # type: ignore[union-attr]
        self.stores_not_admitted += len(to_store) - len(admitted)
        return admitted

    def complete_store(self, keys: Sequence[OffloadKey], req_context: ReqContext | None = None, success: bool = True) -> None:
        blocks, ref = self._blocks, self._ref
        if success:
            stored = []
            for key in keys:
                b = blocks.get(key)
                if b is not None and ref[b] == -1:
                    ref[b] = 0
                    stored.append(key)
            self.stores_completed += len(stored)
            if stored and self.enable_events:
                self._events.append(self.event_factory(stored, self.medium, False))
        else:
            remove, free = self.policy.remove, self._free
            released = []
            for key in keys:
                b = blocks.get(key)
                if b is not None and ref[b] == -1:
                    remove(key)
                    ref[b] = 0
                    free.append(b)
                    released.append(key)
            self.stores_failed += len(released)
            if released and self.enable_events:
                self._add_cleanup(released)

    def _add_cleanup(self, keys: list[OffloadKey]) -> None:
        """A removal of keys never announced as stored (a factory may return None: no use for it)."""
        event = self.event_factory(keys, self.medium, True, True)
        if event is not None:
            self._cleanups.append(len(self._events))
            self._events.append(event)

    def take_events(self) -> list[OffloadingEvent]:
        events = self._events
        if not events:
            return []
        self._events = []
        if self._cleanups:
            events = self._pruned(events)
        return events

    def _pruned(self, events: list[OffloadingEvent]) -> list[OffloadingEvent]:
        """``events`` with each never_stored removal narrowed to the keys no store has taken
        again since (dropped when none is left)."""
        blocks, cleanups = self._blocks, set(self._cleanups)
        self._cleanups = []
        out = []
        for i, ev in enumerate(events):
            if i in cleanups:
                keys = [k for k in ev.keys if k not in blocks]
                if not keys:
                    continue
                if len(keys) != len(ev.keys):
                    ev = self.event_factory(keys, self.medium, True, True)
            out.append(ev)
        return out

    def reset_cache(self) -> None:
        """Drop every block not in use (ref count 0); blocks being written or loaded stay."""
        ref = self._ref
        dropped = [k for k, b in self._blocks.items() if ref[b] == 0]
        if len(dropped) == len(self._blocks):
            self.policy.clear()
            self._free = []
            self._fresh = 0
        else:
            remove, free = self.policy.remove, self._free
            for k in dropped:
                free.append(remove(k))  # type: ignore[arg-type]
        if dropped and self.enable_events:
            self._events.append(self.event_factory(dropped, self.medium, True))
        self._generation += 1

    def stats(self) -> dict[str, int]:
        return {
            "num_blocks": self.num_blocks,
            "free_blocks": self.num_free_blocks,
            "lookups": self.lookups,
            "hits": self.hits,
            "loads": self.loads,
            "stores_prepared": self.stores_prepared,
            "stores_completed": self.stores_completed,
            "stores_failed": self.stores_failed,
            "store_rejections": self.store_rejections,
            "stores_not_admitted": self.stores_not_admitted,
            "evictions": self.evictions,
        }
