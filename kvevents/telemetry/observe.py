"""Metrics of the publisher and the subscriber, read from their plain-int counters.

Nothing here runs per batch except the subscriber's lag histogram, recorded for one batch in
``lag_sample_every`` (by seq, :data:`~kvevents.telemetry.sampling.DEFAULT_HISTOGRAM_SAMPLE_EVERY`):
an SDK histogram record costs a good part of a batch's receive+decode.
"""

from __future__ import annotations

from typing import Any

from opentelemetry.metrics import Meter

from ..delivery import HealthState
from .instruments import Observation, attribute_cache, get_meter, histogram
from .messaging import subscriber_hooks
from .sampling import DEFAULT_HISTOGRAM_SAMPLE_EVERY, check_every

__all__ = ["observe_publisher", "observe_subscriber"]

_PUB_COUNTERS = {
    "kvevents.publisher.batches": "batches_published",
    "kvevents.publisher.events": "events_published",
    "kvevents.publisher.bytes": "bytes_published",
    "kvevents.publisher.queue.depth": "queue_depth",
    "kvevents.publisher.overflow": "overflow",
    "kvevents.publisher.overflow.lost": "overflow_lost",
    "kvevents.publisher.live.dropped": "live_dropped",
    "kvevents.publisher.ring.batches": "ring_batches",
    "kvevents.publisher.ring.size": "ring_bytes",
    "kvevents.publisher.ring.evicted": "ring_evicted",
    "kvevents.publisher.replay.requests": "replay_requests",
    "kvevents.publisher.replay.served": "replay_batches_served",
    "kvevents.publisher.replay.rate_limited": "replay_rate_limited",
    "kvevents.publisher.replay.refused": "replay_refused",
    "kvevents.publisher.replay.superseded": "replay_superseded",
    "kvevents.publisher.replay.throttled": "replay_throttled",
    "kvevents.publisher.replay.completed": "replays_completed",
    "kvevents.publisher.replay.active": "replay_active",
    "kvevents.publisher.replay.outstanding": "replay_outstanding_bytes",
    "kvevents.publisher.pub.hwm": "pub_hwm",
}
_PUB_ERRORS = {"encode": "encode_errors", "send": "send_errors", "replay_malformed": "replay_malformed",
               "replay_aborted": "replay_aborted", "replay_stalled": "replay_stalled"}

_SUB_COUNTERS = {
    "kvevents.subscriber.received": "received",
    "kvevents.subscriber.gaps": "gaps",
    "kvevents.subscriber.recovered": "recovered",
    "kvevents.subscriber.unrecoverable": "unrecoverable",
    "kvevents.subscriber.resets": "resets",
    "kvevents.subscriber.probes": "probes",
    "kvevents.subscriber.join_retries": "join_retries",
    "kvevents.subscriber.reconnects": "reconnects",
    "kvevents.subscriber.disconnects": "disconnects",
    "kvevents.subscriber.probes_moot": "probes_moot",
    "kvevents.subscriber.unverified_resets": "unverified_resets",
    "kvevents.subscriber.old_conn_dropped": "old_conn_dropped",
}
_SUB_TOTALS = {  # subscriber-wide (stats()), not per publisher
    "kvevents.subscriber.publishers.refused": "publishers_refused",
    "kvevents.subscriber.publishers.expired": "publishers_expired",
    "kvevents.subscriber.connections.open": "connections_open",
    "kvevents.subscriber.connections.evicted": "connections_evicted",
}
_STATES = tuple(s.value for s in HealthState)
_MALFORMED = ("frames", "seq", "payload", "replay")  # the subscriber's kinds: reported from 0


def observe_publisher(pub: Any, meter: Meter | None = None, *, name: str | None = None,
                      attributes: dict[str, str] | None = None) -> Observation:
    """Observable instruments over ``pub.stats()`` (any EventPublisher with that dict).

    ``name`` is the ``publisher`` attribute (default: the topic, else the endpoint);
    ``attributes`` are added to every point.
    """
    meter = get_meter(meter)
    label = name or getattr(pub, "topic", "") or getattr(pub, "endpoint", "") or type(pub).__name__
    attrs = {"publisher": label, **(attributes or {})}
    obs = Observation(pub)
    stats = pub.stats

    def reader(key: str):
        return lambda: [(stats().get(key, 0), attrs)]

    for metric, key in _PUB_COUNTERS.items():
        obs.add(meter, metric, reader(key))
    err_attrs = {kind: {**attrs, "kind": kind} for kind in _PUB_ERRORS}

    def errors():
        s = stats()
        return [(s.get(key, 0), err_attrs[kind]) for kind, key in _PUB_ERRORS.items()]

    obs.add(meter, "kvevents.publisher.errors", errors)
    return obs


def observe_subscriber(sub: Any, meter: Meter | None = None, *, attributes: dict[str, str] | None = None,
                       lag_sample_every: int = DEFAULT_HISTOGRAM_SAMPLE_EVERY) -> Observation:
    """Observable instruments over ``sub.health()`` per publisher, and the lag histogram,
    recorded through the subscriber's hook for the delivered batches with
    ``seq % lag_sample_every == 0`` (1: every batch; see :mod:`kvevents.telemetry.sampling`)."""
    check_every(lag_sample_every, "lag_sample_every")
    meter = get_meter(meter)
    extra = dict(attributes or {})
    obs = Observation(sub)
    a = attribute_cache(extra)

    def reader(field: str):
        return lambda: [(getattr(h, field), a(publisher=p)) for p, h in sub.health().items()]

    for metric, field in _SUB_COUNTERS.items():
        obs.add(meter, metric, reader(field))

    def malformed():
        out = [(h.malformed.get(k, 0), a(publisher=p, kind=k)) for p, h in sub.health().items()
               for k in (*_MALFORMED, *(k for k in h.malformed if k not in _MALFORMED))]
        shared = getattr(sub, "_malformed", None) or {}  # bind mode: frames no publisher can be named for
        out.extend((n, a(publisher="(bind)", kind=k)) for k, n in dict(shared).items())
        return out

    def health():
        out = []
        for p, h in sub.health().items():
            state = h.state.value
            out.extend((1 if s == state else 0, a(publisher=p, state=s)) for s in _STATES)
        return out

    stats = getattr(sub, "stats", None)

    def total(key: str):
        return lambda: [(stats().get(key, 0), a())]

    if stats is not None:
        for metric, key in _SUB_TOTALS.items():
            obs.add(meter, metric, total(key))

    obs.add(meter, "kvevents.subscriber.malformed", malformed)
    obs.add(meter, "kvevents.subscriber.health", health)
    hooks = subscriber_hooks(sub)
    hooks.lag = histogram(meter, "kvevents.subscriber.lag")
    hooks.lag_every = lag_sample_every
    hooks.lag_attrs = {}
    hooks.lag_extra = extra

    def remove_lag():
        hooks.lag = None
        if hooks.tracer is None and getattr(sub, "hooks", None) is hooks:
            sub.hooks = None

    obs.on_close(remove_lag)
    return obs
