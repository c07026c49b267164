"""Record live publishers to a recording file, and publish a recording again.

:class:`Recorder` is a consumer of a raw :class:`~kvevents.transport.zmq.Subscriber`: one SUB
socket per PUB endpoint (the endpoint is the publisher's identity) and, where a replay endpoint
is given, the subscriber's own gap healing (:class:`~kvevents.tracker.SeqTracker`) asks the
publisher's replay socket for what the live stream missed. The subscriber's wire tap hands the
recorder every message exactly as received, live frames (socket ``"pub"``) and replay answers
with their end markers (socket ``"replay"``), so the file holds what was on the wire; healing
happens again when the file is read (:mod:`kvevents.recordstream`), with the same tracker.

:func:`replay_recording` publishes a recording through
:class:`~kvevents.transport.zmq.ZmqEventPublisher` with the recorded sequence numbers and timing
(scaled by ``speed``); its replay socket answers replay requests from the ring as the original
publisher would have.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import zmq

from .delivery import DeliveryKind, HealthState, PublisherHealth
from .errors import EndpointError
from .recording import RecordingReader, RecordingWriter
from .recordstream import DeliveryStream
from .transport.zmq.endpoints import validate_endpoint
from .transport.zmq.frames import is_end_marker, is_live, is_replay_answer
from .transport.zmq.subscriber import PublisherSpec, Subscriber

__all__ = ["Recorder", "SourceProgress", "replay_recording", "ReplayReport"]


@dataclass(slots=True)
class SourceProgress:
    """Per-publisher counters of a recorder: what it wrote (counted here) and what its
    subscriber's healing did (``health``, the subscriber's :class:`~kvevents.PublisherHealth`)."""

    endpoint: str
    replay_endpoint: str | None = None
    backfill: bool = False  #: asks for what the publisher held before we joined (from seq 0)
    pub: int = 0  #: live messages recorded
    replay: int = 0  #: replay answers recorded (end markers included)
    answered: int = 0  #: batches in replay answers
    last_seq: int | None = None  #: last live seq
    high: int | None = None  #: highest seq recorded from either socket (since the last restart)
    malformed: int = 0  #: messages that are not [topic, 8-byte seq, payload] (recorded anyway)
    health: PublisherHealth | None = None  #: the subscriber's view, as of the last poll

    def _h(self, name: str) -> int:
        return 0 if self.health is None else getattr(self.health, name)

    @property
    def gaps(self) -> int:
        """Live seq jumps seen."""
        return self._h("gaps")

    @property
    def resets(self) -> int:
        """Publisher restarts seen (the live seq went backwards)."""
        return self._h("resets")

    @property
    def replay_requests(self) -> int:
        return self._h("replay_requests")

    @property
    def replay_timeouts(self) -> int:
        """Replay requests whose answer did not end within ``replay_timeout`` (given up)."""
        return self._h("replay_timeouts")

    @property
    def unrecoverable(self) -> int:
        """Batches neither received live nor in a replay answer: missing from the recording too."""
        return self._h("unrecoverable")

    @property
    def outstanding(self) -> int | None:
        """While a replay request is outstanding, the first seq still missing; else None."""
        h = self.health
        if h is None or h.state is not HealthState.RECOVERING:
            return None
        return h.last_seq + 1


class Recorder:
    """Records every message from ``endpoints`` (and their replay answers) into ``writer``.

    ``replay_endpoints``: None, or one per endpoint (None where a publisher has none).
    ``backfill``: also ask each publisher's replay socket for everything it still holds from
    seq 0 (its answers are recorded; readers use them with ``late_join``), again until the
    publisher has something to give.
    """

    def __init__(self, writer: RecordingWriter, endpoints: Sequence[str], *,
                 replay_endpoints: Sequence[str | None] | None = None, topic: str = "",
                 backfill: bool = False, replay_timeout: float = 2.0, context: zmq.Context | None = None) -> None:
        if not endpoints:
            raise EndpointError("record needs at least one PUB endpoint")
        replay_endpoints = list(replay_endpoints or [None] * len(endpoints))
        if len(replay_endpoints) != len(endpoints):
            raise EndpointError(
                f"{len(replay_endpoints)} replay endpoint(s) for {len(endpoints)} endpoint(s): give one per endpoint")
        for ep in endpoints:
            validate_endpoint(ep)
        for ep in replay_endpoints:
            if ep is not None:
                validate_endpoint(ep, what="replay endpoint")
        if len(set(endpoints)) != len(endpoints):
            raise EndpointError(f"an endpoint is given twice: {list(endpoints)}")
        self.writer = writer
        self.replay_timeout = replay_timeout
        self.frames = 0
        self.bytes = 0
        self.started = time.time()
        self.sources: dict[str, SourceProgress] = {
            ep: SourceProgress(ep, rep, backfill=backfill and rep is not None)
            for ep, rep in zip(endpoints, replay_endpoints)}
        # raw: nothing is decoded; rcvhwm 0: the recorder keeps up or the kernel buffers, ZeroMQ drops nothing
        self.sub = Subscriber([PublisherSpec(ep, rep) for ep, rep in zip(endpoints, replay_endpoints)],
                              topic=topic, late_join=backfill, replay_timeout=replay_timeout, rcvhwm=0,
                              context=context, raw=True)
        self.sub.tap = self._write

    def _write(self, publisher: str | None, socket: str, frames: list[bytes]) -> None:
        src = self.sources[publisher]
        self.writer.write(frames, publisher, time.time(), socket)
        self.frames += 1
        self.bytes += sum(len(f) for f in frames)
        if socket == "pub":
            src.pub += 1
            if not is_live(frames):
                src.malformed += 1
                return
            seq = int.from_bytes(frames[1], "big")
            restarted = src.last_seq is not None and seq <= src.last_seq
            src.last_seq = seq
            if restarted or src.high is None or seq > src.high:
                src.high = seq
            return
        src.replay += 1
        if not is_replay_answer(frames):
            src.malformed += 1
        elif not is_end_marker(frames):
            src.answered += 1
            seq = int.from_bytes(frames[2], "big")
            if src.high is None or seq > src.high:
                src.high = seq

    # ---- loop --------------------------------------------------------------------------------

    def poll_once(self, timeout_ms: int = 100) -> int:
        """Wait up to ``timeout_ms`` for messages, record all that are ready; returns how many."""
        before = self.frames
        self.sub.poll(timeout_ms)  # the deliveries themselves are not needed: the tap wrote the frames
        for name, health in self.sub.health().items():
            src = self.sources[name]
            src.health = health
            if src.backfill and src.high is None:
                self.sub.rejoin(name)  # late join: ask again until the publisher has something
        return self.frames - before

    def run(self, stop: threading.Event, *, duration: float | None = None,
            progress: Callable[["Recorder"], None] | None = None, progress_every: float = 1.0) -> None:
        """Record until ``stop`` is set or ``duration`` seconds have passed."""
        start = time.monotonic()
        next_progress = start + progress_every
        while not stop.is_set():
            now = time.monotonic()
            if duration is not None and now - start >= duration:
                break
            wait = 100 if duration is None else max(0, min(100, int((start + duration - now) * 1000) + 1))
            self.poll_once(wait)
            if progress is not None and time.monotonic() >= next_progress:
                next_progress += progress_every
                progress(self)

    def close(self) -> None:
        self.sub.close()


# ---- replay ----------------------------------------------------------------------------------


@dataclass(slots=True)
class ReplayReport:
    published: dict[str, int] = field(default_factory=dict)  #: by recorded publisher
    gaps: int = 0  #: batches missing from the recording even after healing (not published)
    resets: int = 0
    skipped: int = 0  #: batches of publishers not selected
    unsent: int = 0  #: batches the publishers could not send before shutdown
    stopped: bool = False  #: ended early by ``stop``


def _await_sent(pubs: dict, report: ReplayReport, stop: threading.Event, timeout: float = 10.0) -> None:
    """Wait until every batch handed to a publisher has gone out and sits in its replay ring."""
    deadline = time.monotonic() + timeout
    for name, pub in pubs.items():
        while time.monotonic() < deadline and not stop.is_set():
            st = pub.stats()
            if st["ring_batches"] + st["ring_evicted"] >= report.published[name]:
                break
            stop.wait(0.002)


def recording_publishers(path) -> list[str]:
    """Publisher identities in a recording, in order of first appearance."""
    seen: dict[str, None] = {}
    with RecordingReader(path) as reader:
        for rec in reader:
            seen.setdefault(rec.publisher, None)
    return list(seen)


def replay_recording(path, targets: dict[str, tuple[str, str | None]], *, speed: float = 1.0,
                     topic: str | None = None, stop: threading.Event | None = None, start_delay: float = 0.0,
                     linger: float = 0.0, on_published: Callable[[ReplayReport], None] | None = None,
                     publisher_options: dict | None = None,
                     on_publish: Callable[[str, int], None] | None = None) -> ReplayReport:
    """Publish the healed stream of the recording at ``path`` again.

    ``targets`` maps a recorded publisher identity to ``(endpoint, replay_endpoint)``; batches of
    other publishers are skipped. Each batch goes out with its recorded seq and topic (or
    ``topic``), spaced as recorded divided by ``speed`` (0: as fast as possible). After the last
    batch has gone out (and sits in the replay ring), ``on_published(report)`` is called and the publishers keep answering replay requests for ``linger``
    seconds (or until ``stop``), then shut down.
    """
    from .transport.zmq.publisher import ZmqEventPublisher

    if speed < 0:
        raise ValueError(f"speed must be >= 0, got {speed}")
    stop = stop or threading.Event()
    report = ReplayReport()
    pubs = {}
    try:
        for name, (ep, rep) in targets.items():
            pubs[name] = ZmqEventPublisher(ep, rep, topic=topic or "", **(publisher_options or {}))
            report.published[name] = 0
        if start_delay > 0 and stop.wait(start_delay):
            report.stopped = True
            return report
        with RecordingReader(path) as reader:
            stream = DeliveryStream(decode=False, late_join=bool(reader.meta.get("backfill")))
            t0_wall = t0_rec = None

            def emit(ds) -> bool:
                nonlocal t0_wall, t0_rec
                for d in ds:
                    pub = pubs.get(d.publisher)
                    if d.kind is DeliveryKind.GAP:
                        report.gaps += d.missed
                        continue
                    if d.kind is DeliveryKind.RESET:
                        report.resets += 1
                        continue
                    if pub is None:
                        report.skipped += 1
                        continue
                    if speed > 0:
                        if t0_wall is None:
                            t0_wall, t0_rec = time.monotonic(), d.recv_ts
                        due = t0_wall + max(0.0, d.recv_ts - t0_rec) / speed
                        delay = due - time.monotonic()
                        if delay > 0 and stop.wait(delay):
                            return False
                    elif stop.is_set():
                        return False
                    payload = d.payload if d.batch is None else d.batch  # (a raw stream: the payload)
                    pub.publish_raw(payload, seq=d.seq & 0xFFFFFFFFFFFFFFFF, topic=d.topic if topic is None else topic)
                    report.published[d.publisher] += 1
                    if on_publish is not None:
                        on_publish(d.publisher, d.seq)
                return True

            for rec in reader:
                if not emit(stream.push(rec)):
                    report.stopped = True
                    return report
            if not emit(stream.finish()):
                report.stopped = True
                return report
        _await_sent(pubs, report, stop)
        if on_published is not None:
            on_published(report)
        if linger > 0:
            stop.wait(linger)
        return report
    finally:
        for pub in pubs.values():
            report.unsent += pub.shutdown(timeout=1.0).unsent
