"""Per-batch spans for the publisher and the subscriber, and the in-process message registry.

Hook objects are installed on a component's ``hooks`` attribute (``None`` by default, so an
uninstrumented component pays one ``is None`` check per batch):

* publisher: ``send <topic>`` (PRODUCER) per sampled batch, parent = the context current when
  ``publish()`` was called (a manager's step span, say); ``replay <topic>`` per replay served
  (always);
* subscriber: ``receive <topic>`` (CONSUMER) per sampled batch, parent = the publisher's send
  span when it ran in this process (found by message id in :data:`MESSAGES`), with a link to
  it; ``gap-recovery <publisher>`` from a replay request to its end (always); the lag histogram.

Sampling (:mod:`kvevents.telemetry.sampling`): a batch is traced iff ``seq % sample_every == 0``,
decided here before any OpenTelemetry call, so every process traces the same batches and an
untraced batch costs one modulo (no span, no context capture, no registry entry).

Attributes follow the messaging semantic conventions: ``messaging.system`` = ``zeromq``,
``messaging.operation.type``/``.name``, ``messaging.destination.name`` = topic,
``messaging.message.id`` = ``<topic>:<seq>``, ``messaging.batch.message_count`` = events in
the batch, ``messaging.message.body.size`` = payload bytes.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, NonRecordingSpan, SpanKind, Status, StatusCode

from ..codec import peek_ts
from .instruments import get_tracer
from .sampling import resolve_sample_every

__all__ = ["MESSAGES", "MessageRegistry", "PublisherHooks", "SubscriberHooks", "message_id",
           "instrument_publisher", "instrument_subscriber", "uninstrument"]

SYSTEM = "zeromq"


def message_id(topic: str, seq: int) -> str:
    return f"{topic}:{seq}"


class _Bounded:
    """A small LRU map (oldest dropped past ``size``); guarded by a lock."""

    __slots__ = ("d", "size", "lock", "dropped")

    def __init__(self, size: int) -> None:
        self.d: OrderedDict = OrderedDict()
        self.size = size
        self.lock = threading.Lock()
        self.dropped = 0

    def put(self, k, v) -> None:
        with self.lock:
            d = self.d
            d[k] = v
            if len(d) > self.size:
                d.popitem(last=False)
                self.dropped += 1

    def get(self, k):
        with self.lock:
            return self.d.get(k)

    def pop(self, k):
        with self.lock:
            return self.d.pop(k, None)


class MessageRegistry:
    """Span contexts of recent messages in this process, by message id: how a subscriber's
    span finds the publisher's, and a consumer's span the subscriber's. Bounded."""

    def __init__(self, size: int = 8192) -> None:
        self.sent = _Bounded(size)
        self.received = _Bounded(size)

    def parent_of_receive(self, msg_id: str) -> trace.SpanContext | None:
        return self.sent.get(msg_id)

    def parent_of_process(self, msg_id: str) -> trace.SpanContext | None:
        return self.received.get(msg_id) or self.sent.get(msg_id)


MESSAGES = MessageRegistry()


def _ctx_of(span_context: trace.SpanContext | None):
    return None if span_context is None else trace.set_span_in_context(NonRecordingSpan(span_context))


class PublisherHooks:
    """Installed on ``ZmqEventPublisher.hooks`` by :func:`instrument_publisher`."""

    def __init__(self, publisher: Any, tracer: trace.Tracer, registry: MessageRegistry = MESSAGES,
                 max_pending: int = 4096, sample_every: int | None = None) -> None:
        self.publisher = publisher
        self.every = resolve_sample_every(sample_every)  #: a batch is traced iff seq % every == 0
        self.tracer = tracer
        self.registry = registry
        self.pending = _Bounded(max_pending)  # seq -> context current at publish()
        self._topics: dict[bytes, str] = {}

    def _topic(self, topic: bytes) -> str:
        t = self._topics.get(topic)
        if t is None:
            t = self._topics[topic] = topic.decode(errors="replace")
        return t

    # called under the publisher's queue lock: keep it a modulo (and, if sampled, a dict store)
    def on_enqueue(self, seq: int) -> None:
        if seq % self.every:
            return
        self.pending.put(seq, otel_context.get_current())

    def before_send(self, seq: int, topic: bytes):
        if seq % self.every:
            return None  # untraced: after_send gets None and returns at once
        t = self._topic(topic)
        mid = message_id(t, seq)
        span = self.tracer.start_span(
            f"send {t}", context=self.pending.pop(seq), kind=SpanKind.PRODUCER,
            attributes={"messaging.system": SYSTEM, "messaging.operation.type": "send",
                        "messaging.operation.name": "send", "messaging.destination.name": t,
                        "messaging.message.id": mid, "kvevents.seq": seq})
        self.registry.sent.put(mid, span.get_span_context())  # before the bytes leave
        return span

    def after_send(self, span, seq: int, payload: bytes, item: Any, outcome: str) -> None:
        if span is None:
            return
        if span.is_recording():
            attrs = {"messaging.message.body.size": len(payload), "kvevents.outcome": outcome}
            if type(item) is not bytes:
                attrs["messaging.batch.message_count"] = len(item.events)
            span.set_attributes(attrs)  # one call: one lock, one validation pass
            if outcome in ("send_error", "encode_error"):
                span.set_status(Status(StatusCode.ERROR, outcome))
        span.end()

    def on_replay(self, start: int, served: int, t0: int) -> None:
        t = getattr(self.publisher, "topic", "")
        span = self.tracer.start_span(
            f"replay {t}", kind=SpanKind.PRODUCER, start_time=t0,
            attributes={"messaging.system": SYSTEM, "messaging.operation.type": "send",
                        "messaging.operation.name": "replay", "messaging.destination.name": t,
                        "messaging.batch.message_count": served, "kvevents.replay.start_seq": start})
        span.end()


class SubscriberHooks:
    """Installed on ``Subscriber.hooks``: the lag histogram (by :func:`observe_subscriber`)
    and the receive / gap-recovery spans (by :func:`instrument_subscriber`); either may be off."""

    def __init__(self, subscriber: Any, registry: MessageRegistry = MESSAGES) -> None:
        self.subscriber = subscriber
        self.registry = registry
        self.tracer: trace.Tracer | None = None
        #: set by instrument_subscriber: a batch is traced iff seq % every == 0; until then (lag
        #: histogram only) live receives do not call on_receive at all (seq 0 aside)
        self.every = 1 << 62
        self.lag = None  # a histogram
        self.lag_every = 1  #: lag recorded for the batches with seq % lag_every == 0
        self.lag_attrs: dict[str, dict] = {}
        self.lag_extra: dict[str, str] = {}
        self.recoveries: dict[str, list] = {}  # publisher -> [span, replayed batches]
        self.clock = time.time

    def on_receive(self, publisher: str, topic: str, seq: int, batch: Any, nbytes: int, t0: int,
                   replayed: bool) -> None:
        if replayed:  # counted for the gap-recovery span, sampled or not
            rec = self.recoveries.get(publisher)
            if rec is not None:
                rec[1] += 1
        tracer = self.tracer
        if tracer is None or seq % self.every:
            return
        mid = message_id(topic, seq)
        parent = self.registry.parent_of_receive(mid)
        attrs = {"messaging.system": SYSTEM, "messaging.operation.type": "receive",
                 "messaging.operation.name": "replay" if replayed else "receive",
                 "messaging.destination.name": topic, "messaging.message.id": mid,
                 "messaging.message.body.size": nbytes, "kvevents.seq": seq, "kvevents.publisher": publisher,
                 "kvevents.replayed": replayed}
        if batch is not None and not isinstance(batch, bytes):  # (raw mode: the payload, not decoded here)
            attrs["messaging.batch.message_count"] = len(batch.events)
        span = tracer.start_span(f"receive {topic}", context=_ctx_of(parent), kind=SpanKind.CONSUMER,
                                 start_time=t0, attributes=attrs,
                                 links=[Link(parent)] if parent is not None else None)
        if batch is None:
            span.set_status(Status(StatusCode.ERROR, "undecodable payload"))
        self.registry.received.put(mid, span.get_span_context())
        span.end()

    def on_deliveries(self, out: list) -> None:
        lag = self.lag
        if lag is None:
            return
        attrs = self.lag_attrs
        every = self.lag_every
        for d in out:
            if d.seq % every:
                continue
            b = d.batch
            if b is not None:
                ts = b.ts
            elif d.payload is not None:  # a raw-mode subscriber: the ts read off the payload
                ts = peek_ts(d.payload)
                if ts is None:
                    continue
            else:
                continue
            a = attrs.get(d.publisher)
            if a is None:
                a = attrs[d.publisher] = {"publisher": d.publisher, **self.lag_extra}
            lag.record(max(0.0, d.recv_ts - ts), a)

    def on_replay_request(self, publisher: str, topic: str, start: int) -> None:
        tracer = self.tracer
        if tracer is None:
            return
        self._end_recovery(publisher, "retried")
        span = tracer.start_span(f"gap-recovery {publisher}", kind=SpanKind.CLIENT,
                                 attributes={"messaging.system": SYSTEM, "messaging.operation.type": "receive",
                                             "messaging.operation.name": "replay",
                                             "messaging.destination.name": topic, "kvevents.publisher": publisher,
                                             "kvevents.replay.start_seq": start})
        self.recoveries[publisher] = [span, 0]

    def on_replay_end(self, publisher: str, answered: bool) -> None:
        self._end_recovery(publisher, "completed" if answered else "abandoned")

    def _end_recovery(self, publisher: str, outcome: str) -> None:
        rec = self.recoveries.pop(publisher, None)
        if rec is None:
            return
        span, n = rec
        span.set_attribute("messaging.batch.message_count", n)
        span.set_attribute("kvevents.outcome", outcome)
        if outcome == "abandoned":
            span.set_status(Status(StatusCode.ERROR, "replay did not answer in time"))
        span.end()


def subscriber_hooks(sub: Any) -> SubscriberHooks:
    h = getattr(sub, "hooks", None)
    if not isinstance(h, SubscriberHooks):
        h = SubscriberHooks(sub)
        sub.hooks = h
    return h


def instrument_publisher(pub: Any, tracer_provider: trace.TracerProvider | None = None,
                         registry: MessageRegistry = MESSAGES, *, sample_every: int | None = None) -> PublisherHooks:
    """Send spans for the batches with ``seq % sample_every == 0`` (default
    :func:`~kvevents.telemetry.sampling.resolve_sample_every`) and a span per replay served,
    on a ``ZmqEventPublisher``; undo with :func:`uninstrument`."""
    if not hasattr(pub, "hooks"):
        raise TypeError(f"{type(pub).__name__} has no hooks attribute: not a ZmqEventPublisher?")
    h = PublisherHooks(pub, get_tracer(tracer_provider), registry, sample_every=sample_every)
    pub.hooks = h
    return h


def instrument_subscriber(sub: Any, tracer_provider: trace.TracerProvider | None = None, *,
                          sample_every: int | None = None) -> SubscriberHooks:
    """Receive spans for the batches with ``seq % sample_every == 0`` (the publisher's rule:
    the same batches) and a span per gap recovery, on a ``kvevents.Subscriber``."""
    if not hasattr(sub, "hooks"):
        raise TypeError(f"{type(sub).__name__} has no hooks attribute: not a kvevents.Subscriber?")
    h = subscriber_hooks(sub)
    h.every = resolve_sample_every(sample_every)
    h.tracer = get_tracer(tracer_provider)
    return h


def uninstrument(component: Any) -> None:
    """Remove the spans from a publisher or subscriber (a subscriber's lag histogram stays
    while its observation is open)."""
    h = getattr(component, "hooks", None)
    if isinstance(h, PublisherHooks):
        component.hooks = None
    elif isinstance(h, SubscriberHooks):
        h.tracer = None
        if h.lag is None:
            component.hooks = None
