"""The bridge: engines' ZeroMQ streams into one JetStream stream, every batch exactly once.

``Bridge(url, engines)`` follows each engine with our raw-mode :class:`~kvevents.Subscriber`
(gaps healed by replay, late join from the replay ring) and publishes every delivery to the
stream (see :mod:`.wire` for subjects and headers). Exactly once across bridge restarts:

* a message id ``<pod>:<run>:<kind>:<seq>`` lets JetStream's duplicate window drop a re-send;
* on start the bridge reads the last message the stream holds for each pod (its run, seq and
  body) and resumes after it: the engine's replay ring is read from its start, batches up to
  that seq are skipped once the batch AT that seq matches the stored body byte for byte (the
  same engine run); a different body, or the engine's seq going backwards, means the engine
  restarted meanwhile: a RESET control message with the next run number goes first.
  (If the ring no longer holds that seq and the next seq it holds is later, the batches between
  are a GAP control message: counted, never silent.)

RESET and unrecoverable GAP deliveries become control messages, ordered with the batches.
One bridge serves many engines; run one per engine for a sidecar.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from ...delivery import DeliveryKind
from ...errors import ConfigError
from ...subscriber import PublisherSpec, Subscriber
from .sender import PlaneSender
from .wire import COUNT, MAX_PACK, StreamSpec, pack_parts, parse_headers, plane_headers, subject_for, unpack

__all__ = ["Bridge", "EngineSpec"]

_BATCH = DeliveryKind.BATCH

MAX_PACKED_BYTES = 512 << 10  #: a packed message's body stops growing here (nats-server's max_payload: 1 MB)


@dataclass(slots=True)
class EngineSpec:
    name: str  #: the pod name (unique in the stream)
    endpoint: str  #: the engine's PUB endpoint
    replay_endpoint: str | None = None
    model: str = "default"
    rank: int = 0

    @classmethod
    def parse(cls, text: str) -> "EngineSpec":
        """``NAME=PUB_ENDPOINT[,REPLAY_ENDPOINT][,model=M][,rank=R]`` (the CLI's --engine)."""
        name, sep, rest = text.partition("=")
        if not sep or not name or not rest:
            raise ConfigError(f"--engine {text!r}: expected NAME=PUB_ENDPOINT[,REPLAY_ENDPOINT][,model=M][,rank=R]")
        parts = rest.split(",")
        spec = cls(name, parts[0])
        for p in parts[1:]:
            if p.startswith("model="):
                spec.model = p[6:]
            elif p.startswith("rank="):
                try:
                    spec.rank = int(p[5:])
                except ValueError:
                    raise ConfigError(f"--engine {text!r}: rank must be an integer") from None
            else:
                spec.replay_endpoint = p
        return spec


class _Pod:
    __slots__ = ("spec", "subject", "run", "last_seq", "last_body", "confirmed", "held")

    def __init__(self, spec: EngineSpec, subject: str) -> None:
        self.spec = spec
        self.subject = subject
        self.run = 0
        self.last_seq = -1  #: the last engine seq in the stream for this run
        self.last_body: bytes | None = None
        self.confirmed = True  #: False while resuming: not yet sure the engine is still in the same run
        self.held: list = []  #: resuming: batches at or below last_seq, kept until the run is known


class Bridge:
    def __init__(self, url: str, engines: list[EngineSpec], *, stream: StreamSpec | None = None, window: int = 512,
                 subscriber_kw: dict | None = None, max_held: int = 100_000, pack: int = 1) -> None:
        if not engines:
            raise ConfigError("a bridge needs at least one engine")
        names = [e.name for e in engines]
        if len(set(names)) != len(names):
            raise ConfigError(f"engine names must be unique, got {names}")
        if not 1 <= pack <= MAX_PACK:
            raise ConfigError(f"pack must be 1..{MAX_PACK}, got {pack}")
        self.stream = stream or StreamSpec()
        self.max_held = max_held
        #: consecutive batches of one pod per stream message (1: the raw vLLM payload is the body);
        #: packing is what lifts the plane's event rate, since JetStream's cost is per message
        self.pack = pack
        self.stats = {"batches": 0, "resets": 0, "gaps": 0, "resume_skipped": 0, "resumed_pods": 0,
                      "held_overflow": 0}
        self.sender = PlaneSender(url, self.stream, window=window, name="kvevents-bridge")
        self.pods = {e.name: _Pod(e, subject_for(self.stream.prefix, e.model, e.name)) for e in engines}
        try:
            for pod in self.pods.values():
                self._resume(pod)
            kw = {"raw": True, "late_join": True, **(subscriber_kw or {})}
            self.sub = Subscriber([PublisherSpec(e.endpoint, e.replay_endpoint, e.name) for e in engines], **kw)
        except BaseException:
            self.sender.close(0)
            raise

    def _resume(self, pod: _Pod) -> None:
        from nats.js.errors import NotFoundError

        async def last():
            try:
                return await self.sender.js.get_last_msg(self.stream.name, pod.subject)
            except NotFoundError:
                return None
        msg = self.sender.call(last())
        if msg is None:
            return
        m = parse_headers(msg.headers)
        pod.run = m.run
        pod.confirmed = False
        self.stats["resumed_pods"] += 1
        if m.kind == "batch":
            last = unpack(msg.data, m.count)[-1] if m.count > 1 else msg.data
            pod.last_seq, pod.last_body = m.seq + m.count - 1, last
        elif m.kind == "reset":
            pod.last_seq = -1
        else:
            pod.last_seq = m.seq + m.missed - 1

    # ---- deliveries -> messages ---------------------------------------------------------------

    # A poll's deliveries become items (pod, kind, seq, body, topic, run, missed, reason) first;
    # ``_messages`` turns them into stream messages, headers built once per message, not per batch.

    def _msg(self, pod: _Pod, kind: str, seq: int, body: bytes = b"", topic: str = "", missed: int = 0,
             reason: str = ""):
        return (pod, kind, seq, body, topic, pod.run, missed, reason)

    def _batch(self, pod: _Pod, seq: int, payload: bytes, topic: str, out: list) -> None:
        if not pod.confirmed:
            if seq < pod.last_seq or (seq == pod.last_seq and pod.last_body is None):
                if len(pod.held) >= self.max_held:
                    self.stats["held_overflow"] += 1  # cannot hold more: decide now (same run)
                    pod.held.clear()
                    pod.confirmed = True
                else:
                    pod.held.append((seq, payload, topic))
                    return
            elif seq == pod.last_seq:
                if payload == pod.last_body:  # the same run: what we held is in the stream already
                    self.stats["resume_skipped"] += len(pod.held) + 1
                    pod.held.clear()
                    pod.confirmed = True
                    return
                self._restart(pod, pod.held[0][0] if pod.held else seq, topic, out)
            elif pod.held:  # the ring jumped over last_seq: its older batches belong to a new run
                self._restart(pod, pod.held[0][0], topic, out)
            else:  # seq > last_seq: same run; what lies between is lost
                pod.confirmed = True
                if seq > pod.last_seq + 1:
                    self._gap(pod, pod.last_seq + 1, seq - pod.last_seq - 1, "lost", topic, out)
        elif seq <= pod.last_seq:
            self.stats["resume_skipped"] += 1  # already in the stream (resume, or a replay ran ahead)
            return
        out.append((pod, "batch", seq, payload, topic, pod.run, 0, ""))
        pod.last_seq = seq
        self.stats["batches"] += 1

    def _restart(self, pod: _Pod, first_seq: int, topic: str, out: list) -> None:
        held, pod.held = pod.held, []
        pod.run += 1
        pod.confirmed = True
        pod.last_seq = -1
        out.append(self._msg(pod, "reset", first_seq, topic=topic))
        self.stats["resets"] += 1
        for s, p, t in held:
            self._batch(pod, s, p, t, out)

    def _gap(self, pod: _Pod, seq: int, missed: int, reason: str, topic: str, out: list) -> None:
        out.append(self._msg(pod, "gap", seq, topic=topic, missed=missed, reason=reason))
        pod.last_seq = max(pod.last_seq, seq + missed - 1)
        self.stats["gaps"] += 1

    def translate(self, deliveries) -> list:
        out: list = []
        pods = self.pods
        batches = 0
        for d in deliveries:
            pod = pods.get(d.publisher)
            if pod is None:
                continue
            kind = d.kind
            if kind is _BATCH:
                seq = d.seq
                if pod.confirmed and seq > pod.last_seq:  # the usual case, _batch's last lines inlined
                    out.append((pod, "batch", seq, d.payload if d.payload is not None else b"", d.topic, pod.run,
                                0, ""))
                    pod.last_seq = seq
                    batches += 1
                else:
                    self._batch(pod, seq, d.payload if d.payload is not None else b"", d.topic, out)
            elif kind is DeliveryKind.RESET:
                self._restart(pod, d.seq, d.topic, out)
            elif kind is DeliveryKind.GAP:
                end = d.seq + d.missed - 1
                if end <= pod.last_seq and (not pod.confirmed or d.seq <= pod.last_seq):
                    continue  # lies before what the stream holds (a ring's missing start while resuming)
                if not pod.confirmed:
                    if pod.held:  # held batches below last_seq, then a hole past it: a new run
                        self._restart(pod, pod.held[0][0], d.topic, out)
                    pod.confirmed = True
                start = max(d.seq, pod.last_seq + 1)
                self._gap(pod, start, end - start + 1, d.reason or "lost", d.topic, out)
        self.stats["batches"] += batches
        return self._messages(out)

    def _messages(self, items: list) -> list:
        """Stream messages for a poll's items: per pod in order (pods may interleave: only each
        pod's order matters), runs of up to ``pack`` consecutive batches folded into one."""
        if not items:
            return []
        by_pod: dict = {}
        for it in items:
            lst = by_pod.get(it[0])
            if lst is None:
                by_pod[it[0]] = [it]
            else:
                lst.append(it)
        limit = self.pack
        msgs = []
        for pod, its in by_pod.items():
            spec = pod.spec
            i, n = 0, len(its)
            while i < n:
                _, kind, seq, body, topic, run, missed, reason = its[i]
                j = i + 1
                if kind == "batch" and limit > 1:
                    size = len(body)
                    while j < n and j - i < limit:
                        nxt = its[j]
                        if nxt[1] != "batch" or nxt[2] != seq + (j - i) or nxt[5] != run:
                            break
                        size += len(nxt[3]) + 4
                        if size > MAX_PACKED_BYTES:  # under the server's max_payload (1 MB by default)
                            break
                        j += 1
                h = plane_headers(kind, spec.name, topic, spec.rank, seq, run, missed, reason, spec.model)
                if j - i > 1:
                    h[COUNT] = str(j - i)
                    body = pack_parts([it[3] for it in its[i:j]])  # sent as parts: joined by no one here
                msgs.append((pod.subject, body, h))
                i = j
        return msgs

    # ---- the loop ---------------------------------------------------------------------------

    def poll(self, timeout_ms: int = 50) -> int:
        """One round: subscriber deliveries to the stream. Returns how many messages were queued.

        When packing, a round keeps taking what is already waiting (polls that do not wait), up
        to ``pack`` deliveries per engine, before it translates: a subscriber poll takes at most
        a drain (64 frames) per engine, and a message's cost in the server and the reader is
        mostly per byte plus a fixed part per message, so fuller packs cost less per event.
        Nothing waits for more to arrive: the lag added is the time to read what is there.
        """
        sub = self.sub
        deliveries = sub.poll(timeout_ms)
        if deliveries and self.pack > 1:
            limit = self.pack * len(self.pods)
            more = deliveries
            while more and len(deliveries) < limit:
                more = sub.poll(0)
                deliveries += more
        msgs = self.translate(deliveries)
        if msgs:
            self.sender.put_many(msgs)
        return len(msgs)

    def run(self, stop: threading.Event | None = None, *, duration: float | None = None) -> None:
        end = None if duration is None else time.monotonic() + duration
        while not (stop is not None and stop.is_set()) and (end is None or time.monotonic() < end):
            self.poll(50)

    def health(self) -> dict:
        return {"bridge": dict(self.stats), "sender": dict(self.sender.stats), "unacked": self.sender.unacked(),
                "engines": {k: v for k, v in self.sub.health().items()}}

    def close(self, timeout: float = 5.0) -> bool:
        self.sub.close()
        return self.sender.close(timeout)

    def __enter__(self) -> "Bridge":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
