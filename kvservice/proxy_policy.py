"""The proxy's decisions, apart from HTTP: which pod (KV score and live load), each pod's circuit
breaker, session affinity, the retry budget, and admission (a concurrency limit with a bounded
queue). Everything here runs on the event-loop thread; nothing awaits except :meth:`Admission.enter`.

Cost of sending a request to a pod (lower is better)::

    (prompt tokens - tokens the pod has cached) * kv_weight
    + prefill tokens the proxy sent the pod that it has not started answering
    + requests the proxy has in flight on the pod * request_cost_tokens

Without a KV signal (no pod has any of the prompt cached) the first term is the same for every
pod, and the pick is by load alone: the least-loaded pod (``balance = "least_loaded"``, ties at
random) or the better of two drawn at random (``"power_of_two"``). Pod names never order pods.
"""

from __future__ import annotations

import asyncio
import random
from collections import OrderedDict, deque

from .proxy_config import ProxyConfig

__all__ = ["Admission", "Affinity", "Overloaded", "PodState", "RetryBudget", "order_pods"]


class PodState:
    """One pod's live load (what this proxy sent it) and its circuit breaker."""

    __slots__ = ("name", "url", "model", "in_flight", "prefill", "failures", "open_until", "probing", "opened")

    def __init__(self, name: str, url: str, model: str | None) -> None:
        self.name = name
        self.url = url
        self.model = model
        self.in_flight = 0
        self.prefill = 0  #: prompt tokens of requests in flight not yet answering
        self.failures = 0  #: consecutive failures
        self.open_until = 0.0  #: breaker open (pod skipped) until then; then half-open
        self.probing = False  #: half-open: one request is testing the pod
        self.opened = 0  #: times the breaker opened

    def available(self, now: float) -> bool:
        """Closed, or half-open with no probe out yet."""
        if self.failures == 0 or self.open_until == 0.0:
            return True
        return now >= self.open_until and not self.probing

    def is_open(self, now: float) -> bool:
        return self.open_until > now

    def success(self) -> None:
        self.failures = 0
        self.open_until = 0.0
        self.probing = False

    def failure(self, threshold: int, open_for: float, now: float) -> bool:
        """Count a failure; True when it (re)opens the breaker."""
        self.failures += 1
        self.probing = False
        if self.failures >= threshold:
            self.open_until = now + open_for
            self.opened += 1
            return True
        return False


def order_pods(pods: list[PodState], n_tokens: int, matched: dict[str, int], cfg: ProxyConfig,
               rnd: random.Random, now: float) -> list[PodState]:
    """The pods to try, best first: available pods by cost (see the module doc), then nothing
    else — a pod whose breaker is open is not tried until it is half-open."""
    live = [p for p in pods if p.available(now)]
    if len(live) <= 1:
        return live
    rc = cfg.request_cost_tokens
    kvw = cfg.kv_weight
    if not any(matched.get(p.name, 0) for p in live):
        if cfg.balance == "power_of_two":
            a, b = rnd.sample(live, 2)
            first = a if (a.prefill + a.in_flight * rc, a.in_flight) <= (b.prefill + b.in_flight * rc, b.in_flight) else b
            rest = [p for p in live if p is not first]
            rest.sort(key=lambda p: (p.prefill + p.in_flight * rc, rnd.random()))
            return [first, *rest]
        return sorted(live, key=lambda p: (p.prefill + p.in_flight * rc, p.in_flight, rnd.random()))
    return sorted(live, key=lambda p: ((n_tokens - matched.get(p.name, 0)) * kvw + p.prefill + p.in_flight * rc,
                                       p.in_flight, rnd.random()))


class Affinity:
    """Session -> pod, least recently used forgotten first."""

    def __init__(self, max_sessions: int) -> None:
        self.max = max_sessions
        self.pods: OrderedDict[str, str] = OrderedDict()
        self.hits = 0
        self.moved = 0

    def get(self, session: str) -> str | None:
        pod = self.pods.get(session)
        if pod is not None:
            self.pods.move_to_end(session)
        return pod

    def set(self, session: str, pod: str) -> None:
        self.pods[session] = pod
        self.pods.move_to_end(session)
        while len(self.pods) > self.max:
            self.pods.popitem(last=False)


class RetryBudget:
    """A token bucket: each request adds ``ratio``, each retry takes 1, at most ``burst`` held."""

    def __init__(self, ratio: float, burst: int) -> None:
        self.ratio = ratio
        self.burst = float(burst)
        self.tokens = float(burst)
        self.exhausted = 0  #: retries not made because the bucket was empty

    def deposit(self) -> None:
        t = self.tokens + self.ratio
        self.tokens = t if t < self.burst else self.burst

    def take(self) -> bool:
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        self.exhausted += 1
        return False


class Overloaded(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Admission:
    """At most ``limit`` requests forwarded at once; up to ``max_queue`` wait (first come, first
    served) for at most ``queue_timeout`` s; beyond that :class:`Overloaded`."""

    def __init__(self, limit: int, max_queue: int, queue_timeout: float) -> None:
        self.limit = limit
        self.max_queue = max_queue
        self.timeout = queue_timeout
        self.active = 0
        self.waiters: deque[asyncio.Future] = deque()
        self.rejected = {"queue_full": 0, "queue_timeout": 0}
        self.queued = 0  #: requests that waited

    def try_enter(self) -> bool:
        if self.limit == 0 or (self.active < self.limit and not self.waiters):
            self.active += 1
            return True
        return False

    async def enter(self) -> None:
        if self.try_enter():
            return
        if len(self.waiters) >= self.max_queue:
            self.rejected["queue_full"] += 1
            raise Overloaded("queue_full")
        fut = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        self.queued += 1
        try:
            async with asyncio.timeout(self.timeout):
                await fut  # leave() hands its slot over: active is not decremented
        except BaseException as exc:
            if fut.done() and not fut.cancelled():
                self.leave()  # the slot came just as the wait ended: pass it on
            else:
                fut.cancel()
                try:
                    self.waiters.remove(fut)
                except ValueError:
                    pass
            if isinstance(exc, TimeoutError):
                self.rejected["queue_timeout"] += 1
                raise Overloaded("queue_timeout") from None
            raise

    def leave(self) -> None:
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(None)  # the slot goes to the first waiter
                return
        self.active -= 1


def backoff(attempt: int, base: float, cap: float, rnd: random.Random) -> float:
    """Full-jitter exponential back-off before retry ``attempt`` (1, 2, ...)."""
    return rnd.uniform(0.0, min(cap, base * (1 << (attempt - 1))))

