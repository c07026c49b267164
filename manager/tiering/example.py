"""``ExampleSecondaryTierManager`` (type ``"example"``): the minimal reference tier.

Storage is a dict, everything is synchronous: each submit yields its JobResult at once. ``lookup_delay_steps=N``
makes its lookups behave like an asynchronous tier's (RETRY until N steps after a key was
first asked), to exercise the scheduler's retry path. A
load of a missing key yields a *failed* JobResult (without a result the request would wait
forever). ``custom_param`` shows how config entries reach a tier::

    SecondaryTierFactory.create_secondary_tier({"type": "example", "custom_param": 7})
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..base import LookupResult, OffloadKey, OffloadPolicy, ReqContext, RequestOffloadingContext
from .base import JobMetadata, JobResult, SecondaryTierManager

__all__ = ["ExampleSecondaryTierManager"]


class ExampleSecondaryTierManager(SecondaryTierManager):
    def __init__(
        self,
        tier_type: str = "example",
        *,
        custom_param: Any = None,
        request_level: bool = False,
        lookup_delay_steps: int = 0,
        **kw: Any,
    ) -> None:
        super().__init__(tier_type, **kw)
        self.custom_param = custom_param
        self.request_level = request_level
        #: > 0: lookups behave like an asynchronous tier's: a key is answered RETRY (pending)
        #: until this many steps (``on_schedule_end`` calls) after it was first asked
        self.lookup_delay_steps = lookup_delay_steps
        self._asked: dict[OffloadKey, int] = {}  # key -> step it was first asked (bounded)
        self._step = 0
        self.lookups_pending = 0
        self.store: dict[OffloadKey, bytes | None] = {}
        self._finished: list[JobResult] = []
        self.finished_requests: list[str] = []  # what on_request_finished saw, in order

    def lookup(self, key: OffloadKey, req_context: ReqContext | None = None) -> LookupResult:
        if self.lookup_delay_steps > 0:
            first = self._asked.setdefault(key, self._step)
            if self._step - first < self.lookup_delay_steps:
                self.lookups_pending += 1
                if len(self._asked) > 65536:
                    del self._asked[next(iter(self._asked))]
                return LookupResult.RETRY
            del self._asked[key]
        return LookupResult.HIT if key in self.store else LookupResult.MISS

    def on_schedule_end(self) -> None:
        self._step += 1

    def holds(self, key: OffloadKey) -> bool:
        return key in self.store

    def submit_store(self, job: JobMetadata) -> None:
        io = self.block_io
        new = []
        for key, block_id in zip(job.keys, job.block_ids.tolist()):
            if key not in self.store:
                new.append(key)
            self.store[key] = bytes(io.read_block(block_id)) if io is not None else None
        self._emit(new, removed=False)
        self._finished.append(JobResult(job.job_id, True))

    def submit_load(self, job: JobMetadata) -> None:
        if any(key not in self.store for key in job.keys):
            self._finished.append(JobResult(job.job_id, False))
            return
        io = self.block_io
        if io is not None:
            for key, block_id in zip(job.keys, job.block_ids.tolist()):
                data = self.store[key]
                if data is not None:
                    io.write_block(block_id, data)
        self._finished.append(JobResult(job.job_id, True))

    def get_finished_jobs(self) -> list[JobResult]:
        out, self._finished = self._finished, []
        return out

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        policy = OffloadPolicy.REQUEST_LEVEL if self.request_level else OffloadPolicy.BLOCK_LEVEL
        return RequestOffloadingContext(policy)

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.finished_requests.append(req_context.req_id)

    def has_pending_work(self) -> bool:
        return bool(self._finished)

    def remove(self, keys: Sequence[OffloadKey]) -> None:
        """Drop keys (emits removals): lets tests and demos age the tier."""
        gone = [k for k in dict.fromkeys(keys) if k in self.store]
        for k in gone:
            del self.store[k]
        self._emit(gone, removed=True)

    def cached_keys(self) -> set[OffloadKey]:
        return set(self.store)

    def get_num_blocks(self) -> int:
        """How many blocks the tier holds (vLLM's example tier has this method)."""
        return len(self.store)
