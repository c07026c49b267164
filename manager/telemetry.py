"""Telemetry of the offload manager: metrics over its counters, spans per step and per job.

* :func:`observe_manager` / :func:`observe_engine`: observable instruments reading the
  primary's and the tiers' plain-int counters (and the simulated engine's); a transfer-job
  probe (a wrapper around ``submit_*``/``get_finished*`` of the engine's transfer worker and
  of each secondary tier) records the job-latency histogram and counts bytes, promotions,
  cascades and failures;
* :func:`instrument_engine` / :func:`instrument_manager`: a span per sampled engine step
  (``kvevents.step``, current while the step runs, so the publisher's send span is its
  child), a span per ``on_schedule_end`` and per transfer job (submit to result) of a
  sampled step.

Sampling (:mod:`kvevents.telemetry.sampling`): a step is traced iff the seq it will publish is,
``publisher.next_seq % sample_every == 0`` at step start (the engine's own published-batch
count when its publisher has no ``next_seq``), so the step span heads the same trace as the
batch's send, receive and process spans. A step that publishes nothing leaves the seq where
it was, so the next step is sampled again: at most :data:`MAX_IDLE_TRACED_STEPS` such steps
are traced in a row per seq. The ``schedule_end`` span and the transfer-job spans are made
only inside a traced step (a job finishing in a later step is traced iff it was submitted in
a traced one). Without an engine (:func:`instrument_manager` alone) one ``on_schedule_end``
call in ``sample_every`` opens a traced step, which lasts until the next call. Untraced
steps and jobs make no OpenTelemetry call.

The job metrics cost per job: a counter and a dict entry at submit, plain-int counts at the
result. The latency histogram is the expensive part (an SDK record costs 10-25 µs in place,
about a tenth of a simulated step, per job), so it is recorded for one job in
``job_sample_every`` per (tier, direction), counted at submit (default
:data:`~kvevents.telemetry.sampling.DEFAULT_HISTOGRAM_SAMPLE_EVERY`); only those jobs take a
timestamp, and their attribute dicts are built once at observe time.

Everything goes through the components' public hooks and stats, and ``close()`` /
:func:`uninstrument` takes it out again: job observers (``TransferWorker.add_job_observer``,
``TieringOffloadingManager.add_job_observer`` per tier), schedule-end observers
(``OffloadingManager.add_schedule_end_observer``) and step observers
(``SimEngine.add_step_observer``). No method is replaced and no private attribute is read.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.metrics import Meter
from opentelemetry.trace import SpanKind, Status, StatusCode

from kvevents.telemetry.instruments import Observation, get_meter, get_tracer, histogram
from kvevents.telemetry.sampling import DEFAULT_HISTOGRAM_SAMPLE_EVERY, check_every, resolve_sample_every

__all__ = ["MAX_IDLE_TRACED_STEPS", "JobProbe", "StepGate", "default_tier_names", "instrument_engine",
           "instrument_manager", "observe_engine", "observe_manager", "uninstrument"]

#: consecutive steps traced at one sampled seq while none of them publishes (bounds the cost
#: of an engine that steps without events); the step that then publishes that seq is untraced
#: and its send span starts its own trace
MAX_IDLE_TRACED_STEPS = 16


class StepGate:
    """Whether the current step is traced: the flag the schedule_end and job wrappers read.

    ``driven``: an engine's step wrapper sets ``traced`` (by the seq the step will publish);
    otherwise the manager's ``on_schedule_end`` wrapper does, one call in ``every``.
    """

    __slots__ = ("every", "driven", "traced", "calls", "idle_seq", "idle")

    def __init__(self, every: int, driven: bool = False) -> None:
        self.every = every
        self.driven = driven
        self.traced = False
        self.calls = 0  # on_schedule_end calls (undriven)
        self.idle_seq = -1  # the seq at which the last traced steps published nothing
        self.idle = 0  # how many in a row

    def step_traced(self, seq: int) -> bool:
        """An engine step starting with ``next_seq == seq``: trace it? (the seq rule, capped)"""
        if seq % self.every:
            return False
        return seq != self.idle_seq or self.idle < MAX_IDLE_TRACED_STEPS

    def step_done(self, seq: int, published: bool) -> None:
        """After a traced step: count it when it published nothing."""
        if published:
            self.idle_seq, self.idle = -1, 0
        elif seq == self.idle_seq:
            self.idle += 1
        else:
            self.idle_seq, self.idle = seq, 1


def default_tier_names(mgr: Any) -> list[str]:
    """``[primary, *secondary]``: each tier's medium, its tier_type where two share a medium."""
    primary = getattr(mgr, "primary_tier", mgr)
    names = [str(getattr(primary, "medium", "CPU"))]
    tiers = _tiers(mgr)
    media = [str(getattr(t, "medium", "STORAGE")) for t in tiers]
    for t, m in zip(tiers, media):
        names.append(m if media.count(m) == 1 and m != names[0] else f"{m}/{getattr(t, 'tier_type', len(names))}")
    return names


class JobProbe:
    """A job observer of a transfer worker or of one secondary tier: submit time per job, and
    on each result the latency histogram, plain-int counts by direction, and (when tracing)
    the job's span. ``detach`` removes it from what it observes (called by :meth:`close`)."""

    def __init__(self, tier: str, kind: str, bytes_per_block, detach=None) -> None:
        self.tier = tier
        self.kind = kind  # "worker" (GPU<->primary) or "tier" (primary<->secondary)
        self.bytes_per_block = bytes_per_block  # callable -> int
        self.jobs: dict[int, tuple[int, str, int, Any]] = {}  # job id -> (t0 ns, direction, blocks, span)
        self.ok_blocks = {"store": 0, "load": 0}
        self.bytes = {"store": 0, "load": 0}
        self.failures = {"store": 0, "load": 0}
        self.unknown_results = 0
        self.hist = None
        self.hist_attrs: dict[str, dict] = {}
        self.hist_every = 1  #: latency timed for every hist_every-th job submitted per direction
        self.submitted = {"store": 0, "load": 0}
        self.tracer: trace.Tracer | None = None
        self.gate: StepGate | None = None  #: jobs get spans only while gate.traced (set with tracer)
        self.engine = ""
        self._detach = detach

    # the job-observer hooks
    def job_submitted(self, job_id: int, direction: str, blocks: int) -> None:
        self._start(job_id, direction, blocks)

    def job_finished(self, job_id: int, success: bool, error: str | None) -> None:
        self._done(job_id, success, error)

    def _start(self, job_id: int, direction: str, blocks: int) -> None:
        span = None
        if self.tracer is not None and self.gate.traced:
            span = self.tracer.start_span(
                f"transfer {direction}", kind=SpanKind.INTERNAL,
                attributes={"kvevents.transfer.direction": direction, "kvevents.tier": self.tier,
                            "kvevents.transfer.blocks": blocks, "kvevents.transfer.job_id": int(job_id),
                            "kvevents.engine": self.engine})
        n = self.submitted[direction]
        self.submitted[direction] = n + 1
        self.jobs[int(job_id)] = (None if n % self.hist_every else time.perf_counter_ns(), direction, blocks, span)

    def _done(self, job_id: int, success: bool, error: str | None) -> None:
        entry = self.jobs.pop(int(job_id), None)
        if entry is None:
            self.unknown_results += 1
            return
        t0, direction, blocks, span = entry
        nbytes = blocks * (self.bytes_per_block() or 0)
        if success:
            self.ok_blocks[direction] += blocks
            self.bytes[direction] += nbytes
        else:
            self.failures[direction] += 1
        hist = self.hist
        if hist is not None and t0 is not None:
            attrs = self.hist_attrs.get(direction)
            if attrs is None:
                attrs = self.hist_attrs[direction] = {"engine": self.engine, "tier": self.tier, "direction": direction}
            hist.record((time.perf_counter_ns() - t0) / 1e9, attrs)
        if span is not None:
            span.set_attribute("kvevents.transfer.bytes", nbytes)
            span.set_attribute("kvevents.transfer.success", bool(success))
            if not success:
                span.set_status(Status(StatusCode.ERROR, error or "transfer failed"))
            span.end()

    def close(self) -> None:
        detach, self._detach = self._detach, None
        if detach is not None:
            detach()


#: one probe per observed worker or tier, shared by metrics and tracing (gone with its target)
_PROBES: weakref.WeakKeyDictionary[Any, JobProbe] = weakref.WeakKeyDictionary()


def _worker_probe(worker: Any, tier: str) -> JobProbe:
    p = _PROBES.get(worker)
    if p is None:
        def detach() -> None:
            worker.remove_job_observer(p)
            _PROBES.pop(worker, None)

        p = JobProbe(tier, "worker", lambda: worker.bytes_per_block, detach)
        worker.add_job_observer(p)
        _PROBES[worker] = p
    return p


def _tier_probe(mgr: Any, index: int, tier: Any, name: str) -> JobProbe:
    p = _PROBES.get(tier)
    if p is None:
        def detach() -> None:
            mgr.remove_job_observer(index, p)
            _PROBES.pop(tier, None)

        p = JobProbe(name, "tier", lambda: getattr(tier.block_io, "block_nbytes", 0), detach)
        mgr.add_job_observer(index, p)
        _PROBES[tier] = p
    return p


def _tiers(mgr: Any) -> list[Any]:
    """The secondary tiers of a tiering manager (none for a primary alone)."""
    return list(getattr(mgr, "secondary_tiers", ()))


def _probes(mgr: Any, names: list[str], worker: Any = None) -> list[JobProbe]:
    out = []
    if worker is not None:
        out.append(_worker_probe(worker, names[0]))
    for i, (tier, name) in enumerate(zip(_tiers(mgr), names[1:])):
        out.append(_tier_probe(mgr, i, tier, name))
    return out


def observe_manager(mgr: Any, tier_names: list[str] | None = None, meter: Meter | None = None, *,
                    engine: str = "engine0", connector: Any = None, worker: Any = None,
                    job_sample_every: int = DEFAULT_HISTOGRAM_SAMPLE_EVERY) -> Observation:
    """Observable instruments over a manager (a primary alone, or a TieringOffloadingManager).

    ``tier_names``: ``[primary, *secondary]`` (default :func:`default_tier_names`);
    ``engine``: the ``engine`` attribute; ``connector``/``worker``: the scheduler connector and
    the transfer worker, when known (:func:`observe_engine` passes them);
    ``job_sample_every``: the job-latency histogram records every n-th job submitted per
    (tier, direction) (1: every job; the counts of blocks, bytes and failures are exact).
    """
    check_every(job_sample_every, "job_sample_every")
    meter = get_meter(meter)
    names = list(tier_names) if tier_names else default_tier_names(mgr)
    primary = getattr(mgr, "primary_tier", mgr)
    tiers = _tiers(mgr)
    if len(names) != 1 + len(tiers):
        raise ValueError(f"tier_names needs {1 + len(tiers)} names (primary, then each tier), got {names!r}")
    obs = Observation(mgr)
    A = {n: {"engine": engine, "tier": n} for n in names}
    probes = _probes(mgr, names, worker)
    hist = histogram(meter, "kvevents.manager.job.duration")
    for p in probes:
        p.hist, p.engine, p.hist_every = hist, engine, job_sample_every
        p.hist_attrs = {d: {"engine": engine, "tier": p.tier, "direction": d} for d in ("store", "load")}
    by_tier = {p.tier: p for p in probes if p.kind == "tier"}

    def pstat(key: str) -> int:
        v = getattr(primary, key, None)
        return v if isinstance(v, int) else int(primary.stats().get(key, 0))

    def tier_counter(attr: str, fallback):
        out = []
        for t, n in zip(tiers, names[1:]):
            v = getattr(t, attr, None)
            if not isinstance(v, int):
                v = fallback(by_tier[n])
            if v is not None:
                out.append((v, A[n]))
        return out

    def stores():
        return [(pstat("stores_completed"), A[names[0]])] + tier_counter("stores", lambda p: p.ok_blocks["store"])

    def loads():
        first = connector.blocks_loaded if connector is not None else pstat("loads")
        return [(first, A[names[0]])] + tier_counter("loads", lambda p: p.ok_blocks["load"])

    def used():
        n = getattr(primary, "num_blocks", None)
        out = []
        if isinstance(n, int):
            out.append((n - primary.num_free_blocks, A[names[0]]))
        for t, name in zip(tiers, names[1:]):
            held = t.get_num_blocks()
            out.append((held if held is not None else len(t.cached_keys()), A[name]))
        return out

    def capacity():
        n = getattr(primary, "num_blocks", None)
        out = [(n, A[names[0]])] if isinstance(n, int) else []
        for t, name in zip(tiers, names[1:]):
            c = getattr(t, "capacity_blocks", None)
            if isinstance(c, int):
                out.append((c, A[name]))
        return out

    DA = {(n, d): {"engine": engine, "tier": n, "direction": d} for n in names for d in ("store", "load")}

    def per_probe(field: str):
        return lambda: [(getattr(p, field)[d], DA[(p.tier, d)]) for p in probes for d in ("store", "load")]

    obs.add(meter, "kvevents.manager.stores", stores)
    obs.add(meter, "kvevents.manager.loads", loads)
    obs.add(meter, "kvevents.manager.evictions",
            lambda: [(pstat("evictions"), A[names[0]])] + tier_counter("evictions", lambda p: None))
    obs.add(meter, "kvevents.manager.stores.not_admitted", lambda: [(pstat("stores_not_admitted"), A[names[0]])])
    obs.add(meter, "kvevents.manager.blocks.used", used)
    obs.add(meter, "kvevents.manager.blocks.capacity", capacity)
    obs.add(meter, "kvevents.manager.bytes", per_probe("bytes"))
    obs.add(meter, "kvevents.manager.job.failures", per_probe("failures"))
    obs.add(meter, "kvevents.manager.promotions",
            lambda: [(p.ok_blocks["load"], A[p.tier]) for p in probes if p.kind == "tier"])
    obs.add(meter, "kvevents.manager.cascades",
            lambda: [(p.ok_blocks["store"], A[p.tier]) for p in probes if p.kind == "tier"])
    obs.add(meter, "kvevents.manager.stores.skipped", lambda: tier_counter("blocks_skipped", lambda p: None))
    obs.add(meter, "kvevents.manager.lookups.pending", lambda: tier_counter("lookups_pending", lambda p: None))
    faults = {"store_error": "store_errors", "load_error": "load_errors", "corrupt": "corrupt_files",
              "scan_error": "scan_errors", "punch_error": "punch_errors"}
    FA = {(n, k): {"engine": engine, "tier": n, "kind": k} for n in names[1:] for k in faults}

    def tier_faults():
        out = []
        for t, n in zip(tiers, names[1:]):
            st = t.stats() if hasattr(t, "stats") else {}
            out += [(st[key], FA[(n, kind)]) for kind, key in faults.items() if isinstance(st.get(key), int)]
        return out

    obs.add(meter, "kvevents.manager.tier.faults", tier_faults)
    obs.add(meter, "kvevents.manager.store.backlog",
            lambda: [(t.store_backlog(), A[n]) for t, n in zip(tiers, names[1:]) if hasattr(t, "store_backlog")])
    ea = {"engine": engine}
    if connector is not None:
        obs.add(meter, "kvevents.manager.steps", lambda: [(connector.steps, ea)])
    ignored_from = [c.stats for c in (connector, mgr) if c is not None and hasattr(c, "stats")]
    reasons = {"repeat": "finish_repeats", "unknown": "finish_unknown"}
    RA = {r: {"engine": engine, "reason": r} for r in reasons}

    def ignored():
        stats = [f() for f in ignored_from]
        return [(sum(st.get(key, 0) for st in stats), RA[r]) for r, key in reasons.items()]

    obs.add(meter, "kvevents.manager.requests.ignored", ignored)

    def stop():
        for p in probes:
            p.hist = None
            if p.tracer is None:
                p.close()

    obs.on_close(stop)
    return obs


def observe_engine(engine: Any, meter: Meter | None = None, *, name: str = "engine0",
                   tier_names: list[str] | None = None,
                   job_sample_every: int = DEFAULT_HISTOGRAM_SAMPLE_EVERY) -> Observation:
    """:func:`observe_manager` over ``engine.manager`` (with its connector and transfer worker)
    plus the engine's token and request counters."""
    meter = get_meter(meter)
    obs = observe_manager(engine.manager, tier_names, meter, engine=name, connector=engine.connector,
                          worker=engine.worker, job_sample_every=job_sample_every)
    kinds = {"computed": "computed_tokens", "gpu_hit": "gpu_hit_tokens", "offload_hit": "offload_hit_tokens"}
    ka = {k: {"engine": name, "kind": k} for k in kinds}
    ea = {"engine": name}
    obs.add(meter, "kvevents.engine.tokens", lambda: [(getattr(engine, a), ka[k]) for k, a in kinds.items()])
    obs.add(meter, "kvevents.engine.requests", lambda: [(engine.requests_finished, ea)])
    return obs


# ---- tracing ---------------------------------------------------------------------------------

class _Traced:
    def __init__(self) -> None:
        self.undo: list = []
        self.probes: list[JobProbe] = []
        self.gate: StepGate | None = None

    def close(self) -> None:
        for fn in reversed(self.undo):
            fn()
        self.undo.clear()
        for p in self.probes:
            p.tracer = None
            if p.hist is None:
                p.close()


def instrument_manager(mgr: Any, tier_names: list[str] | None = None, *, engine: str = "engine0",
                       worker: Any = None, tracer_provider: trace.TracerProvider | None = None,
                       sample_every: int | None = None, gate: StepGate | None = None) -> _Traced:
    """A span per ``on_schedule_end`` and per transfer job of the traced steps; ``close()``
    removes them. Without ``gate`` (an engine's), one ``on_schedule_end`` call in
    ``sample_every`` starts a traced step that lasts until the next call."""
    tracer = get_tracer(tracer_provider)
    names = list(tier_names) if tier_names else default_tier_names(mgr)
    if gate is None:
        gate = StepGate(resolve_sample_every(sample_every))
    t = _Traced()
    t.gate = gate
    t.probes = _probes(mgr, names, worker)
    for p in t.probes:
        p.tracer, p.engine, p.gate = tracer, engine, gate
    obs = _ScheduleEndSpans(mgr, tracer, gate, t.probes, engine)
    mgr.add_schedule_end_observer(obs)
    t.undo.append(lambda: mgr.remove_schedule_end_observer(obs))
    return t


class _ScheduleEndSpans:
    """A schedule-end observer: a span around each traced ``on_schedule_end``."""

    def __init__(self, mgr: Any, tracer: trace.Tracer, gate: StepGate, probes: list[JobProbe], engine: str) -> None:
        self.mgr, self.tracer, self.gate, self.engine = mgr, tracer, gate, engine
        self.tier_probes = [p for p in probes if p.kind == "tier"]

    def schedule_end_started(self) -> Any:
        gate = self.gate
        if not gate.driven:
            n = gate.calls
            gate.calls = n + 1
            gate.traced = n % gate.every == 0
        if not gate.traced:
            return None
        span = self.tracer.start_span("kvevents.manager.schedule_end", kind=SpanKind.INTERNAL)
        token = otel_context.attach(trace.set_span_in_context(span))
        return span, token, sum(len(p.jobs) for p in self.tier_probes)

    def schedule_end_finished(self, state: Any) -> None:
        if state is None:
            return
        span, token, before = state
        try:
            if span.is_recording():
                span.set_attribute("kvevents.engine", self.engine)
                span.set_attribute("kvevents.manager.tier_jobs_submitted",
                                   max(0, sum(len(p.jobs) for p in self.tier_probes) - before))
                stats = getattr(self.mgr, "stats", None)
                in_flight = stats().get("jobs_in_flight") if stats is not None else None
                if isinstance(in_flight, int):
                    span.set_attribute("kvevents.manager.tier_jobs_in_flight", in_flight)
        finally:
            otel_context.detach(token)
            span.end()


_STEP_ATTRS = ("scheduled_new", "scheduled_running", "preempted", "finished", "computed_tokens", "gpu_hit_tokens",
               "offload_hit_tokens", "load_jobs", "store_jobs", "jobs_flushed", "gpu_events", "offload_events",
               "published")


def instrument_engine(engine: Any, *, name: str = "engine0", tier_names: list[str] | None = None,
                      tracer_provider: trace.TracerProvider | None = None,
                      sample_every: int | None = None) -> _Traced:
    """A span ``kvevents.step`` per traced ``engine.step()`` (current while it runs: the
    connector's ``on_schedule_end`` span, the transfer-job spans and the publisher's send span
    are its children) with the step's figures (jobs flushed, jobs, events); a step is traced
    iff ``publisher.next_seq % sample_every == 0`` at its start. ``close()`` removes it."""
    tracer = get_tracer(tracer_provider)
    gate = StepGate(resolve_sample_every(sample_every), driven=True)
    t = instrument_manager(engine.manager, tier_names, engine=name, worker=engine.worker,
                           tracer_provider=tracer_provider, gate=gate)
    obs = _StepSpans(engine, tracer, gate, name)
    engine.add_step_observer(obs)
    t.undo.append(lambda: engine.remove_step_observer(obs))
    return t


class _StepSpans:
    """A step observer: the ``kvevents.step`` span of each traced step, current while it runs."""

    def __init__(self, engine: Any, tracer: trace.Tracer, gate: StepGate, name: str) -> None:
        self.engine, self.tracer, self.gate, self.name = engine, tracer, gate, name

    def step_started(self) -> Any:
        engine, gate = self.engine, self.gate
        seq = getattr(engine.publisher, "next_seq", None)
        if seq is None:  # no publisher, or one without a seq: the engine's own count
            seq = engine.batches_published
        if seq % gate.every or not gate.step_traced(seq):
            return None
        gate.traced = True
        span = self.tracer.start_span("kvevents.step", kind=SpanKind.INTERNAL)
        return seq, span, otel_context.attach(trace.set_span_in_context(span))

    def step_finished(self, state: Any, st: Any, exc: BaseException | None) -> None:
        if state is None:
            return
        seq, span, token = state
        try:
            if exc is not None:
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            elif span.is_recording():
                span.set_attribute("kvevents.engine", self.name)
                span.set_attribute("kvevents.step", st.step)
                for a in _STEP_ATTRS:
                    span.set_attribute(f"kvevents.step.{a}", getattr(st, a))
        finally:
            otel_context.detach(token)
            span.end()
            self.gate.traced = False
        if st is not None:
            self.gate.step_done(seq, st.published)


def uninstrument(traced: _Traced) -> None:
    traced.close()
