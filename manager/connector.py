"""The scheduler-side offloading connector.

``OffloadingConnectorScheduler(manager, gpu_block_size, offloaded_block_size)`` sits between
an engine scheduler and an :class:`~manager.base.OffloadingManager`. An offloaded block
spans ``k = offloaded_block_size // gpu_block_size`` GPU blocks (a "chunk"); its key is the
hash of the chunk's last GPU block (with the KV-cache group index, see
:func:`~manager.base.make_offload_key`).

Per step the engine calls, in order:

1. ``get_num_new_matched_tokens(request, num_computed_tokens)`` for a waiting request: how
   many tokens past the GPU prefix hit can be loaded from the offload tiers (``None``: ask
   again in a later step);
2. ``update_state_after_alloc(request, block_ids, num_external_tokens)`` once its GPU blocks
   are allocated: the load job is prepared (the manager pins the blocks);
3. ``build_connector_meta(scheduler_output)``: load jobs, store jobs for newly computed
   chunks, and the jobs to flush; its very last action is ``manager.on_schedule_end()``;
4. ``update_connector_output(finished_jobs, failed_jobs)`` with what the worker finished;
5. ``take_events()``: the manager's OffloadingEvents as kvevents ``BlockStored`` /
   ``BlockRemoved`` (through :mod:`manager.wire`, the one adapter to the wire).

Policies: a ``BLOCK_LEVEL`` request (the default) stores only the chunks it computes, never
its prefix hit (GPU or offloaded) again; a ``REQUEST_LEVEL`` request offers every chunk to
``prepare_store`` (the manager skips what it holds, and a tiering manager cascades those
blocks to the tiers that asked for whole requests).

Hashes go on the wire as vLLM sends them by default, the low 64 bits unsigned
(``int_hashes=True``); ``int_hashes=False`` sends the hash bytes (vLLM's
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from kvevents.events import KVEvent

from .base import (
    LookupResult,
    OffloadingManager,
    OffloadKey,
    OffloadPolicy,
    ReqContext,
    RequestLifecycleError,
    make_offload_key,
)
from .connector_types import (
    LOAD,
    STORE,
    CachedRequestData,
    ConnectorError,
    ConnectorMetadata,
    ConnectorUpdate,
    EngineRequest,
    NewRequestData,
    SchedulerOutput,
    TransferJob,
)
from .lifecycle import RequestLifecycle
from .transfer_base import expand_block_ids
from .wire import offload_events_to_kv_events

__all__ = [
    "CachedRequestData",
    "ConnectorError",
    "ConnectorMetadata",
    "ConnectorUpdate",
    "EngineRequest",
    "NewRequestData",
    "OffloadingConnectorScheduler",
    "SchedulerOutput",
    "TransferJob",
    "offload_events_to_kv_events",
]

_HIT = LookupResult.HIT
_RETRY = LookupResult.RETRY


@dataclass(slots=True, eq=False)
class _ReqState:
    request: EngineRequest
    ctx: ReqContext
    policy: OffloadPolicy
    block_ids: list[int] = field(default_factory=list)
    next_store_chunk: int = 0
    # (first chunk, number of chunks hit, num_computed_tokens) of the last lookup
    pending_hit: tuple[int, int, int] | None = None
    jobs: set[int] = field(default_factory=set)
    finished: bool = False
    finish_called: bool = False  # request_finished was called (a second call is a repeat)


class OffloadingConnectorScheduler:
    """The scheduler side of KV offloading: turns scheduler steps into load/store jobs."""

    def __init__(
        self,
        manager: OffloadingManager,
        gpu_block_size: int,
        offloaded_block_size: int,
        *,
        group_idx: int = 0,
        int_hashes: bool = True,
        strict: bool = False,
    ) -> None:
        if gpu_block_size < 1 or offloaded_block_size < 1:
            raise ConnectorError(
                f"block sizes must be >= 1 (gpu {gpu_block_size}, offloaded {offloaded_block_size})"
            )
        if offloaded_block_size % gpu_block_size:
            raise ConnectorError(
                f"offloaded_block_size {offloaded_block_size} is not a whole multiple of "
                f"gpu_block_size {gpu_block_size}"
            )
        self.manager = manager
        self.gpu_block_size = gpu_block_size
        self.offloaded_block_size = offloaded_block_size
        self.blocks_per_chunk = offloaded_block_size // gpu_block_size
        self.group_idx = group_idx
        self.int_hashes = int_hashes
        #: raise RequestLifecycleError on a request finished twice or never announced (else count it)
        self.strict = strict
        self._lifecycle = RequestLifecycle("OffloadingConnectorScheduler")
        self._requests: dict[str, _ReqState] = {}
        self._jobs: dict[int, TransferJob] = {}
        self._pending_loads: list[TransferJob] = []
        self._next_job_id = 0
        # counters (plain ints)
        self.requests_seen = 0
        self.requests_released = 0
        self.lookups = 0
        self.lookup_retries = 0
        self.hit_tokens = 0
        self.load_jobs = 0
        self.store_jobs = 0
        self.blocks_loaded = 0
        self.blocks_stored = 0
        self.store_rejections = 0
        self.jobs_flushed = 0
        self.loads_failed = 0
        self.stores_failed = 0
        self.unknown_job_results = 0
        self.unknown_requests = 0
        self.manager_errors = 0
        self.steps = 0

    # --- queries ----------------------------------------------------------------------------
    def chunk_key(self, request: EngineRequest, chunk: int) -> OffloadKey:
        """The key of offloaded block ``chunk`` of ``request``: hash of its last GPU block."""
        return make_offload_key(request.block_hashes[(chunk + 1) * self.blocks_per_chunk - 1], self.group_idx)

    def _chunk_keys(self, st: _ReqState, chunks: range) -> list[OffloadKey]:
        """The keys of ``chunks`` of the request, their token positions noted for the manager."""
        keys = [self.chunk_key(st.request, c) for c in chunks]
        obs = self.offloaded_block_size
        st.ctx.key_positions.update(zip(keys, ((c + 1) * obs for c in chunks)))
        return keys

    def policy_of(self, req_id: str) -> OffloadPolicy | None:
        st = self._requests.get(req_id)
        return None if st is None else st.policy

    def tracked_requests(self) -> set[str]:
        return set(self._requests)

    def pending_jobs(self) -> set[int]:
        return set(self._jobs)

    def has_pending_jobs(self) -> bool:
        return bool(self._jobs) or bool(self._pending_loads)

    def jobs_of(self, req_id: str) -> set[int]:
        st = self._requests.get(req_id)
        return set() if st is None else set(st.jobs)

    def stats(self) -> dict[str, int]:
        return {
            "steps": self.steps,
            "requests_tracked": len(self._requests),
            "requests_seen": self.requests_seen,
            "requests_released": self.requests_released,
            "lookups": self.lookups,
            "lookup_retries": self.lookup_retries,
            "hit_tokens": self.hit_tokens,
            "load_jobs": self.load_jobs,
            "store_jobs": self.store_jobs,
            "blocks_loaded": self.blocks_loaded,
            "blocks_stored": self.blocks_stored,
            "store_rejections": self.store_rejections,
            "jobs_flushed": self.jobs_flushed,
            "jobs_pending": len(self._jobs),
            "loads_failed": self.loads_failed,
            "stores_failed": self.stores_failed,
            "unknown_job_results": self.unknown_job_results,
            "unknown_requests": self.unknown_requests,
            "manager_errors": self.manager_errors,
            "finish_repeats": self._lifecycle.finish_repeats,
            "finish_unknown": self._lifecycle.finish_unknown,
        }

    # --- request lifecycle ------------------------------------------------------------------
    def on_new_request(self, request: EngineRequest) -> OffloadPolicy:
        """The scheduler added ``request`` (call it once then, as vLLM's scheduler does): build
        its ReqContext and keep the policy the manager asks for. The per-request calls below
        call it too, so a driver that skips it still works; a second call only refreshes the
        request object."""
        st = self._requests.get(request.req_id)
        if st is not None:
            st.request = request
            return st.policy
        # key -> end token of its chunk, for every key handed to the manager (the LRU orders the
        # request's blocks head to tail by it)
        ctx = ReqContext(request.req_id, request.kv_transfer_params, {})
        policy = self.manager.on_new_request(ctx).policy
        self._requests[request.req_id] = _ReqState(request, ctx, policy)
        self._lifecycle.started(request.req_id)
        self.requests_seen += 1
        return policy

    def get_num_new_matched_tokens(self, request: EngineRequest, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens past ``num_computed_tokens`` loadable from offload, and whether the load is
        asynchronous. ``(None, False)``: a tier answered RETRY for a block of the prefix
        (the scan goes on past it, so every block's promotion starts now), ask again in a
        later step.
        At least one token is always left to compute."""
        self.on_new_request(request)
        st = self._requests[request.req_id]
        st.pending_hit = None
        obs, k = self.offloaded_block_size, self.blocks_per_chunk
        start = num_computed_tokens // obs
        limit = min(len(request.block_hashes) // k, (request.num_tokens - 1) // obs)
        n = 0
        retry = False
        positions = st.ctx.key_positions
        for chunk in range(start, limit):
            self.lookups += 1
            key = self.chunk_key(request, chunk)
            positions[key] = (chunk + 1) * obs
            result = self.manager.lookup(key, st.ctx)
            if result is _HIT:
                n += 1
            elif result is _RETRY:
                # keep scanning: the lookups of the following blocks start their promotions
                # too, so the whole prefix is ready by the next step, not one block a step
                retry = True
            else:
                break
        if retry:
            self.lookup_retries += 1
            return None, False
        st.pending_hit = (start, n, num_computed_tokens)
        if n == 0:
            return 0, False
        return (start + n) * obs - num_computed_tokens, True

    def update_state_after_alloc(self, request: EngineRequest, block_ids: list[int], num_external_tokens: int) -> None:
        """The request's GPU blocks are allocated: prepare its load job (if any) and decide
        where its stores start (after the hit prefix for BLOCK_LEVEL, at 0 for REQUEST_LEVEL)."""
        self.on_new_request(request)
        st = self._requests[request.req_id]
        st.block_ids = list(block_ids)
        obs, k, gbs = self.offloaded_block_size, self.blocks_per_chunk, self.gpu_block_size
        hit, st.pending_hit = st.pending_hit, None
        num_computed = hit[2] if hit is not None else request.num_computed_tokens
        prefix_end = num_computed + num_external_tokens
        st.next_store_chunk = 0 if st.policy is OffloadPolicy.REQUEST_LEVEL else prefix_end // obs
        if num_external_tokens <= 0:
            return
        if hit is None or hit[1] == 0:
            raise ConnectorError(
                f"request {request.req_id}: {num_external_tokens} external tokens allocated "
                "but get_num_new_matched_tokens found no hit"
            )
        start, n, _ = hit
        if prefix_end % obs or not start < prefix_end // obs <= start + n or num_computed % gbs:
            raise ConnectorError(
                f"request {request.req_id}: {num_external_tokens} external tokens after {num_computed} "
                f"computed do not end on an offloaded block of the hit (chunks {start}..{start + n - 1}, "
                f"{obs} tokens each)"
            )
        end_chunk = prefix_end // obs
        if len(st.block_ids) < end_chunk * k:
            raise ConnectorError(
                f"request {request.req_id}: {len(st.block_ids)} GPU blocks allocated, the load needs {end_chunk * k}"
            )
        keys = self._chunk_keys(st, range(start, end_chunk))
        spec = self.manager.prepare_load(keys, st.ctx)
        self.manager.touch(keys, st.ctx)
        first_gpu = num_computed // gbs
        src = expand_block_ids(spec.block_ids, k, skip=first_gpu - start * k)
        dst = np.asarray(st.block_ids[first_gpu : end_chunk * k], dtype=np.int64)
        job = self._new_job(st, LOAD, keys, src, dst)
        self._pending_loads.append(job)
        self.load_jobs += 1
        self.blocks_loaded += len(keys)
        self.hit_tokens += num_external_tokens

    def request_finished(self, request: str | EngineRequest, block_ids: Any = None) -> bool:
        """The engine is done with a request (its id, or the request object as vLLM passes it;
        ``block_ids`` is accepted for vLLM's signature and unused: the connector tracks them).
        True: store jobs still read its GPU blocks, keep them until ``update_connector_output``
        reports the request released. A request finished twice, or one never announced, is
        counted (``finish_repeats`` / ``finish_unknown``) and ignored (an error when ``strict``)."""
        req_id = request if isinstance(request, str) else request.req_id
        st = self._requests.get(req_id)
        if st is None:
            self._lifecycle.finished(req_id, self.strict)  # not live: counts, or raises when strict
            return False
        if st.finish_called:
            self._lifecycle.finish_repeats += 1
            if self.strict:
                raise RequestLifecycleError(f"OffloadingConnectorScheduler: request {req_id!r} finished twice")
            return bool(st.jobs)
        st.finished = st.finish_called = True
        if st.jobs:
            return True
        self._release(st, None)
        return False

    # --- the step ---------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMetadata:
        """Load jobs, store jobs and jobs to flush for this step; ends with ``on_schedule_end``."""
        meta = ConnectorMetadata()
        try:
            self._build(scheduler_output, meta)
        finally:
            self.steps += 1
            self.manager.on_schedule_end()
        return meta

    def _build(self, so: SchedulerOutput, meta: ConnectorMetadata) -> None:
        meta.load_jobs, self._pending_loads = self._pending_loads, []
        computed: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            self.on_new_request(new.request)
            st = self._requests[new.request.req_id]
            st.block_ids = list(new.block_ids)
            computed[st.ctx.req_id] = new.num_computed_tokens
        for cached in so.scheduled_cached_reqs:
            st = self._requests.get(cached.req_id)
            if st is None:
                self.unknown_requests += 1
                continue
            if cached.resumed_from_preemption:
                st.block_ids = list(cached.new_block_ids)
            else:
                st.block_ids.extend(cached.new_block_ids)
            computed[cached.req_id] = cached.num_computed_tokens
        for req_id, num_computed in computed.items():
            n_sched = so.num_scheduled_tokens.get(req_id, 0)
            job = self._store_job(self._requests[req_id], num_computed + n_sched)
            if job is not None:
                meta.store_jobs.append(job)
        for req_id in so.preempted_req_ids:
            st = self._requests.get(req_id)
            if st is not None:
                meta.jobs_to_flush.update(j for j in st.jobs if self._jobs[j].kind == STORE)
        for req_id in so.finished_req_ids:
            st = self._requests.get(req_id)
            if st is not None:
                st.finished = True
        if all(st.finished for st in self._requests.values()):
            # no further step will come for anyone: every pending job, loads and stores
            meta.jobs_to_flush.update(self._jobs)
        for st in [s for s in self._requests.values() if s.finished and not s.jobs]:
            self._release(st, None)
        self.jobs_flushed += len(meta.jobs_to_flush)

    def _store_job(self, st: _ReqState, computed_after: int) -> TransferJob | None:
        request, k = st.request, self.blocks_per_chunk
        end = min(
            computed_after // self.offloaded_block_size,
            len(request.block_hashes) // k,
            len(st.block_ids) // k,
        )
        if end <= st.next_store_chunk:
            return None
        chunks = range(st.next_store_chunk, end)
        keys = self._chunk_keys(st, chunks)
        out = self.manager.prepare_store(keys, st.ctx)
        if out is None:
            self.store_rejections += 1  # retried the next time the request is scheduled
            return None
        st.next_store_chunk = end
        if not out.keys_to_store:
            return None
        chunk_of = dict(zip(keys, chunks))
        gpu = np.asarray(st.block_ids, dtype=np.int64)
        src = np.concatenate([gpu[chunk_of[key] * k : (chunk_of[key] + 1) * k] for key in out.keys_to_store])
        dst = expand_block_ids(out.store_spec.block_ids, k)
        job = self._new_job(st, STORE, list(out.keys_to_store), src, dst)
        self.store_jobs += 1
        self.blocks_stored += len(out.keys_to_store)
        return job

    def update_connector_output(self, finished_jobs: Iterable[Any] = (), failed_jobs: Iterable[int] = ()) -> ConnectorUpdate:
        """Complete the jobs the worker finished (ids, or results with ``job_id``/``success``)
        and the ones that failed; release finished requests whose jobs are all done."""
        update = ConnectorUpdate()
        outcomes: list[tuple[int, bool]] = []
        for item in finished_jobs:
            if hasattr(item, "job_id"):
                outcomes.append((int(item.job_id), bool(getattr(item, "success", True))))
            else:
                outcomes.append((int(item), True))
        outcomes.extend((int(j), False) for j in failed_jobs)
        touched: list[_ReqState] = []
        for job_id, ok in outcomes:
            job = self._jobs.pop(job_id, None)
            if job is None:
                self.unknown_job_results += 1
                update.errors.append(f"result for unknown job {job_id}")
                continue
            st = self._requests.get(job.req_id)
            ctx = st.ctx if st is not None else ReqContext(job.req_id)
            try:
                if job.kind == STORE:
                    self.manager.complete_store(job.keys, ctx, success=ok)
                else:
                    self.manager.complete_load(job.keys, ctx)
            except Exception as exc:  # counted; the request is still released below
                self.manager_errors += 1
                update.errors.append(f"{job.kind} job {job_id} of {job.req_id}: {type(exc).__name__}: {exc}")
            if job.kind == STORE:
                self.stores_failed += not ok
            else:
                (update.loaded if ok else update.failed_loads).add(job.req_id)
                self.loads_failed += not ok
            if st is not None:
                st.jobs.discard(job_id)
                touched.append(st)
        for st in touched:
            if st.finished and not st.jobs and st.ctx.req_id in self._requests:
                self._release(st, update)
        return update

    def _release(self, st: _ReqState, update: ConnectorUpdate | None) -> None:
        req_id = st.ctx.req_id
        self._lifecycle.finished(req_id)
        try:
            self.manager.on_request_finished(st.ctx)
        finally:
            self._requests.pop(req_id, None)
            self.requests_released += 1
            if update is not None:
                update.released.add(req_id)

    def _new_job(self, st: _ReqState, kind: str, keys: list[OffloadKey], src: np.ndarray, dst: np.ndarray) -> TransferJob:
        job_id = self._next_job_id
        self._next_job_id += 1
        job = TransferJob(job_id, st.ctx.req_id, kind, keys, src, dst)
        self._jobs[job_id] = job
        st.jobs.add(job_id)
        return job

    # --- events -----------------------------------------------------------------------------
    def take_events(self) -> list[KVEvent]:
        """Drain the manager's events as kvevents (hash form per ``int_hashes``)."""
        return offload_events_to_kv_events(self.manager.take_events(), int_hashes=self.int_hashes)
