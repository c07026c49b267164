"""The :class:`SecondaryTierManager` role and its job types.

A secondary tier sits behind the primary (CPU) tier. The :class:`TieringOffloadingManager`
hands it jobs:

* a *store* job (``is_promotion=False``) copies primary blocks ``block_ids`` (pinned in the
  primary until the job's result is processed) into the tier under ``keys``;
* a *load* job (``is_promotion=True``) copies the tier's ``keys`` into the primary blocks
  ``block_ids`` (reserved in the primary until the result is processed).

Block bytes move through :attr:`SecondaryTierManager.block_io` (a :class:`manager.BlockIO`);
a tier without one stores metadata only. ``submit_store``/``submit_load`` never block; every
submitted job yields exactly one :class:`JobResult` through ``get_finished_jobs``.

A tier reports what it holds as :class:`~manager.base.OffloadingEvent`\\ s in its own
``medium``, in the order things happened, through ``take_events()`` (a pure drain).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..base import BlockIO, LookupResult, OffloadingEvent, OffloadKey, ReqContext, RequestOffloadingContext
from .backpressure import StorePolicy, create_store_policy

__all__ = ["JobMetadata", "JobResult", "SecondaryTierManager"]


@dataclass(slots=True)
class JobMetadata:
    job_id: int
    keys: list[OffloadKey]
    #: primary block ids, aligned with ``keys`` (numpy int64).
    block_ids: np.ndarray
    #: True: tier -> primary (a load/promotion); False: primary -> tier (a store).
    is_promotion: bool
    req_context: ReqContext | None = None


@dataclass(slots=True, frozen=True)
class JobResult:
    job_id: int
    #: True: every key of the job succeeded; False: all or some failed.
    success: bool
    #: a failed load job's keys that were loaded all the same (they are kept in the primary);
    #: None: every key shares ``success``. Ignored for store jobs and successful results.
    successful_keys: tuple[OffloadKey, ...] | None = None


class SecondaryTierManager(ABC):
    """One secondary tier. ``tier_type`` is injected by the factory and kept as an attribute."""

    #: the medium named in this tier's events.
    medium: str = "STORAGE"
    #: what :meth:`_emit` builds each event with, called ``(keys, medium, removed)`` (see
    #: :attr:`manager.base.OffloadingManager.event_factory`)
    event_factory: Callable[[list[OffloadKey], str, bool], Any] = OffloadingEvent

    def __init__(
        self,
        tier_type: str,
        *,
        block_io: BlockIO | None = None,
        medium: str | None = None,
        enable_events: bool = True,
        store_policy: str | StorePolicy | None = None,
        store_policy_args: dict[str, Any] | None = None,
    ) -> None:
        self.tier_type = tier_type
        #: admission of store jobs (see :mod:`manager.tiering.backpressure`)
        self.store_policy = create_store_policy(store_policy, **(store_policy_args or {}))
        self.stores_skipped = 0  # store jobs refused by the policy (nothing written or claimed)
        self.blocks_skipped = 0  # their blocks
        self.block_io = block_io
        if medium is not None:
            self.medium = medium
        self.enable_events = enable_events
        self._events: list[OffloadingEvent] = []
        self._events_lock = threading.Lock()

    # -- the role ---------------------------------------------------------------

    @abstractmethod
    def lookup(self, key: OffloadKey, req_context: ReqContext | None = None) -> LookupResult:
        """HIT when ``key`` is stored and can be loaded, MISS otherwise, RETRY when the answer
        is not known yet (an asynchronous lookup in flight: ask again in a later step). Never
        blocks on I/O."""

    @abstractmethod
    def submit_store(self, job: JobMetadata) -> None:
        """Start storing ``job``; never blocks. One JobResult follows."""

    @abstractmethod
    def submit_load(self, job: JobMetadata) -> None:
        """Start loading ``job`` into the primary; never blocks. One JobResult follows; a
        missing key makes it a failed result."""

    @abstractmethod
    def get_finished_jobs(self) -> list[JobResult]:
        """Results of jobs finished since the last call (each reported once)."""

    @abstractmethod
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """Which offload policy this tier wants for the request."""

    def on_request_finished(self, req_context: ReqContext) -> None:  # noqa: B027
        """The request is done and its stores were submitted to this tier."""

    def on_schedule_end(self, context: Any = None) -> None:  # noqa: B027
        """End of a scheduler step. ``context``: what the engine said of the step (vLLM 0.33's
        ``ScheduleEndContext``: the step's new and preempted request ids), or None. Tiers
        written with no argument (``on_schedule_end(self)``) keep working: the tiering manager
        calls them without it."""

    def touch(self, keys: Sequence[OffloadKey], req_context: ReqContext | None = None) -> None:  # noqa: B027
        """The keys were used."""

    def get_num_blocks(self) -> int | None:
        """How many blocks the tier holds (for telemetry); None: the tier does not say."""
        return None

    def has_pending_work(self) -> bool:
        """Whether jobs are in flight or results are waiting to be collected."""
        return False

    def holds(self, key: OffloadKey) -> bool:
        """Whether the tier holds ``key`` as far as it knows now, without starting any
        lookup work (the tiering manager asks this before storing a block into the tier).

        By default the tier does not know (False: the block is stored, as vLLM's tiering
        manager stores every block into every tier). ``lookup`` is not a substitute: it
        belongs to a request, and an asynchronous tier's answer to it may be cached for that
        request (vllm-kvblockd caches it until the request finishes); asked with no request,
        it would cache an answer that no request's end ever clears: a MISS taken before the
        tier's store landed would hide the block from every later lookup."""
        return False

    def store_backlog(self) -> int:
        """Blocks of store jobs submitted and not yet finished (0 for synchronous tiers)."""
        return 0

    def admit_store(self, num_blocks: int) -> bool:
        """Whether a store job of ``num_blocks`` blocks should be submitted now (asked by the
        tiering manager before it pins anything). A refusal is counted here: the caller skips
        the job, so nothing is written and no event claims the blocks."""
        policy = getattr(self, "store_policy", None)  # (None: a subclass that skipped our __init__)
        if policy is None or policy.admit(self.store_backlog(), num_blocks):
            return True
        self.stores_skipped += 1
        self.blocks_skipped += num_blocks
        return False

    def drain_jobs(self, timeout: float | None = None) -> bool:
        """Wait until every submitted job has finished (results stay available to
        ``get_finished_jobs``); False if ``timeout`` passed first."""
        return True

    def shutdown(self) -> None:  # noqa: B027
        """Stop workers and release resources. Idempotent."""

    # -- events -----------------------------------------------------------------

    def take_events(self) -> list[OffloadingEvent]:
        """Pure drain of this tier's events."""
        with self._events_lock:
            events, self._events = self._events, []
        return events

    def _emit(self, keys: list[OffloadKey], removed: bool) -> None:
        """Record an event; callers emitting from several threads hold their own state lock
        so the order of events is the order of changes."""
        if keys and self.enable_events:
            with self._events_lock:
                self._events.append(self.event_factory(keys, self.medium, removed))
