"""Telemetry of the router: metrics over its counters and index, score and process spans.

* :func:`observe_router`: observable instruments over ``router.stats`` and the index; a
  score wrapper counts lookups, prompt tokens and the best pod's matched tokens per tier
  (plain ints). Entries and memory per tier come from a scan of the index, done at most once
  per ``refresh_interval`` seconds (it is O(keys)).
* :func:`instrument_router`: a ``process <topic>`` span (CONSUMER) per sampled delivery
  handled, child of the subscriber's receive span when it ran in this process, and a
  ``kvevents.router.score`` span for one score()/pick() call in ``sample_every``.

Sampling (:mod:`kvevents.telemetry.sampling`): a BATCH delivery is traced iff
``seq % sample_every == 0``, the publisher's and the subscriber's rule, so the router's spans
complete the same traces; RESET and GAP deliveries (rare) are always traced. Score spans are
taken by a call counter. The decision comes first: an untraced call makes no OpenTelemetry
call, builds no attribute dict and captures no context.

Both are wrappers of the router's parts' roles (a traced scorer, a traced feed) put in its
``scorer`` / ``feed`` places; ``close()`` puts the originals back. Nothing reads private state.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from opentelemetry import trace
from opentelemetry.metrics import Meter
from opentelemetry.trace import Link, SpanKind, Status, StatusCode

from kvevents.delivery import DeliveryKind
from kvevents.telemetry.instruments import Observation, attribute_cache, get_meter, get_tracer
from kvevents.telemetry.messaging import MESSAGES, SYSTEM, MessageRegistry, message_id
from kvevents.telemetry.sampling import resolve_sample_every

from .instrumented import InstrumentedIndex, TracedIndex, find_wrapper
from .score import best

_pick = best

__all__ = ["RouterProbe", "instrument_router", "observe_router"]

_PROBE = "_kvevents_router_probe"
_UNJOINED = {"held": "pending_held", "resolved": "pending_resolved", "expired": "pending_expired",
             "dropped": "pending_dropped", "cancelled": "pending_cancelled"}


class RouterProbe:
    """The tracing wrappers: a :class:`TracedScorer` in place of the router's scorer and a
    :class:`TracedFeed` in place of its delivery feed (lookups and matched tokens are the
    router's own plain counters, read by :func:`observe_router`: no wrapper needed for them)."""

    def __init__(self, router: Any) -> None:
        self.router = router
        self.tracer: trace.Tracer | None = None
        self.registry: MessageRegistry = MESSAGES
        self.every = 1  #: deliveries traced iff seq % every == 0; score calls one in every
        self.score_calls = 0  #: score calls seen while tracing (the score sampler's counter)
        self.scorer = TracedScorer(router.scorer, self)
        self.feed = TracedFeed(router.feed, self)
        router.scorer = self.scorer
        router.feed = self.feed

    # The sampled spans are made after the call, with its start time: neither call has child
    # spans, so no context is attached and no context manager runs (a rare, cold span is
    # the expensive part of sampling).

    def _traced_score(self, orig_score, args, kw):
        tokens = args[0] if args else kw["tokens"]
        t0 = time.time_ns()
        try:
            scores = orig_score(*args, **kw)
        except BaseException as exc:
            self._error_span("kvevents.router.score", t0, None, {}, exc)
            raise
        best = _pick(scores)
        attrs = {"kvevents.router.prompt_tokens": len(tokens), "kvevents.router.pods": len(scores)}
        if best is not None:
            attrs["kvevents.router.best_pod"] = best.pod
            attrs["kvevents.router.matched_tokens"] = best.matched_tokens
            for tier, n in best.tokens_by_tier.items():
                attrs[f"kvevents.router.matched_tokens.{tier}"] = n
        self.tracer.start_span("kvevents.router.score", kind=SpanKind.INTERNAL, start_time=t0,
                               attributes=attrs).end()
        return scores

    def _traced_handle(self, orig_handle, delivery):
        topic, seq = delivery.topic, delivery.seq
        stats = self.router.stats
        t0 = time.time_ns()
        before = sum(stats.errors.values())
        try:
            out = orig_handle(delivery)
            exc = None
        except BaseException as e:
            out, exc = None, e
        mid = message_id(topic, seq)
        parent = self.registry.parent_of_process(mid)
        ctx = None if parent is None else trace.set_span_in_context(trace.NonRecordingSpan(parent))
        kind = getattr(delivery.kind, "value", str(delivery.kind))
        attrs = {"messaging.system": SYSTEM, "messaging.operation.type": "process",
                 "messaging.operation.name": "apply", "messaging.destination.name": topic,
                 "messaging.message.id": mid, "kvevents.publisher": delivery.publisher,
                 "kvevents.delivery.kind": kind, "kvevents.seq": seq,
                 "kvevents.router.errors": sum(stats.errors.values()) - before}
        if isinstance(out, str):  # what the feed did with it (consumers.feed.OUTCOMES)
            attrs["kvevents.delivery.outcome"] = out
        batch = delivery.batch
        if batch is not None:
            attrs["messaging.batch.message_count"] = len(batch.events)
        links = [Link(parent)] if parent is not None else None
        if exc is not None:
            self._error_span(f"process {topic}", t0, ctx, attrs, exc, SpanKind.CONSUMER, links)
            raise exc
        self.tracer.start_span(f"process {topic}", context=ctx, kind=SpanKind.CONSUMER, start_time=t0,
                               attributes=attrs, links=links).end()
        return out

    def _error_span(self, name, t0, ctx, attrs, exc, kind=SpanKind.INTERNAL, links=None) -> None:
        span = self.tracer.start_span(name, context=ctx, kind=kind, start_time=t0, attributes=attrs, links=links)
        span.record_exception(exc)
        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        span.end()

    def maybe_close(self) -> None:
        if self.tracer is None:
            r = self.router
            if r.scorer is self.scorer:
                r.scorer = self.scorer.inner
            if r.feed is self.feed:
                r.feed = self.feed.inner
            _PROBES.pop(id(r), None)


class TracedScorer:
    """The Scorer role with a ``kvevents.router.score`` span for one call in ``every``."""

    def __init__(self, inner: Any, probe: RouterProbe) -> None:
        self.inner = inner
        self.probe = probe

    # *args/**kw pass-through: rebinding score()'s keyword-only parameters costs more than
    # the sampling check itself
    def score(self, *args, **kw):
        p = self.probe
        if p.tracer is not None:
            n = p.score_calls
            p.score_calls = n + 1
            if n % p.every == 0:
                return p._traced_score(self.inner.score, args, kw)
        return self.inner.score(*args, **kw)

    def score_json(self, *args, **kw):
        """The inner scorer's JSON answer, counted as a call; None for a call to be traced or
        where the inner scorer has no C answer (the caller then scores with :meth:`score`,
        which counts the call and records its span if sampled)."""
        p = self.probe
        if p.tracer is not None and p.score_calls % p.every == 0:
            return None
        out = self.inner.score_json(*args, **kw)
        if out is not None and p.tracer is not None:
            p.score_calls += 1
        return out

    def pick(self, *args, **kw):
        top = best(self.score(*args, **kw))
        return None if top is None else top.pod

    def explain(self, *args, **kw):
        return self.inner.explain(*args, **kw)


class TracedFeed:
    """The delivery feed with a ``process <topic>`` span per sampled delivery."""

    def __init__(self, inner: Any, probe: RouterProbe) -> None:
        self.inner = inner
        self.probe = probe
        self._batch = DeliveryKind.BATCH

    def handle(self, router: Any, delivery: Any) -> str:
        p = self.probe
        if p.tracer is None or (delivery.seq % p.every and delivery.kind is self._batch):
            return self.inner.handle(router, delivery)
        return p._traced_handle(lambda d: self.inner.handle(router, d), delivery)


_PROBES: dict[int, RouterProbe] = {}


def _probe(router: Any) -> RouterProbe:
    p = _PROBES.get(id(router))
    if p is None or p.router is not router:
        p = _PROBES[id(router)] = RouterProbe(router)
    return p


class _IndexScan:
    """Entries and approximate bytes per tier, recomputed at most every ``interval`` seconds."""

    def __init__(self, router: Any, interval: float) -> None:
        self.router = router
        self.interval = interval
        self.at = -1e18
        self.entries: dict[str, int] = {}
        self.nbytes: dict[str, int] = {}
        self.lock = threading.Lock()

    def get(self) -> tuple[dict[str, int], dict[str, int]]:
        with self.lock:
            now = time.monotonic()
            if now - self.at >= self.interval:
                self._scan()
                self.at = now
            return self.entries, self.nbytes

    def _scan(self) -> None:
        r = self.router
        counts = r.entries_by_tier()
        mem = r.memory_report()
        total = mem["bytes_masks"] + mem["bytes_parents"] + mem["bytes_learned"]
        n = sum(counts.values()) or 1
        self.entries = counts
        self.nbytes = {name: int(total * c / n) for name, c in counts.items()}


def observe_router(router: Any, meter: Meter | None = None, *, refresh_interval: float = 5.0,
                   attributes: dict[str, str] | None = None) -> Observation:
    """Observable instruments over a :class:`consumers.KVRouter`; ``close()`` removes them."""
    meter = get_meter(meter)
    extra = dict(attributes or {})
    obs = Observation(router)
    base = dict(extra)
    scan = _IndexScan(router, refresh_interval)
    a = attribute_cache(extra)

    def simple(fn):
        return lambda: [(fn(), base)]

    obs.add(meter, "kvevents.router.entries", lambda: [(n, a(tier=t)) for t, n in scan.get()[0].items()])
    obs.add(meter, "kvevents.router.index.size", lambda: [(n, a(tier=t)) for t, n in scan.get()[1].items()])
    obs.add(meter, "kvevents.router.batches", simple(lambda: router.stats.batches))
    obs.add(meter, "kvevents.router.events", simple(lambda: router.stats.events))
    obs.add(meter, "kvevents.router.lookups", simple(lambda: router.stats.lookups))
    obs.add(meter, "kvevents.router.prompt.tokens", simple(lambda: router.stats.prompt_tokens))
    obs.add(meter, "kvevents.router.matched.tokens",
            lambda: [(n, a(tier=t)) for t, n in list(router.stats.matched_tokens.items())])
    obs.add(meter, "kvevents.router.offload.unjoined",
            lambda: [(getattr(s, f), a(outcome=o)) for s in (router.stats,) for o, f in _UNJOINED.items()])
    obs.add(meter, "kvevents.router.offload.chunk.inferences",
            lambda: [(router.stats.chunk_inferred, a(outcome="inferred")),
                     (router.stats.chunk_rederived, a(outcome="rederived"))])
    obs.add(meter, "kvevents.router.offload.chunk.extent",
            lambda: [(n, a(pod=p, tier=t)) for p, d in router.chunk_extents().items() for t, n in d.items()])
    obs.add(meter, "kvevents.router.offload.pending", simple(lambda: router.counters()["pending"]))
    obs.add(meter, "kvevents.router.evicted", simple(lambda: router.index.stats()["evicted_entries"]))
    counted = find_wrapper(router.index, InstrumentedIndex)  # RouterConfig.index_metrics
    if counted is not None:
        obs.add(meter, "kvevents.router.index.operations",
                lambda: [(n, a(op=op)) for op, n in list(counted.calls.items())])
    obs.add(meter, "kvevents.router.removals",
            lambda: [(s.blocks_removed, a(outcome="removed")) for s in (router.stats,)]
            + [(router.stats.remove_unknown, a(outcome="unknown"))])
    obs.add(meter, "kvevents.router.errors", lambda: [(n, a(kind=k)) for k, n in list(router.stats.errors.items())])
    obs.add(meter, "kvevents.router.gaps", simple(lambda: router.stats.gaps))
    obs.add(meter, "kvevents.router.uncertain_pods", simple(lambda: router.counters()["uncertain_pods"]))
    obs.add(meter, "kvevents.router.relearned", simple(lambda: router.stats.relearned))
    obs.add(meter, "kvevents.router.resets", simple(lambda: router.stats.resets))
    return obs


class _Traced:
    def __init__(self, probe: RouterProbe) -> None:
        self.probe = probe

    def close(self) -> None:
        self.probe.tracer = None
        traced = find_wrapper(self.probe.router.index, TracedIndex)
        if traced is not None:
            traced.tracer = None
        self.probe.maybe_close()


def instrument_router(router: Any, tracer_provider: trace.TracerProvider | None = None,
                      registry: MessageRegistry = MESSAGES, *, sample_every: int | None = None) -> _Traced:
    """Process spans for the BATCH deliveries with ``seq % sample_every == 0`` (and every
    RESET/GAP delivery) and score spans for one call in ``sample_every`` (default
    :func:`~kvevents.telemetry.sampling.resolve_sample_every`); ``close()`` removes them."""
    probe = _probe(router)
    probe.every = resolve_sample_every(sample_every)
    probe.score_calls = 0
    probe.tracer = get_tracer(tracer_provider)
    probe.registry = registry
    traced = find_wrapper(router.index, TracedIndex)  # RouterConfig.index_tracing
    if traced is not None:
        traced.tracer = probe.tracer
    return _Traced(probe)
