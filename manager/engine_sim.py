"""A small simulated engine: the loop that drives the offload stack end to end.

``SimEngine(spec, publisher, gpu_blocks=..., block_size=16, offload_block_size=...)`` is
configured with an :class:`~manager.spec.OffloadingSpec` (or a ready manager, wrapped in a
:class:`~manager.spec.ManagerSpec`): the spec's manager goes under an
:class:`~manager.connector.OffloadingConnectorScheduler`, and its handlers (the transfer
worker and the host buffer's block I/O) are built over the engine's device KV tensor
(:mod:`manager.sim_device`: torch when importable, else numpy, so the base package runs it
without torch). It keeps a GPU prefix cache (:mod:`manager.prefix_cache`). Each
:meth:`SimEngine.step`:

1. schedules: running requests first (a decode token each, or the rest of their prefill),
   preempting the newest running request when GPU blocks run out; then waiting requests in
   order, each with its GPU prefix hit and the connector's offload hit (a hit starts an
   asynchronous load; the request runs once it lands);
2. ``build_connector_meta``; waits for the jobs to flush that are in flight; submits loads;
   "computes" (writes a value derived from each block's hash into the device rows, so a
   load can be checked against what was stored); submits stores;
3. completes what the worker finished through ``update_connector_output``, frees the GPU
   blocks of released requests;
4. publishes the step's GPU events and the connector's offload events as ONE
   :class:`~kvevents.events.KVEventBatch` (:func:`manager.wire.assemble_batch`) through the
   publisher (if there are any).
"""

from __future__ import annotations

import collections
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from kvevents.publisher_base import EventPublisher

from .base import OffloadingManager
from .connector import OffloadingConnectorScheduler
from .connector_types import CachedRequestData, EngineRequest, NewRequestData, SchedulerOutput
from .hashing import hash_request_blocks
from .prefix_cache import GPUPrefixCache
from .sim_device import make_device
from .spec import ManagerSpec, OffloadingSpec
from .wire import assemble_batch

__all__ = ["SimEngine", "StepStats"]

WAITING, LOADING, RUNNING, DONE = "waiting", "loading", "running", "done"


@dataclass(slots=True)
class StepStats:
    """What one step did (blocks counted in GPU blocks, events in wire events)."""

    step: int
    scheduled_new: int = 0
    scheduled_running: int = 0
    preempted: int = 0
    finished: int = 0
    computed_tokens: int = 0
    gpu_hit_tokens: int = 0
    offload_hit_tokens: int = 0
    load_jobs: int = 0
    store_jobs: int = 0
    jobs_flushed: int = 0
    gpu_events: int = 0
    offload_events: int = 0
    published: bool = False


@dataclass(slots=True, eq=False)
class _SimRequest:
    engine: EngineRequest
    token_ids: list[int]
    max_new_tokens: int
    lora_id: int | None
    seed: int
    state: str = WAITING
    block_ids: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0
    pending_external: int = 0
    output_tokens: int = 0

    @property
    def req_id(self) -> str:
        return self.engine.req_id


def block_value(block_hash: bytes) -> int:
    """The value the simulated model writes into a full block's rows (positive int64)."""
    return int.from_bytes(block_hash[:8], "little") >> 1


class SimEngine:
    """A deterministic engine loop over a real connector, manager and transfer worker."""

    def __init__(
        self,
        spec: OffloadingSpec | OffloadingManager,
        publisher: EventPublisher | None = None,
        *,
        gpu_blocks: int = 256,
        block_size: int = 16,
        offload_block_size: int | None = None,
        host_blocks: int | None = None,
        max_num_seqs: int = 16,
        max_tokens_per_step: int = 8192,
        row_elems: int = 8,
        use_torch: bool | None = None,
        device: str = "cpu",
        sync_transfers: bool = False,
        int_hashes: bool = True,
        vocab_size: int = 32000,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not isinstance(spec, OffloadingSpec):
            spec = ManagerSpec(spec)  # a manager built by hand
        self.spec = spec
        self.manager = manager = spec.get_manager()
        self.publisher = publisher
        self.block_size = block_size
        self.offload_block_size = offload_block_size or spec.offloaded_block_size or block_size
        self.connector = OffloadingConnectorScheduler(
            manager, block_size, self.offload_block_size, int_hashes=int_hashes
        )
        self.gpu = GPUPrefixCache(gpu_blocks, block_size, int_hashes=int_hashes)
        self.max_num_seqs = max_num_seqs
        self.max_tokens_per_step = max_tokens_per_step
        self.sync_transfers = sync_transfers
        self.vocab_size = vocab_size
        self.clock = clock
        self.device = make_device(gpu_blocks, row_elems, use_torch, device)
        self.backend = self.device.backend
        self.handlers = spec.create_handlers(
            self.device.tensor, blocks_per_chunk=self.connector.blocks_per_chunk, host_blocks=host_blocks
        )
        self.worker = self.handlers.worker
        #: the host buffer one offloaded block per row (what the manager's tiers read and write)
        self.host_block_io = self.handlers.host_block_io
        self.step_observers: tuple[Any, ...] = ()
        #: callables ``f(req_id)``, run inside ``step()`` once a request has generated its last
        #: token (its blocks may still be freed later, after pending stores): how a server learns
        #: a request is done without reading the engine's request table
        self.on_request_finished: list[Callable[[str], None]] = []
        self._requests: dict[str, _SimRequest] = {}
        self._waiting: collections.deque[_SimRequest] = collections.deque()
        self._running: list[_SimRequest] = []
        self._loading: dict[str, _SimRequest] = {}
        self._deferred_free: dict[str, _SimRequest] = {}
        self._finished_ids: set[str] = set()
        self._lora_ids: dict[str, int] = {}
        # counters
        self.steps = 0
        self.requests_added = 0
        self.requests_finished = 0
        self.preemptions = 0
        self.computed_tokens = 0
        self.gpu_hit_tokens = 0
        self.offload_hit_tokens = 0
        self.batches_published = 0
        self.events_published = 0
        self.load_failures = 0
        self.load_verify_failures = 0
        self.store_failures = 0
        self.lookup_retries = 0

    # --- the API ----------------------------------------------------------------------------
    def add_request(
        self, req_id: str, token_ids: Sequence[int], lora_name: str | None = None, max_new_tokens: int = 1
    ) -> None:
        """Queue a request; it finishes after ``max_new_tokens`` generated tokens."""
        if req_id in self._requests or req_id in self.connector.tracked_requests():
            raise ValueError(f"request {req_id!r} already exists")
        if len(token_ids) < 1:
            raise ValueError(f"request {req_id!r} has no tokens")
        tokens = [int(t) for t in token_ids]
        need = -(-(len(tokens) + max_new_tokens) // self.block_size)
        if need > self.gpu.num_blocks:
            raise ValueError(f"request {req_id!r} needs {need} GPU blocks, the engine has {self.gpu.num_blocks}")
        lora_id = None
        if lora_name is not None:
            lora_id = self._lora_ids.setdefault(lora_name, len(self._lora_ids) + 1)
        eng = EngineRequest(
            req_id, hash_request_blocks(tokens, self.block_size, lora_name), len(tokens), lora_name=lora_name
        )
        r = _SimRequest(eng, tokens, max(1, max_new_tokens), lora_id, zlib.crc32(req_id.encode()))
        self.connector.on_new_request(eng)  # once, when the scheduler adds it (as vLLM's does)
        self._requests[req_id] = r
        self._waiting.append(r)
        self.requests_added += 1

    def has_work(self) -> bool:
        return bool(
            self._waiting
            or self._running
            or self._loading
            or self._deferred_free
            or self._finished_ids
            or self.connector.has_pending_jobs()
            or self.worker.in_flight()
            or self.manager.has_pending_work()
        )

    def run_until_idle(self, max_steps: int = 100_000) -> list[StepStats]:
        """Step until no request, job or tier work remains; RuntimeError after ``max_steps``."""
        out = []
        while self.has_work():
            if len(out) >= max_steps:
                raise RuntimeError(f"engine still busy after {max_steps} steps: {self.stats()}")
            out.append(self.step())
        return out

    def shutdown(self) -> None:
        self.worker.shutdown()

    def stats(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "requests_added": self.requests_added,
            "requests_finished": self.requests_finished,
            "preemptions": self.preemptions,
            "computed_tokens": self.computed_tokens,
            "gpu_hit_tokens": self.gpu_hit_tokens,
            "offload_hit_tokens": self.offload_hit_tokens,
            "batches_published": self.batches_published,
            "events_published": self.events_published,
            "load_failures": self.load_failures,
            "load_verify_failures": self.load_verify_failures,
            "store_failures": self.store_failures,
            "lookup_retries": self.lookup_retries,
            "gpu_evictions": self.gpu.evictions,
            "backend": self.backend,
            "connector": self.connector.stats(),
            "transfer": self.worker.stats(),
        }

    # --- one step ---------------------------------------------------------------------------
    def add_step_observer(self, observer: Any) -> None:
        """``observer`` brackets every step from now on: ``step_started() -> state`` before it,
        ``step_finished(state, stats, exc)`` after it (``stats`` None and ``exc`` set when the
        step raised). Telemetry's step span is one."""
        self.step_observers = (*self.step_observers, observer)

    def remove_step_observer(self, observer: Any) -> None:
        self.step_observers = tuple(o for o in self.step_observers if o is not observer)

    def step(self) -> StepStats:
        """One engine step (see the module's docstring)."""
        observers = self.step_observers
        if not observers:
            return self._step()
        states = [o.step_started() for o in observers]
        try:
            st = self._step()
        except BaseException as exc:
            for o, state in zip(reversed(observers), reversed(states)):
                o.step_finished(state, None, exc)
            raise
        for o, state in zip(reversed(observers), reversed(states)):
            o.step_finished(state, st, None)
        return st

    def _step(self) -> StepStats:
        st = StepStats(self.steps)
        self.steps += 1
        so = self._schedule(st)
        meta = self.connector.build_connector_meta(so)
        st.load_jobs, st.store_jobs = len(meta.load_jobs), len(meta.store_jobs)
        st.jobs_flushed = len(meta.jobs_to_flush)
        in_flight = self.worker.in_flight()
        if meta.jobs_to_flush & in_flight:  # blocks freed by preemption are about to be reused
            self.worker.wait(meta.jobs_to_flush & in_flight)
        for job in meta.load_jobs:
            self.worker.submit_load(job.job_id, job.src_block_ids, job.dst_block_ids)
        self._compute(so, st)
        for job in meta.store_jobs:
            self.worker.submit_store(job.job_id, job.src_block_ids, job.dst_block_ids)
        submitted = {j.job_id for j in meta.load_jobs} | {j.job_id for j in meta.store_jobs}
        if self.sync_transfers:
            self.worker.wait(submitted)
        elif meta.jobs_to_flush & submitted:
            self.worker.wait(meta.jobs_to_flush & submitted)
        if not so.num_scheduled_tokens and not submitted:  # nothing ran: only jobs can make progress
            if self.worker.in_flight():
                self.worker.wait()
            elif self.manager.has_pending_work():
                time.sleep(0.0005)  # a tier's background I/O: do not spin hot
        self._complete(self.worker.get_finished())
        self._publish(st)
        return st

    def _schedule(self, st: StepStats) -> SchedulerOutput:
        so = SchedulerOutput(finished_req_ids=self._finished_ids)
        self._finished_ids = set()
        budget = self.max_tokens_per_step
        bs = self.block_size
        for r in list(self._running):
            if r.state != RUNNING or budget <= 0:
                continue
            eng = r.engine
            n = min(eng.num_tokens - eng.num_computed_tokens, budget)
            need = -(-(eng.num_computed_tokens + n) // bs) - len(r.block_ids)
            while need > 0 and not self.gpu.can_allocate((), need):
                victim = self._running[-1]
                self._preempt(victim, so, st)
                if victim is r:
                    break
            if r.state != RUNNING:
                continue
            new_ids = self.gpu.allocate((), need) if need > 0 else []
            r.block_ids.extend(new_ids)
            so.scheduled_cached_reqs.append(CachedRequestData(r.req_id, new_ids, eng.num_computed_tokens))
            so.num_scheduled_tokens[r.req_id] = n
            budget -= n
            st.scheduled_running += 1
        while self._waiting and len(self._running) < self.max_num_seqs and budget > 0:
            r = self._waiting[0]
            eng = r.engine
            hits = self.gpu.find_prefix(eng.block_hashes, (eng.num_tokens - 1) // bs)
            num_computed = len(hits) * bs
            ext, _ = self.connector.get_num_new_matched_tokens(eng, num_computed)
            if ext is None:  # a tier is promoting its blocks: first come, first served, so the
                self.lookup_retries += 1  # queue waits for it rather than thrash the primary
                break
            total = -(-eng.num_tokens // bs)
            if not self.gpu.can_allocate(hits, total - len(hits)):
                break
            self._waiting.popleft()
            r.block_ids = self.gpu.allocate(hits, total - len(hits))
            r.num_cached_blocks = len(hits)
            eng.num_computed_tokens = num_computed
            self.connector.update_state_after_alloc(eng, r.block_ids, ext)
            st.gpu_hit_tokens += num_computed
            self.gpu_hit_tokens += num_computed
            if ext > 0:
                r.state, r.pending_external = LOADING, ext
                self._loading[r.req_id] = r
                st.offload_hit_tokens += ext
                self.offload_hit_tokens += ext
                continue
            r.state = RUNNING
            self._running.append(r)
            n = min(eng.num_tokens - num_computed, budget)
            so.scheduled_new_reqs.append(NewRequestData(eng, list(r.block_ids), num_computed))
            so.num_scheduled_tokens[r.req_id] = n
            budget -= n
            st.scheduled_new += 1
        return so

    def _preempt(self, r: _SimRequest, so: SchedulerOutput, st: StepStats) -> None:
        self._running.remove(r)
        self.gpu.free(r.block_ids)
        r.block_ids, r.num_cached_blocks, r.state = [], 0, WAITING
        r.engine.num_computed_tokens = 0
        so.preempted_req_ids.add(r.req_id)
        so.num_scheduled_tokens.pop(r.req_id, None)
        so.scheduled_cached_reqs = [c for c in so.scheduled_cached_reqs if c.req_id != r.req_id]
        self._waiting.appendleft(r)
        self.preemptions += 1
        st.preempted += 1

    def _compute(self, so: SchedulerOutput, st: StepStats) -> None:
        bs = self.block_size
        rows: list[int] = []
        vals: list[int] = []
        for req_id, n in so.num_scheduled_tokens.items():
            r = self._requests[req_id]
            eng = r.engine
            lo, hi = eng.num_computed_tokens, eng.num_computed_tokens + n
            for b in range(lo // bs, hi // bs):
                if b < len(eng.block_hashes):
                    rows.append(r.block_ids[b])
                    vals.append(block_value(eng.block_hashes[b]))
            eng.num_computed_tokens = hi
            st.computed_tokens += n
            self.computed_tokens += n
            self._cache_full_blocks(r)
            if hi >= eng.num_tokens:  # the step produced a token
                self._generate(r, st)
        if rows:
            self.device.write_rows(rows, vals)

    def _generate(self, r: _SimRequest, st: StepStats) -> None:
        r.output_tokens += 1
        if r.output_tokens >= r.max_new_tokens:
            self._finish(r, st)
            return
        eng = r.engine
        r.token_ids.append((r.seed * 1103515245 + r.output_tokens * 12345) % self.vocab_size)
        eng.num_tokens += 1
        have = len(eng.block_hashes)
        if len(r.token_ids) // self.block_size > have:
            parent = eng.block_hashes[-1] if have else None
            eng.block_hashes.extend(
                hash_request_blocks(r.token_ids, self.block_size, eng.lora_name, start=have, parent=parent)
            )

    def _finish(self, r: _SimRequest, st: StepStats) -> None:
        r.state = DONE
        r.engine.finished = True
        self._running.remove(r)
        self._finished_ids.add(r.req_id)
        self.requests_finished += 1
        st.finished += 1
        del self._requests[r.req_id]
        if self.connector.request_finished(r.req_id):
            self._deferred_free[r.req_id] = r  # stores still read its blocks
        else:
            self.gpu.free(r.block_ids)
        for f in self.on_request_finished:
            f(r.req_id)

    def _cache_full_blocks(self, r: _SimRequest) -> None:
        eng, bs = r.engine, self.block_size
        end = min(eng.num_computed_tokens // bs, len(eng.block_hashes))
        start = r.num_cached_blocks
        if end <= start:
            return
        self.gpu.cache_blocks(
            r.block_ids[start:end],
            eng.block_hashes[start:end],
            r.token_ids[start * bs : end * bs],
            eng.block_hashes[start - 1] if start else None,
            lora_id=r.lora_id,
            lora_name=eng.lora_name,
        )
        r.num_cached_blocks = end

    def _complete(self, results: list) -> None:
        for res in results:
            if not res.success:
                if res.direction == "load":
                    self.load_failures += 1
                else:
                    self.store_failures += 1
        upd = self.connector.update_connector_output(results)
        bs = self.block_size
        for req_id in upd.loaded | upd.failed_loads:
            r = self._loading.pop(req_id, None)
            if r is None:
                continue
            eng = r.engine
            if req_id in upd.loaded:
                lo, hi = eng.num_computed_tokens // bs, (eng.num_computed_tokens + r.pending_external) // bs
                got = self.device.read_rows(r.block_ids[lo:hi])
                want = np.array([block_value(h) for h in eng.block_hashes[lo:hi]], dtype=np.int64)
                self.load_verify_failures += int(np.count_nonzero(got[:, 0] != want) if len(want) else 0)
                eng.num_computed_tokens += r.pending_external
                self._cache_full_blocks(r)
            r.pending_external = 0
            r.state = RUNNING
            self._running.append(r)
        for req_id in upd.released:
            r = self._deferred_free.pop(req_id, None)
            if r is not None:
                self.gpu.free(r.block_ids)

    def _publish(self, st: StepStats) -> None:
        gpu_events = self.gpu.take_events()
        off_events = self.connector.take_events()
        st.gpu_events, st.offload_events = len(gpu_events), len(off_events)
        if self.publisher is None:
            return
        batch = assemble_batch(gpu_events, off_events, ts=self.clock(),
                               data_parallel_rank=getattr(self.publisher, "data_parallel_rank", None))
        if batch is None:
            return
        self.publisher.publish(batch)
        self.batches_published += 1
        self.events_published += len(batch.events)
        st.published = True
