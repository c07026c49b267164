"""A recording read back as the stream a :class:`kvevents.Subscriber` would have delivered.

:class:`DeliveryStream` feeds each record to the same per-publisher
:class:`~kvevents.tracker.SeqTracker` the live subscriber uses, with the record's receive time as
the clock: live batches in order, gaps healed by the replay answers the recording holds (a
replayed batch fills a gap; duplicates are dropped), held batches released when the answer ends
or its time runs out, publisher restarts as RESET, what could not be healed as GAP.
:class:`RecordingSource` is that stream as an :class:`~kvevents.source.EventSource`
(``open_source("file:run.kvrec")``), for any consumer that takes a live subscriber.
:func:`summarize` is what ``kvevents inspect`` prints.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Iterator

from .codec import BatchDecoder
from .delivery import Delivery, DeliveryKind, PublisherHealth
from .errors import ConfigError, DecodeError
from .events import AllBlocksCleared
from .recording import Record, RecordingReader, capture_records
from .source import EventSource
from .tracker import SeqTracker

__all__ = ["DeliveryStream", "RecordingSource", "iter_deliveries", "summarize", "PublisherSummary"]

_INF = float("inf")


class DeliveryStream:
    """Push records in file order, get deliveries back; call :meth:`finish` at the end.

    ``decode=False`` leaves each BATCH delivery undecoded: ``batch`` None and ``payload`` the
    recorded bytes (for re-publishing exactly what was recorded), as ``Subscriber(raw=True)``. ``late_join=True`` treats each publisher's stream
    as starting at seq 0, so replay answers recorded before its first live batch are used
    (recordings made with ``kvevents record --backfill``).
    """

    def __init__(self, *, decode: bool = True, late_join: bool = False, can_replay: bool = True,
                 replay_timeout: float = 2.0, max_pending: int = 10_000) -> None:
        self.decode = decode
        self.late_join = late_join
        self.can_replay = can_replay
        self.replay_timeout = replay_timeout
        self.max_pending = max_pending
        self.trackers: dict[str, SeqTracker] = {}
        self.malformed_frames: Counter[str] = Counter()  #: messages without [topic, 8-byte seq, payload]
        self.undecodable: Counter[str] = Counter()  #: payloads that are not a KVEventBatch
        self._decoder = BatchDecoder()
        self._waiting: set[str] = set()  # publishers whose tracker awaits a replay answer

    def _tracker(self, rec: Record) -> SeqTracker:
        t = self.trackers.get(rec.publisher)
        if t is None:
            t = SeqTracker(rec.publisher, can_replay=self.can_replay, late_join=self.late_join,
                           replay_timeout=self.replay_timeout, max_pending=self.max_pending, now=rec.recv_ts)
            self.trackers[rec.publisher] = t
        return t

    def _batch(self, rec: Record):
        if not self.decode:
            return rec.payload
        try:
            return self._decoder.decode(rec.payload)
        except DecodeError:
            self.undecodable[rec.publisher] += 1
            return None

    def push(self, rec: Record) -> list[Delivery]:
        out: list[Delivery] = []
        now = rec.recv_ts
        for name in list(self._waiting):
            if name != rec.publisher:
                out += self._settle(self.trackers[name], self.trackers[name].tick(now))
        if not rec.well_formed:
            self.malformed_frames[rec.publisher] += 1
            return out
        t = self._tracker(rec)
        if rec.socket == "replay":
            if rec.is_end_marker:
                got = t.on_replay_end(now)
            else:
                got = t.on_replay(rec.seq, self._batch(rec), now)
        else:
            got = t.tick(now)
            got += t.on_live(rec.seq, self._batch(rec), now, rec.topic.decode("utf-8", "replace"))
        return out + self._settle(t, got)

    def _settle(self, t: SeqTracker, got: list[Delivery]) -> list[Delivery]:
        t.request = None  # offline: the answer, if any, is already in the file
        if t.recovering:
            self._waiting.add(t.publisher)
        else:
            self._waiting.discard(t.publisher)
        return got

    def finish(self) -> list[Delivery]:
        """End of the recording: what is still held is released, with the gaps it leaves."""
        out: list[Delivery] = []
        for name in list(self._waiting):
            t = self.trackers[name]
            out += self._settle(t, t.tick(_INF))
        return out


class RecordingSource(EventSource):
    """A recording (``.kvrec``) or conformance capture (``.jsonl``) as an event source.

    ``poll`` returns the next deliveries at once (up to ``chunk`` records' worth; the file is
    read as it goes, never whole), then nothing once :attr:`ended`. ``health()`` is each
    publisher's tracker, as a live subscriber's would read at that point of the stream.
    ``late_join`` defaults to the recording's ``backfill`` flag; ``decode=False`` delivers raw
    payloads (``Delivery.payload``), as ``Subscriber(raw=True)``.
    """

    def __init__(self, path, *, decode: bool = True, late_join: bool | None = None, chunk: int = 256,
                 **stream_options: Any) -> None:
        self.path = Path(path)
        self._reader: RecordingReader | None = None
        if self.path.suffix == ".jsonl":
            records: Iterable[Record] = capture_records(self.path)
            meta: dict[str, Any] = {}
        else:
            self._reader = RecordingReader(self.path)
            records, meta = self._reader, self._reader.meta
        if late_join is None:
            late_join = bool(meta.get("backfill"))
        self.stream = DeliveryStream(decode=decode, late_join=late_join, **stream_options)
        self._records = iter(records)
        self._chunk = chunk
        self._ended = False
        self._closed = False

    @classmethod
    def from_urls(cls, urls: list[str], **options: Any) -> "RecordingSource":
        if len(urls) != 1:
            raise ConfigError(f"a recording source reads one file, got {urls}")
        url = urls[0]
        path = url.split(":", 1)[1] if url.startswith(("file:", "recording:")) else url
        if path.startswith("//"):
            path = path[2:]
        return cls(path, **options)

    @property
    def ended(self) -> bool:
        return self._ended or self._closed

    def poll(self, timeout_ms: int = 100) -> list[Delivery]:
        if self._closed:
            raise RuntimeError("RecordingSource is closed")
        out: list[Delivery] = []
        if self._ended:
            return out
        push = self.stream.push
        for _ in range(self._chunk):
            rec = next(self._records, None)
            if rec is None:
                out += self.stream.finish()
                self._ended = True
                break
            out += push(rec)
        return out

    def health(self) -> dict[str, PublisherHealth]:
        out = {}
        for name, t in self.stream.trackers.items():
            h = t.health
            malformed = dict(h.malformed)
            for kind, counter in (("frames", self.stream.malformed_frames), ("payload", self.stream.undecodable)):
                if counter[name]:
                    malformed[kind] = malformed.get(kind, 0) + counter[name]
            out[name] = replace(h, state=t.state(h.last_recv_ts, float("inf")), malformed=malformed)
        return out

    def close(self) -> None:
        self._closed = True
        if self._reader is not None:
            self._reader.close()


def iter_deliveries(records: Iterable[Record], **options: Any) -> Iterator[Delivery]:
    """Deliveries of ``records`` (see :class:`DeliveryStream` for ``options``)."""
    stream = DeliveryStream(**options)
    for rec in records:
        yield from stream.push(rec)
    yield from stream.finish()


@dataclass(slots=True)
class PublisherSummary:
    publisher: str
    topics: list[str] = field(default_factory=list)
    pub_messages: int = 0
    replay_messages: int = 0  #: replay answers (end markers excluded)
    replay_ends: int = 0
    first_seq: int | None = None  #: first live seq
    last_seq: int | None = None  #: last live seq
    live_gaps: list[tuple[int, int]] = field(default_factory=list)  #: (first, last) seqs missing live
    batches: int = 0  #: batches delivered after healing
    recovered: int = 0  #: of those, filled from replay answers
    unrecovered: int = 0  #: seqs still missing after healing
    resets: int = 0
    malformed_frames: int = 0
    undecodable: int = 0
    first_ts: float | None = None
    last_ts: float | None = None


def _medium(ev) -> str:
    return ev.medium if ev.medium is not None else "GPU"


def summarize(path, *, late_join: bool | None = None) -> dict[str, Any]:
    """What a recording holds: file facts, per-publisher streams, events by type and medium.

    Raises :class:`~kvevents.recording.RecordingError` when ``path`` is not a readable recording.
    """
    pubs: dict[str, PublisherSummary] = {}
    events: Counter[tuple[str, str]] = Counter()
    blocks: Counter[tuple[str, str]] = Counter()
    first_ts = last_ts = None
    n_records = n_pub = n_replay = bad_times = 0
    with RecordingReader(path) as reader:
        lj = bool(reader.meta.get("backfill")) if late_join is None else late_join
        stream = DeliveryStream(late_join=lj)

        def take(ds: list[Delivery]) -> None:
            for d in ds:
                s = pubs[d.publisher]
                if d.kind is DeliveryKind.BATCH:
                    s.batches += 1
                    s.recovered += d.replayed
                    for ev in d.batch.events:
                        if type(ev) is AllBlocksCleared:
                            key = ("AllBlocksCleared", "-")
                        else:
                            key = (type(ev).__name__, _medium(ev))
                            blocks[key] += len(ev.block_hashes)
                        events[key] += 1
                elif d.kind is DeliveryKind.GAP and d.reason != "malformed":
                    s.unrecovered += d.missed
                elif d.kind is DeliveryKind.RESET:
                    s.resets += 1

        for rec in reader:
            n_records += 1
            s = pubs.get(rec.publisher)
            if s is None:
                s = pubs[rec.publisher] = PublisherSummary(rec.publisher)
            if not math.isfinite(rec.recv_ts):
                bad_times += 1  # an infinite time: kept, but no time span (nor valid JSON) comes of it
            else:
                if first_ts is None or rec.recv_ts < first_ts:
                    first_ts = rec.recv_ts
                if last_ts is None or rec.recv_ts > last_ts:
                    last_ts = rec.recv_ts
            if math.isfinite(rec.recv_ts):
                s.first_ts = rec.recv_ts if s.first_ts is None else s.first_ts
                s.last_ts = rec.recv_ts
            if rec.socket == "replay":
                n_replay += 1
                if rec.is_end_marker:
                    s.replay_ends += 1
                elif rec.well_formed:
                    s.replay_messages += 1
            else:
                n_pub += 1
                if rec.well_formed:
                    s.pub_messages += 1
                    seq = rec.seq
                    topic = rec.topic.decode("utf-8", "replace")
                    if topic not in s.topics:
                        s.topics.append(topic)
                    if s.first_seq is None:
                        s.first_seq = seq
                    elif seq > s.last_seq + 1:
                        s.live_gaps.append((s.last_seq + 1, seq - 1))
                    s.last_seq = seq
            take(stream.push(rec))
        take(stream.finish())
        for name, s in pubs.items():
            s.malformed_frames = stream.malformed_frames[name]
            s.undecodable = stream.undecodable[name]
        file_info = {
            "path": str(reader.path), "bytes": reader.size, "version": reader.version, "meta": reader.meta,
            "records": n_records, "truncated_bytes": reader.truncated_bytes, "bad_records": reader.bad_records,
            "skipped_bytes": reader.skipped_bytes, "undecodable_records": reader.undecodable,
            "infinite_times": bad_times,
        }
    return {
        "file": file_info,
        "messages": {"pub": n_pub, "replay": n_replay},
        "time": {"first": first_ts, "last": last_ts,
                 "span_s": (last_ts - first_ts) if first_ts is not None else 0.0},
        "publishers": {name: _summary_dict(s) for name, s in pubs.items()},
        "events": [{"type": t, "medium": m, "events": n, "blocks": blocks.get((t, m), 0)}
                   for (t, m), n in sorted(events.items())],
    }


def _summary_dict(s: PublisherSummary) -> dict[str, Any]:
    return {k: (list(map(list, v)) if k == "live_gaps" else v) for k, v in
            ((k, getattr(s, k)) for k in PublisherSummary.__slots__)}
