"""Record live publishers to a recording file, and publish a recording again.

:class:`Recorder` connects one raw SUB socket per PUB endpoint (so every frame is kept exactly
as sent, and the endpoint is the publisher's identity) and, where a replay endpoint is given, a
DEALER to that publisher's replay socket: when the live seq jumps it asks for the missing
batches, and records the answers (socket ``"replay"``) beside the live frames. Healing happens
when the file is read (:mod:`kvevents.recordstream`), so the file holds what was on the wire.

:func:`replay_recording` publishes a recording through :class:`~kvevents.publisher.ZmqEventPublisher`
with the recorded sequence numbers and timing (scaled by ``speed``); its replay socket answers
replay requests from the ring as the original publisher would have.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import zmq

from .transport.zmq.endpoints import validate_endpoint
from .transport.zmq.frames import is_end_marker, is_replay_answer, replay_request
from .errors import EndpointError
from .recording import RecordingReader, RecordingWriter
from .recordstream import DeliveryStream
from .delivery import DeliveryKind

__all__ = ["Recorder", "SourceProgress", "replay_recording", "ReplayReport"]


@dataclass(slots=True)
class SourceProgress:
    """Per-publisher counters of a recorder."""

    endpoint: str
    replay_endpoint: str | None = None
    pub: int = 0  #: live messages recorded
    replay: int = 0  #: replay answers recorded (end markers included)
    last_seq: int | None = None  #: last live seq
    high: int | None = None  #: highest seq recorded from either socket (since the last restart)
    gaps: int = 0  #: live seq jumps seen
    resets: int = 0  #: live seq went backwards
    replay_requests: int = 0
    replay_timeouts: int = 0  #: requests whose end marker did not come within replay_timeout
    malformed: int = 0  #: messages that are not [topic, 8-byte seq, payload] (recorded anyway)
    # request state
    outstanding: float | None = None  #: when the outstanding request was sent
    asked: int | None = None  #: start seq of the outstanding request (asked again if it times out)
    want: int | None = None  #: a start seq to ask for once the outstanding request ends
    backfill: bool = False  #: ask for what the publisher held before we joined (from seq 0)
    answered: int = 0  #: batches in replay answers


class Recorder:
    """Records every message from ``endpoints`` (and their replay answers) into ``writer``.

    ``replay_endpoints``: None, or one per endpoint (None where a publisher has none).
    ``backfill``: also ask each publisher's replay socket for everything it still holds from
    seq 0 (its answers are recorded; readers use them with ``late_join``).
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
        self.sources: dict[str, SourceProgress] = {}
        self._ctx = context or zmq.Context.instance()
        self._poller = zmq.Poller()
        self._subs: dict[zmq.Socket, SourceProgress] = {}
        self._dealers: dict[zmq.Socket, SourceProgress] = {}
        self._dealer_of: dict[str, zmq.Socket] = {}
        try:
            for ep, rep in zip(endpoints, replay_endpoints):
                src = SourceProgress(ep, rep, backfill=backfill and rep is not None)
                self.sources[ep] = src
                sub = self._ctx.socket(zmq.SUB)
                sub.setsockopt(zmq.LINGER, 0)
                sub.setsockopt(zmq.RCVHWM, 0)
                self._subs[sub] = src
                sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
                sub.connect(ep)
                self._poller.register(sub, zmq.POLLIN)
                if rep is not None:
                    dealer = self._ctx.socket(zmq.DEALER)
                    dealer.setsockopt(zmq.LINGER, 0)
                    self._dealers[dealer] = src
                    self._dealer_of[ep] = dealer
                    dealer.connect(rep)
                    self._poller.register(dealer, zmq.POLLIN)
        except zmq.ZMQError as exc:
            self.close()
            raise EndpointError(f"cannot connect to {ep!r}: {exc}") from None
        now = time.monotonic()
        for src in self.sources.values():
            if src.backfill:
                self._request(src, 0, now)

    # ---- replay requests ---------------------------------------------------------------------

    def _request(self, src: SourceProgress, start: int, now: float) -> None:
        if src.outstanding is not None:
            src.want = start if src.want is None else min(src.want, start)
            return
        self._dealer_of[src.endpoint].send_multipart(replay_request(start))
        src.outstanding = now
        src.asked = start
        src.replay_requests += 1

    def _on_live(self, src: SourceProgress, frames: list[bytes], now: float) -> None:
        src.pub += 1
        if len(frames) != 3 or len(frames[1]) != 8:
            src.malformed += 1
            return
        seq = int.from_bytes(frames[1], "big")
        if src.last_seq is not None and seq <= src.last_seq:
            src.resets += 1  # the publisher restarted: start over from this seq
            src.last_seq = src.high = seq
            return
        src.last_seq = seq
        ref = src.high if src.high is not None else (-1 if src.backfill else None)
        if ref is not None and seq > ref + 1:
            if src.high is not None:
                src.gaps += 1
            if src.replay_endpoint is not None:
                self._request(src, ref + 1, now)
        if src.high is None or seq > src.high:
            src.high = seq

    def _on_replay(self, src: SourceProgress, frames: list[bytes], now: float) -> None:
        src.replay += 1
        if not is_replay_answer(frames):
            src.malformed += 1
            return
        if frames[1] == b"" and is_end_marker(frames):
            src.outstanding = None
            if src.want is not None:
                start, src.want = src.want, None
                self._request(src, start, now)
        else:
            src.answered += 1
            seq = int.from_bytes(frames[2], "big")
            if src.high is None or seq > src.high:
                src.high = seq

    def _tick(self, now: float) -> None:
        for src in self.sources.values():
            if src.outstanding is not None and now - src.outstanding > self.replay_timeout:
                # no end marker in time (a busy publisher, a loaded machine): ask again, from the
                # earliest start still wanted, rather than leave a hole in the recording
                src.outstanding = None
                src.replay_timeouts += 1
                start = src.asked if src.want is None else min(src.want, src.asked)
                src.want = None
                self._request(src, start, now)
            elif src.backfill and src.outstanding is None and src.high is None:
                self._request(src, 0, now)  # late join: ask again until the publisher has something

    # ---- loop --------------------------------------------------------------------------------

    def poll_once(self, timeout_ms: int = 100) -> int:
        """Wait up to ``timeout_ms`` for messages, record all that are ready; returns how many."""
        n = 0
        for sock, _ in self._poller.poll(timeout_ms):
            src = self._subs.get(sock)
            kind = "pub" if src is not None else "replay"
            if src is None:
                src = self._dealers[sock]
            for _ in range(1000):
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                now = time.time()
                self.writer.write(frames, src.endpoint, now, kind)
                self.frames += 1
                self.bytes += sum(len(f) for f in frames)
                n += 1
                mono = time.monotonic()
                (self._on_live if kind == "pub" else self._on_replay)(src, frames, mono)
        self._tick(time.monotonic())
        return n

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
        for sock in list(self._subs) + list(self._dealers):
            sock.close(0)
        self._subs.clear()
        self._dealers.clear()


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
                    pub.publish_raw(payload, seq=d.seq & 0xFFFFFFFFFFFFFFFF, topic=topic or d.topic)
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
