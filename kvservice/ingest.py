"""The service's ingest side: an event source feeding a KVRouter on a thread of its own.

Threads: the ingest thread is the only one that polls the subscriber and feeds the router (the
loop every consumer of a source runs, :func:`consumers.feed.run`, given this fleet's step per
delivery, :meth:`Fleet.take`, and health round, :meth:`Fleet._health_round`); every router
call (``handle``, ``refresh_health``, ``score``/``pick``/``explain``, ``counters``) happens
under :attr:`Fleet.lock`, held for one delivery on the ingest side and for one answer on the
API side, so a query sees the index between two batches, never inside one. The pod table
(:meth:`Fleet.pods_view`) and readiness are rebuilt by the ingest thread from subscriber health
and read by the API as one immutable snapshot (an attribute swap).

The source is whatever :func:`kvevents.open_source` builds from the configuration
(:meth:`ServiceConfig.event_source`: ZeroMQ connect or bind mode, or the JetStream event plane).

Attribution: a batch is indexed under a pod and a model, and the router is the one place that
knows which (:meth:`KVRouter.attribute`, told once per publisher; a delivery's topic is never
rewritten). A configured publisher is told at start: its pod's name and model, whatever its
topic says (vLLM's default topic is ``""``); in bind mode a publisher not configured is told at
its first batch: a topic ``kv@<pod>@<model>`` names both, another non-empty topic is the pod with
the default model. A batch that can still not be attributed is never dropped silently: it is
counted per publisher with the reason, logged once, and shown in ``/v1/pods`` and metrics; so is
a batch the router could not index (the feed's ``"bad"`` outcome for that delivery).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from consumers import KVRouter, PodRefused, feed, pod_from_topic
from consumers.feed import BAD
from kvevents import open_source, peek_ts
from kvevents.errors import DecodeError

from .config import ServiceConfig

__all__ = ["Fleet", "PodStatus", "Unattributed"]

log = logging.getLogger("kvservice")

class _Snapshot:
    """One health() result, handed to ``KVRouter.refresh_health`` as its source."""

    __slots__ = ("_health",)

    def __init__(self, health: dict) -> None:
        self._health = health

    def health(self) -> dict:
        return self._health


@dataclass(slots=True)
class Unattributed:
    """Batches of one publisher the router could not index, and why."""

    publisher: str
    reason: str
    batches: int = 0


#: how a pod's publisher states roll up into the pod's: the highest rank wins (an unknown state
#: ranks above all)
_ROLLUP = {"SYNCED": 0, "RECOVERING": 1, "CONNECTING": 2, "STALE": 3}


@dataclass(slots=True)
class PodStatus:
    name: str
    model: str | None
    configured: bool
    state: str = "RECOVERING"
    synced_once: bool = False
    last_seq: int = -1
    last_recv_ts: float = 0.0
    lag_s: float | None = None  #: receive time minus the batch's own ts, for the last batch
    batches: int = 0  #: batches applied (live and replayed, every run)
    gaps: int = 0
    unrecoverable: int = 0
    resets: int = 0
    malformed: dict[str, int] = field(default_factory=dict)
    publishers: list[str] = field(default_factory=list)
    state_changes: int = 0  #: transitions of ``state`` (a flapping pod counts each one)
    disconnects: int = 0  #: connections to its publishers lost
    connected: bool | None = None  #: its publishers' connections are all up (None: not known)
    #: after an unrecoverable gap: the score discount and the batches left until it is re-learnt
    #: (None: certain), from the router
    uncertainty: dict | None = None

    def as_dict(self, now: float) -> dict:
        return {"name": self.name, "model": self.model, "configured": self.configured, "state": self.state,
                "synced_once": self.synced_once, "last_seq": self.last_seq,
                "last_recv_age_s": (now - self.last_recv_ts) if self.last_recv_ts else None,
                "lag_s": self.lag_s, "batches": self.batches, "gaps": self.gaps,
                "unrecoverable": self.unrecoverable, "resets": self.resets, "malformed": dict(self.malformed),
                "publishers": list(self.publishers), "state_changes": self.state_changes,
                "disconnects": self.disconnects, "connected": self.connected, "uncertainty": self.uncertainty}


class Fleet:
    """Owns the subscriber, the router, the ingest thread and the lock between them."""

    def __init__(self, cfg: ServiceConfig, *, health_interval: float = 0.2) -> None:
        self.cfg = cfg
        self.router = KVRouter(cfg.router_config())
        self.default_model = self.router.config.model
        self.lock = threading.Lock()
        self.health_interval = health_interval
        #: the ingest thread polls at most once per this many seconds while batches trickle in
        #: (``subscriber.poll_interval``; the feed's ``pace``); a backlog is drained without pause
        self.poll_interval = cfg.subscriber.poll_interval
        #: publisher identity -> (pod, model): what the router was told (configured ones at start)
        self._attr = self.router.endpoints.attributed
        self.models: set[str] = cfg.models()
        self.unattributed: dict[str, Unattributed] = {}
        self.ingest_errors = 0  #: exceptions the ingest loop caught (counted, logged, loop goes on)
        self.deliveries = 0
        self._last: dict[str, tuple[int, float, float | None]] = {}  # publisher -> seq, recv_ts, batch ts
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ready = False
        self.pods: dict[str, PodStatus] = {}
        sc = cfg.subscriber
        for p in cfg.pods:
            model = cfg.pod_model(p)
            self.pods[p.name] = PodStatus(p.name, model, True)
            if model is not None:  # (else its topic names the model: known from its first batch)
                # known before it publishes: scored (0 until it has told something), never left out
                self.router.add_pod(p.name, model)
            # who publishes for it: each rank by identity, or (bind mode) its topic
            idents = [ident for ident, _ep, _rep in p.publishers()] if sc.bind is None else [p.topic or ""]
            for ident in idents:
                self.router.attribute(ident, p.name, model)
                self.pods[p.name].publishers.append(ident)
            if sc.event_plane is not None:  # the JetStream event plane: deliveries name their pod
                self.router.attribute(p.name, p.name, model)
        urls, options = cfg.event_source()
        self.sub = open_source(*urls, **options)
        self._refresh(time.time())

    # ---- the thread ----------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self.run, name="kvservice-ingest", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 1.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.sub.close()

    def run(self) -> None:
        """The ingest thread: the feed's loop (:func:`consumers.feed.run`) over the source, each
        delivery through :meth:`take`, a health round (:meth:`_health_round`) every
        ``health_interval``, a trickle paced by ``poll_interval``, and an exception counted,
        logged and gone past (``ingest_errors``)."""
        feed.run(self.router, self.sub, stop=self._stop, health_interval=self.health_interval, take=self.take,
                 health_round=self._health_round, pace=self.poll_interval, on_error=self._ingest_error)

    def _ingest_error(self, exc: Exception) -> None:
        self.ingest_errors += 1
        if self.ingest_errors == 1 or self.ingest_errors % 1000 == 0:
            log.error("ingest loop error #%d (counted; the loop goes on)", self.ingest_errors, exc_info=exc)

    def _health_round(self) -> None:
        """Subscriber health into the router and the pod table: one ``health()`` snapshot (a copy
        per publisher) for both, taken outside the lock, which is held only to apply it."""
        health = self.sub.health()
        snap = _Snapshot(health)
        with self.lock:
            self.router.refresh_health(snap)
        self._refresh(time.time(), health)

    def take(self, d) -> None:
        """Apply one delivery, its publisher attributed first if new (the ingest thread; tests
        may call it directly)."""
        self.deliveries += 1
        if d.publisher not in self._attr and not self._learn(d):
            return
        payload = d.payload
        if payload is not None:
            try:
                ts = peek_ts(payload)
            except DecodeError:
                ts = None
            self._last[d.publisher] = (d.seq, d.recv_ts, ts)
        with self.lock:
            outcome = self.router.handle(d)
        if outcome == BAD:
            pod = self._attr[d.publisher][0]
            self._unattributed(d.publisher, f"the router could not index pod {pod!r}'s batch (bad_delivery)")

    def _learn(self, d) -> bool:
        """A publisher no pod was configured for (bind mode): attribute it by its topic (the
        router told), or count it. False: its delivery is not applied."""
        pod, model = pod_from_topic(d.topic)
        if pod is None and d.topic and not d.topic.startswith("kv@"):
            pod = d.topic
        if pod is None:
            self._unattributed(d.publisher, f"topic {d.topic!r} names no pod and no configured pod has it "
                               "(give the pod topic = this topic in the config)")
            return False
        model = model or self.default_model
        if model is None:
            self._unattributed(d.publisher, f"topic {d.topic!r} names no model and router.model is not set")
            return False
        try:
            with self.lock:
                self.router.attribute(d.publisher, pod, model)
        except PodRefused:  # a pod pinned to another publisher: refused and counted by the router
            return False
        self.models = self.models | {model}
        st = self.pods.get(pod)
        if st is None:
            st = PodStatus(pod, model, False)
            self.pods = {**self.pods, pod: st}
        st.publishers.append(d.publisher)
        log.info("publisher %r (topic %r) attributed to pod %r, model %r", d.publisher, d.topic, pod, model)
        return True

    def _unattributed(self, publisher: str, reason: str) -> None:
        u = self.unattributed.get(publisher)
        if u is None:  # counted before it is published: the API thread never reads an entry at 0 batches
            u = Unattributed(publisher, reason)
            u.batches = 1
            self.unattributed[publisher] = u
            log.warning("batches from publisher %r are not indexed: %s (counted in /v1/pods and "
                        "kvservice_unattributed_batches_total)", publisher, reason)
            return
        u.batches += 1

    # ---- state for the API ---------------------------------------------------------------
    def _refresh(self, now: float, health: dict | None = None) -> None:
        """Rebuild pod states from subscriber health (ingest thread, or at start)."""
        if health is None:
            health = self.sub.health()
        with self.lock:
            uncertain = self.router.uncertainty()
        for st in list(self.pods.values()):
            states = []
            last_seq, batches, gaps, unrec, resets, drops, ups = -1, 0, 0, 0, 0, 0, []
            malformed: dict[str, int] = {}
            for ident in st.publishers:
                h = health.get(ident)
                if h is None:
                    states.append("RECOVERING" if st.configured else "SYNCED")
                    continue
                states.append(h.state.value)
                last_seq = max(last_seq, h.last_seq)  # the current run's (-1 after a RESET until its first)
                st.last_recv_ts = max(st.last_recv_ts, h.last_recv_ts if h.received else 0.0)
                batches += getattr(h, "delivered", h.received)
                gaps, unrec, resets = gaps + h.gaps, unrec + h.unrecoverable, resets + h.resets
                drops += getattr(h, "disconnects", 0)
                ups.append(getattr(h, "connected", None))
                for k, v in h.malformed.items():
                    malformed[k] = malformed.get(k, 0) + v
                last = self._last.get(ident)
                if last is not None and last[2] is not None:
                    st.lag_s = max(0.0, last[1] - last[2])
            st.last_seq, st.batches, st.gaps, st.unrecoverable, st.resets = last_seq, batches, gaps, unrec, resets
            st.malformed, st.disconnects = malformed, drops
            st.connected = None if not ups or None in ups else all(ups)
            # the pod's state is its least useful publisher's: a never-heard one (CONNECTING) is
            # not synced, and a pod with one is neither SYNCED nor ready
            worst = max(states, key=lambda s: _ROLLUP.get(s, len(_ROLLUP)), default="SYNCED")
            was_synced = st.synced_once
            if worst == "SYNCED":
                st.synced_once = True
            st.uncertainty = uncertain.get(st.name)
            if st.uncertainty is not None and worst == "SYNCED":
                worst = "UNRELIABLE"  # routed, with its score discounted (the uncertainty says how much)
            if worst != st.state and was_synced:  # (the states before it first synced are no flaps)
                st.state_changes += 1
            st.state = worst
        self.ready = all(st.synced_once for st in self.pods.values() if st.configured)

    def pods_view(self) -> dict:
        now = time.time()
        return {"pods": [st.as_dict(now) for st in sorted(self.pods.values(), key=lambda s: s.name)],
                "unattributed": [{"publisher": u.publisher, "reason": u.reason, "batches": u.batches}
                                 for u in self.unattributed.values()],
                "ready": self.ready, "ingest_errors": self.ingest_errors, "deliveries": self.deliveries}
