"""Driving a router from an event source: deliveries (BATCH / RESET / GAP), health polling, and
the one loop over a source (:func:`run`: ``KVRouter.run`` and the router service's ingest thread)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

from kvevents.errors import DecodeError

from .router_config import PodRefused, RouterInputError

if TYPE_CHECKING:  # pragma: no cover
    from .endpoints import Endpoints
    from .router_config import RouterConfig


class KVRouter(Protocol):
    """What the feed drives (:class:`consumers.router.KVRouter` is one): declared here so the
    feed needs no import of the router, which imports the feed (no import circle)."""

    @property
    def endpoints(self) -> Endpoints: ...
    @property
    def config(self) -> RouterConfig: ...
    def apply(self, pod: str, batch, *, model: str | None = None, strict: bool = False) -> None: ...
    def apply_payload(self, pod: str, payload: bytes, *, model: str | None = None) -> None: ...
    def count_error(self, kind: str, msg: str) -> None: ...
    def mark_unreliable(self, pod: str) -> None: ...
    def mark_resynced(self, pod: str) -> None: ...
    def reset_pod(self, pod: str) -> None: ...
    def set_health(self, pod: str, state: str) -> None: ...
    def handle(self, delivery: object) -> str: ...
    def refresh_health(self, source: object) -> None: ...


__all__ = ["APPLIED", "BAD", "EMPTY", "Feed", "MALFORMED", "OUTCOMES", "PACE_BELOW", "POLL_MS", "REFUSED",
           "UNKNOWN", "handle", "refresh_health", "run"]

#: what :func:`handle` did with one delivery (each one not APPLIED is also counted in the router's
#: stats, under the name given): the caller acts on the one it got, never on a counter's difference
APPLIED = "applied"  #: the batch indexed, or the RESET / GAP applied to the pod
REFUSED = "refused"  #: the pod refused: past max_pods, or a claim a pin forbids (stats.pods_refused)
BAD = "bad"  #: a batch the router could not index (stats.errors["bad_delivery"])
MALFORMED = "malformed"  #: an undecodable payload; the pod marked UNRELIABLE (stats.errors["malformed_payload"])
EMPTY = "empty"  #: a BATCH delivery with no batch and no payload (stats.errors["empty_delivery"])
UNKNOWN = "unknown"  #: a delivery of a kind not known here (stats.errors["unknown_delivery"])
OUTCOMES = frozenset({APPLIED, REFUSED, BAD, MALFORMED, EMPTY, UNKNOWN})


def handle(router: KVRouter, delivery: object) -> str:
    """Apply one :class:`kvevents.delivery.Delivery` to ``router``; return the outcome (one of
    :data:`OUTCOMES`)."""
    kind = getattr(getattr(delivery, "kind", None), "value", None)
    try:
        pod, model = router.endpoints.pod_for(delivery.publisher, delivery.topic)  # type: ignore[attr-defined]
    except PodRefused:  # (a pin forbids it: counted in stats.pods_refused and stats.errors)
        return REFUSED
    eps = router.endpoints
    eps.pub_pod[delivery.publisher] = pod  # type: ignore[attr-defined]
    if kind == "batch":
        batch = delivery.batch  # type: ignore[attr-defined]
        try:
            if batch is not None:
                router.apply(pod, batch, model=model)
            else:
                payload = getattr(delivery, "payload", None)
                if payload is None:
                    router.count_error("empty_delivery", f"pod {pod!r}: BATCH delivery without a batch")
                    return EMPTY
                try:  # a raw-mode subscriber: the payload, decoded here (in C where it is built)
                    router.apply_payload(pod, payload, model=model)
                except DecodeError as exc:  # a lost batch, as a subscriber that decodes reports it
                    router.count_error("malformed_payload", f"pod {pod!r}: seq {delivery.seq}: {exc}")  # type: ignore[attr-defined]
                    router.mark_unreliable(pod)
                    return MALFORMED
            if eps.uncertain and pod in eps.uncertain:  # an UNRELIABLE pod re-learning: one batch closer
                eps.relearn_one(pod)
        except PodRefused:  # (one pod past max_pods: counted in stats.pods_refused and stats.errors)
            return REFUSED
        except RouterInputError as exc:
            router.count_error("bad_delivery", str(exc))
            return BAD
        return APPLIED
    if kind == "reset":
        router.reset_pod(pod)
        router.mark_resynced(pod)
        return APPLIED
    if kind == "gap":
        router.mark_unreliable(pod)
        return APPLIED
    router.count_error("unknown_delivery", f"pod {pod!r}: delivery of unknown kind {kind!r}")
    return UNKNOWN


class Feed:
    """The delivery feed of a router (a role: telemetry puts a traced one in its place)."""

    __slots__ = ()

    #: ``handle(router, delivery)`` (the module function itself: no extra frame per delivery)
    handle = staticmethod(handle)


def refresh_health(router: KVRouter, source: object) -> None:
    health = getattr(source, "health", None)
    if not callable(health):
        return
    pub_pod = router.endpoints.pub_pod
    for publisher, h in health().items():
        pod = pub_pod.get(publisher) or router.config.publisher_pods.get(publisher)
        if pod is None:
            continue
        state = getattr(h, "state", h)
        router.set_health(pod, getattr(state, "value", str(state)))


#: the longest one poll of a live source waits (ms): ``stop`` is seen, and a health round is due,
#: within this long of the moment
POLL_MS = 50
#: a poll that brought fewer deliveries than this is a trickle (paced, see :func:`run`'s ``pace``);
#: more is a backlog, drained without pause
PACE_BELOW = 16


def run(router: KVRouter, source: Iterable, *, stop: object = None, health_interval: float = 1.0,
        take: Callable[[object], object] | None = None, health_round: Callable[[], object] | None = None,
        pace: float = 0.0, on_error: Callable[[Exception], object] | None = None) -> int:
    """Feed ``router`` every delivery ``source`` brings until it ends (a recording) or
    ``stop.is_set()``; returns how many. The one loop for every consumer of a source.

    A live source (``poll(timeout_ms)``) is polled at most :data:`POLL_MS` at a time, with a
    health round after the first poll, then every ``health_interval`` seconds, and one when the
    run ends; a plain iterable is consumed as is, with a health round every
    ``RouterConfig.health_every`` deliveries and one at the end.

    ``take(delivery)`` is what is done with each delivery (default: ``router.handle``; a service
    passes its own step, which ends in ``router.handle``); ``health_round()`` what a health round
    does (default: ``router.refresh_health(source)``). ``pace`` (seconds, live source): while
    deliveries trickle in (a poll brought fewer than :data:`PACE_BELOW`), poll at most once per
    ``pace``, so a few more queue before the next poll; a backlog, an empty poll or a health round
    is never followed by a pause. ``on_error(exc)``: an exception a round raised (a poll, a
    delivery, a health round) is handed to it and the loop goes on; without it the exception
    ends the run."""
    take = router.handle if take is None else take
    if on_error is None:
        def on_error(exc: Exception) -> None:
            raise exc
    if health_round is None:
        def health_round() -> None:
            router.refresh_health(source)
    is_set = getattr(stop, "is_set", None)
    poll = getattr(source, "poll", None)
    n = 0
    if callable(poll):
        clock, sleep = time.monotonic, time.sleep
        next_health = 0.0  # (the first round: right after the first poll)
        while (is_set is None or not is_set()) and not getattr(source, "ended", False):  # a recording ends
            try:
                t0 = clock()
                got = poll(POLL_MS)
                n += len(got)
                for delivery in got:
                    take(delivery)
                now = clock()
                if now >= next_health:
                    next_health = now + health_interval
                    health_round()
                elif pace and got and len(got) < PACE_BELOW:
                    rest = t0 + pace - now
                    if rest > 0:
                        sleep(rest)
            except Exception as exc:
                on_error(exc)
    else:
        every = router.config.health_every
        health_round()
        for delivery in source:
            n += 1
            try:
                take(delivery)
                if n % every == 0:
                    health_round()
            except Exception as exc:
                on_error(exc)
            if is_set is not None and is_set():
                break
    try:
        health_round()
    except Exception as exc:
        on_error(exc)
    return n
