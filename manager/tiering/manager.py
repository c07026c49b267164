"""``TieringOffloadingManager``: a primary manager with secondary tiers behind it.

* A lookup that misses the primary asks the secondary tiers in order. A hit reserves the
  primary slot at once (``primary.prepare_store``) and answers RETRY; a tier whose answer is
  pending (an asynchronous lookup: it answered RETRY) makes a lookup without a hit RETRY too,
  so the connector asks again in a later step, and the scheduler never waits on a tier's
  I/O. The promotion is queued
  per (tier, request) and submitted as one load job per queue in ``on_schedule_end``. When the
  job's result is processed the primary store completes (or fails and frees the slot).
* A completed primary store cascades its blocks to every secondary tier that lacks them: the
  blocks are pinned in the primary (``prepare_load``) and a store job is submitted; the pin is
  released when the job's result is processed. Before that the tier's ``admit_store`` is
  asked (store backpressure): a tier that has fallen behind skips the job — nothing pinned,
  written or announced, counted in the tier's ``stores_skipped`` / ``blocks_skipped``. Promoted blocks cascade to the other tiers.
* ``on_new_request`` asks the primary and every tier; the request is REQUEST_LEVEL if any asks
  for it, and the tiers that asked are remembered for the request. For those tiers,
  ``prepare_store`` also cascades the request's blocks already resident in the primary (prefix
  hits, which the primary does not store again).
* Finished jobs are processed at most once per step (a gate reset in ``on_schedule_end``).
* ``on_request_finished`` reaches the secondary tiers only once the request's pending primary
  stores are done and its queued promotions were submitted.
* ``on_schedule_end``: process finished jobs, flush queued promotions, deliver deferred
  request finishes, reset the per-step gate, then call every tier's ``on_schedule_end``.
* ``take_events`` only drains: the primary's events, then each tier's.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import count
from typing import Any

import numpy as np

from kvevents.errors import ConfigError

from ..base import (
    BlockIO,
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    OffloadPolicy,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
)
from ..lifecycle import RequestLifecycle
from .base import JobMetadata, JobResult, SecondaryTierManager

__all__ = ["TieringOffloadingManager"]

_HIT = LookupResult.HIT
_MISS = LookupResult.MISS
_RETRY = LookupResult.RETRY


def _takes_argument(method: Any) -> bool:
    """Whether a bound method accepts one positional argument."""
    try:
        inspect.signature(method).bind(None)
    except TypeError:
        return False
    except ValueError:  # no signature (a builtin): assume the current form
        return True
    return True


@dataclass(slots=True)
class _Job:
    tier: int
    keys: list[OffloadKey]
    req_context: ReqContext | None
    is_promotion: bool


@dataclass(slots=True)
class _PromotionQueue:
    req_context: ReqContext
    keys: list[OffloadKey] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)


class TieringOffloadingManager(OffloadingManager):
    def __init__(
        self,
        primary: OffloadingManager | None = None,
        secondary_tiers: Sequence[SecondaryTierManager] | None = None,
        block_io: BlockIO | None = None,
        *,
        primary_tier: OffloadingManager | None = None,
        strict: bool = False,
    ) -> None:
        if (primary is None) == (primary_tier is None):
            raise TypeError("TieringOffloadingManager needs exactly one of primary / primary_tier (the same thing)")
        primary = primary if primary is not None else primary_tier
        self.primary = primary
        self.tiers = list(secondary_tiers or ())
        if self.tiers and getattr(primary, "admission", None) is not None:
            raise ConfigError("TieringOffloadingManager: a primary with store_threshold >= 2 cannot have secondary "
                              "tiers (its admission filter would refuse their promotions)")
        #: raise RequestLifecycleError on a repeated or unknown on_request_finished (else count and ignore)
        self.strict = strict
        self.medium = primary.medium
        if block_io is not None:
            self.bind_block_io(block_io)
        self._job_ids = count(1)
        self._jobs: dict[int, _Job] = {}
        self._tier_storing: list[set[OffloadKey]] = [set() for _ in self.tiers]
        self._promoting: dict[OffloadKey, int] = {}  # key -> tier it is promoted from
        self._promo_queues: dict[tuple[int, str], _PromotionQueue] = {}
        self._promo_reqs: dict[str, int] = {}  # req_id -> number of queues it has
        self._req_tiers: dict[str, list[int]] = {}  # req_id -> its REQUEST_LEVEL tiers
        self._pending_stores: dict[str, set[OffloadKey]] = {}
        self._finishing: dict[str, ReqContext] = {}
        self._lifecycle = RequestLifecycle("TieringOffloadingManager")
        #: per tier, who hears of its jobs (telemetry): ``job_submitted(job_id, direction, blocks)``
        #: as a job is handed to the tier, ``job_finished(job_id, success, None)`` as its result is collected
        self.job_observers: list[tuple[Any, ...]] = [() for _ in self.tiers]
        #: per tier, whether its on_schedule_end takes the engine's step context (tiers written
        #: before it was added take none)
        self._tier_takes_context = [_takes_argument(t.on_schedule_end) for t in self.tiers]
        self._processed_this_step = False
        # Counters.
        self.promotions_started = 0
        self.promotions_failed = 0  # load jobs with a key not loaded
        self.promotions_partial = 0  # of those, jobs whose other keys were loaded (and kept)
        self.promotions_rejected = 0  # secondary hit but no primary room
        self.cascade_jobs = 0
        self.cascade_failures = 0
        self.unknown_results = 0
        self.lookups_pending = 0  # primary misses answered RETRY because a tier's lookup was pending

    # -- lookups and loads --------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        self._process_finished_gated()
        r = self.primary.lookup(key, req_context)
        if r is _HIT or r is _RETRY:
            return r
        if key in self._promoting:
            return _RETRY
        pending = False
        for i, tier in enumerate(self.tiers):
            found = tier.lookup(key, req_context)
            if found is _RETRY:  # the tier's answer is not known yet (an asynchronous lookup)
                pending = True
                continue
            if found is _HIT:
                out = self.primary.prepare_store([key], req_context)
                if out is None or not out.keys_to_store:
                    self.promotions_rejected += 1
                    return _MISS
                qkey = (i, req_context.req_id)
                queue = self._promo_queues.get(qkey)
                if queue is None:
                    queue = self._promo_queues[qkey] = _PromotionQueue(req_context)
                    self._lifecycle.seen(req_context.req_id)
                    self._promo_reqs[req_context.req_id] = self._promo_reqs.get(req_context.req_id, 0) + 1
                queue.keys.append(key)
                queue.block_ids.append(int(out.store_spec.block_ids[0]))
                self._promoting[key] = i
                self.promotions_started += 1
                return _RETRY
        if pending:
            self.lookups_pending += 1
            return _RETRY
        return _MISS

    def promoting_from(self, key: OffloadKey) -> int | None:
        """The index of the tier ``key`` is being promoted from, or None (not in flight)."""
        return self._promoting.get(key)

    def prepare_load(self, keys: Sequence[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        return self.primary.prepare_load(keys, req_context)

    def complete_load(self, keys: Sequence[OffloadKey], req_context: ReqContext) -> None:
        self.primary.complete_load(keys, req_context)

    def touch(self, keys: Sequence[OffloadKey], req_context: ReqContext) -> None:
        self.primary.touch(keys, req_context)
        for tier in self.tiers:
            tier.touch(keys, req_context)

    # -- stores -------------------------------------------------------------------

    def prepare_store(self, keys: Sequence[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        self._process_finished_gated()
        out = self.primary.prepare_store(keys, req_context)
        if out is None:
            return None
        if out.keys_to_store:
            pending = self._pending_stores.get(req_context.req_id)
            if pending is None:
                pending = self._pending_stores[req_context.req_id] = set()
                self._lifecycle.seen(req_context.req_id)
            pending.update(out.keys_to_store)
        tiers = self._req_tiers.get(req_context.req_id)
        if tiers:
            new = set(out.keys_to_store)
            resident = [
                k for k in keys
                if k not in new and k not in self._promoting and self.primary.lookup(k, req_context) is _HIT
            ]
            if resident:
                self._cascade(resident, req_context, tiers)
        return out

    def complete_store(self, keys: Sequence[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        pending = self._pending_stores.get(req_context.req_id)
        mine = [k for k in keys if k in pending] if pending else []
        self.primary.complete_store(keys, req_context, success)
        if pending is not None:
            pending.difference_update(mine)
        if success and mine:
            self._cascade(mine, req_context, range(len(self.tiers)))
        if pending is not None and not pending:
            del self._pending_stores[req_context.req_id]
            self._maybe_finish(req_context.req_id)

    def _cascade(
        self, keys: Sequence[OffloadKey], req_context: ReqContext | None, tiers: Sequence[int] | range
    ) -> None:
        """Store primary-resident ``keys`` into each tier in ``tiers`` that lacks them."""
        for i in tiers:
            tier = self.tiers[i]
            storing = self._tier_storing[i]
            todo = [k for k in keys if k not in storing and not tier.holds(k)]
            if not todo or not tier.admit_store(len(todo)):  # backpressure: skipped and counted
                continue
            spec = self.primary.prepare_load(todo, req_context)  # pinned until the job's result
            storing.update(todo)
            job_id = next(self._job_ids)
            self._jobs[job_id] = _Job(i, todo, req_context, False)
            self.cascade_jobs += 1
            job = JobMetadata(job_id, todo, spec.block_ids, False, req_context)
            for o in self.job_observers[i]:
                o.job_submitted(job_id, "store", len(todo))
            tier.submit_store(job)

    # -- step lifecycle -------------------------------------------------------------

    def _process_finished_gated(self) -> None:
        if not self._processed_this_step:
            self._processed_this_step = True
            self._process_finished()

    def _process_finished(self) -> None:
        for i, tier in enumerate(self.tiers):
            results = tier.get_finished_jobs()
            for o in self.job_observers[i]:
                for res in results:
                    o.job_finished(res.job_id, res.success, None)
            for res in results:
                job = self._jobs.pop(res.job_id, None)
                if job is None or job.tier != i:
                    self.unknown_results += 1
                    continue
                if job.is_promotion:
                    self._complete_promotion(i, job, res)
                else:
                    self._tier_storing[i].difference_update(job.keys)
                    self.primary.complete_load(job.keys, job.req_context)  # type: ignore[arg-type]
                    if not res.success:
                        self.cascade_failures += 1

    def _complete_promotion(self, i: int, job: _Job, res: JobResult) -> None:
        """The primary keeps what the tier loaded (all, none, or a failed job's
        ``successful_keys``) and frees the rest; what it keeps cascades to the other tiers."""
        for key in job.keys:
            self._promoting.pop(key, None)
        if res.success:
            loaded, failed = job.keys, []
        elif res.successful_keys:
            ok = set(res.successful_keys).intersection(job.keys)
            self.unknown_results += len(set(res.successful_keys)) - len(ok)  # keys not in the job
            loaded, failed = [k for k in job.keys if k in ok], [k for k in job.keys if k not in ok]
            self.promotions_partial += 1
        else:
            loaded, failed = [], job.keys
        if loaded:
            self.primary.complete_store(loaded, job.req_context, True)  # type: ignore[arg-type]
            others = [t for t in range(len(self.tiers)) if t != i]
            if others:
                self._cascade(loaded, job.req_context, others)
        if failed:
            self.primary.complete_store(failed, job.req_context, False)  # type: ignore[arg-type]
            self.promotions_failed += 1

    def _flush_promotions(self) -> None:
        queues, self._promo_queues = self._promo_queues, {}
        for (i, req_id), queue in queues.items():
            job_id = next(self._job_ids)
            self._jobs[job_id] = _Job(i, queue.keys, queue.req_context, True)
            job = JobMetadata(job_id, queue.keys, np.array(queue.block_ids, dtype=np.int64), True, queue.req_context)
            for o in self.job_observers[i]:
                o.job_submitted(job_id, "load", len(queue.keys))
            self.tiers[i].submit_load(job)
        self._promo_reqs.clear()

    def on_schedule_end(self, context: object = None) -> None:
        if not self.schedule_end_observers:
            self._schedule_end(context)
            return
        states = self._schedule_end_started()
        try:
            self._schedule_end(context)
        finally:
            self._schedule_end_finished(states)

    def _schedule_end(self, context: object = None) -> None:
        self._process_finished_gated()
        self._flush_promotions()
        for req_id in list(self._finishing):
            self._maybe_finish(req_id)
        self._processed_this_step = False
        for tier, takes_context in zip(self.tiers, self._tier_takes_context):
            if takes_context:
                tier.on_schedule_end(context)
            else:
                tier.on_schedule_end()

    # -- requests -------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        self._lifecycle.started(req_context.req_id)
        policy = self.primary.on_new_request(req_context).policy
        tiers = [
            i for i, t in enumerate(self.tiers) if t.on_new_request(req_context).policy is OffloadPolicy.REQUEST_LEVEL
        ]
        if tiers:
            self._req_tiers[req_context.req_id] = tiers
            policy = OffloadPolicy.REQUEST_LEVEL
        return RequestOffloadingContext(policy)

    def request_level_tiers(self, req_id: str) -> list[int]:
        """Indexes of the tiers that asked for REQUEST_LEVEL for ``req_id``."""
        return list(self._req_tiers.get(req_id, ()))

    def on_request_finished(self, req_context: ReqContext) -> None:
        """Once per request told to :meth:`on_new_request`; a repeat or an unknown id is counted
        (``finish_repeats`` / ``finish_unknown`` in :meth:`stats`) and goes no further, or raises
        :class:`~manager.base.RequestLifecycleError` when ``strict``."""
        if not self._lifecycle.finished(req_context.req_id, self.strict):
            return
        self.primary.on_request_finished(req_context)
        self._finishing[req_context.req_id] = req_context
        self._maybe_finish(req_context.req_id)

    def _maybe_finish(self, req_id: str) -> None:
        if req_id not in self._finishing or self._pending_stores.get(req_id) or self._promo_reqs.get(req_id):
            return
        req_context = self._finishing.pop(req_id)
        self._req_tiers.pop(req_id, None)
        for tier in self.tiers:
            tier.on_request_finished(req_context)

    # -- events and housekeeping ------------------------------------------------------

    def take_events(self) -> list[OffloadingEvent]:
        events = list(self.primary.take_events())
        for tier in self.tiers:
            events.extend(tier.take_events())
        return events

    def has_pending_work(self) -> bool:
        return (
            bool(self._jobs or self._promo_queues or self._finishing)
            or self.primary.has_pending_work()
            or any(t.has_pending_work() for t in self.tiers)
        )

    def drain_jobs(self, timeout: float | None = None) -> bool:
        """Wait for every tier's in-flight jobs (results are processed in ``on_schedule_end``)."""
        return all(t.drain_jobs(timeout) for t in self.tiers)

    def reset_cache(self) -> None:
        self.primary.reset_cache()

    def shutdown(self) -> None:
        for tier in self.tiers:
            tier.shutdown()
        self.primary.shutdown()

    def add_job_observer(self, tier_index: int, observer: Any) -> None:
        """``observer`` hears every job of tier ``tier_index`` from now on."""
        self.job_observers[tier_index] = (*self.job_observers[tier_index], observer)

    def remove_job_observer(self, tier_index: int, observer: Any) -> None:
        self.job_observers[tier_index] = tuple(o for o in self.job_observers[tier_index] if o is not observer)

    def bind_block_io(self, block_io: BlockIO) -> None:
        """Tiers built without a :class:`~manager.base.BlockIO` move bytes through ``block_io``."""
        for tier in self.tiers:
            if tier.block_io is None:
                tier.block_io = block_io

    # vLLM's names for the two parts (kept: ours are used throughout)
    @property
    def primary_tier(self) -> OffloadingManager:
        """The primary manager (vLLM's name for :attr:`primary`)."""
        return self.primary

    @property
    def secondary_tiers(self) -> list[SecondaryTierManager]:
        """The secondary tiers in lookup order (vLLM's name for :attr:`tiers`)."""
        return self.tiers

    @property
    def num_blocks(self) -> int | None:
        """The primary's block count (the host buffer's size in offloaded blocks), if it has one."""
        return self.primary.num_blocks

    def stats(self) -> dict[str, int]:
        return {
            **self._lifecycle.stats(),
            "jobs_in_flight": len(self._jobs),
            "promotions_started": self.promotions_started,
            "promotions_failed": self.promotions_failed,
            "promotions_partial": self.promotions_partial,
            "promotions_rejected": self.promotions_rejected,
            "cascade_jobs": self.cascade_jobs,
            "cascade_failures": self.cascade_failures,
            "unknown_results": self.unknown_results,
            "lookups_pending": self.lookups_pending,
            "stores_skipped": sum(getattr(t, "stores_skipped", 0) for t in self.tiers),
            "blocks_skipped": sum(getattr(t, "blocks_skipped", 0) for t in self.tiers),
        }
