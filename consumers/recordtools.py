"""Recordings and event streams as :class:`~kvevents.Delivery` objects, for consumers and their tests.

* :class:`Recording`: a recording file (``.kvrec``) or a conformance capture (``.jsonl``) loaded
  in memory, with its damage counters; ``deliveries()`` heals it as a live subscriber would have.
* :class:`SeqHealer`: the same for hand-made streams of ``(publisher, seq, batch)``, with the
  same tracker: batches arriving out of order are held until the gap is filled (a replayed
  batch fills a gap, duplicates are dropped), a seq going backwards is a publisher restart
  (RESET), holes left at the end are GAPs.
* :func:`as_deliveries`: any of those (a path, a Recording, Records, Deliveries, tuples) as Deliveries.
* :func:`pod_of`: a delivery's pod: from a ``kv@<pod>@<model>`` topic, else the publisher identity
  (:meth:`consumers.KVRouter.pod_for` is the router's own rule, with configured names).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from kvevents.delivery import Delivery, DeliveryKind
from kvevents.events import KVEventBatch
from kvevents.recording import Record, RecordingReader, capture_records
from kvevents.recordstream import DeliveryStream
from kvevents.topic import topic_pod
from kvevents.tracker import SeqTracker

__all__ = ["Recording", "SeqHealer", "as_deliveries", "topic_pod", "pod_of"]

BATCH, RESET, GAP = DeliveryKind.BATCH, DeliveryKind.RESET, DeliveryKind.GAP


def pod_of(d: Delivery) -> str:
    return topic_pod(d.topic) or d.publisher


@dataclass(slots=True)
class Recording:
    """A recording (or capture) in memory."""

    records: list[Record]
    path: Path | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    truncated_bytes: int = 0
    bad_records: int = 0
    undecodable: int = 0  #: records with a valid CRC whose body is not a record (see RecordingReader)

    @classmethod
    def load(cls, source: str | os.PathLike, *, publisher: str | None = None) -> "Recording":
        """Read a ``.kvrec`` recording, or convert a ``.jsonl`` capture (in memory) on the fly.

        Raises :class:`kvevents.recording.RecordingError` for a file that is neither.
        """
        path = Path(source)
        if path.suffix == ".jsonl":
            records = list(capture_records(path, publisher))
            return cls(records, path, {"source": str(path)})
        with RecordingReader(path) as reader:
            records = list(reader)
        if publisher is not None:
            records = [Record(r.recv_ts, publisher, r.socket, r.frames) for r in records]
        return cls(records, path, reader.meta, reader.truncated_bytes, reader.bad_records, reader.undecodable)

    @property
    def publishers(self) -> list[str]:
        return list(dict.fromkeys(r.publisher for r in self.records))

    def deliveries(self, **options: Any) -> Iterator[Delivery]:
        """The healed stream (see :class:`kvevents.recordstream.DeliveryStream` for ``options``)."""
        options.setdefault("late_join", bool(self.meta.get("backfill")))
        stream = DeliveryStream(**options)
        for rec in self.records:
            yield from stream.push(rec)
        yield from stream.finish()

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)


class SeqHealer:
    """Turns ``(publisher, seq, batch)`` arrivals, in any order, into an in-order Delivery stream.

    The healing is :class:`kvevents.tracker.SeqTracker`'s, the one every subscriber and
    recording uses (one tracker per publisher): a seq past the next expected one opens a hole
    whose later batches are held; a batch arriving inside the hole fills it
    (:meth:`~kvevents.tracker.SeqTracker.on_fill`); what is held is delivered as soon as the
    run from the hole is complete. What this class adds is the rule for a seq below the next
    expected one, which a hand-made stream cannot tell apart otherwise: a duplicate when it is
    flagged ``replayed``, is held already, or equals the batch delivered at that seq (the last
    ``recent`` are kept); else the publisher restarted (RESET). ``from_zero``: a publisher's
    stream starts at seq 0 (earlier seqs missing are a gap), else at the first seq seen. Past
    ``max_pending`` held batches per publisher the holes are given up as GAPs.
    """

    def __init__(self, *, from_zero: bool = False, max_pending: int = 10_000, recent: int = 1024) -> None:
        self.from_zero = from_zero
        self.max_pending = max_pending
        self.recent_size = recent
        self.duplicates = 0
        self._trackers: dict[str, SeqTracker] = {}
        self._recent: dict[str, dict[int, KVEventBatch]] = {}

    def _tracker(self, publisher: str, topic: str) -> SeqTracker:
        t = self._trackers.get(publisher)
        if t is None:
            # can_replay: a hole is held open for its batches to fill, as a subscriber holds
            # one for a replay; nobody sends the request (t.request is cleared after each push)
            t = self._trackers[publisher] = SeqTracker(publisher, topic, can_replay=True, max_pending=self.max_pending,
                                                       max_attempts=1 << 62)
            if self.from_zero:
                t.expected = 0
        return t

    def push(self, publisher: str, seq: int, batch: KVEventBatch, *, replayed: bool = False,
             topic: str = "", recv_ts: float = 0.0) -> list[Delivery]:
        t = self._tracker(publisher, topic)
        recent = self._recent.setdefault(publisher, {})
        exp = t.expected
        if seq in t.pending or (exp is not None and seq < exp and (
                replayed or recent.get(seq) == batch or seq > t.live_high)):
            self.duplicates += 1
            return []
        if t.recovering and seq < t.live_high and not (exp is not None and seq < exp):
            out = t.on_fill(seq, batch, recv_ts, replayed)  # inside the hole: fills it
        else:  # next in line, a new hole, or (below the expected seq) a restart: RESET
            out = t.on_live(seq, batch, recv_ts, topic)
        t.request = None
        self._remember(recent, out)
        return out

    def _remember(self, recent: dict[int, KVEventBatch], out: list[Delivery]) -> None:
        for d in out:
            if d.kind is BATCH:
                recent[d.seq] = d.batch
                if len(recent) > self.recent_size:
                    del recent[next(iter(recent))]
            elif d.kind is RESET:
                recent.clear()

    def finish(self) -> list[Delivery]:
        """Holes still open are given up as GAPs; what was held after them is delivered."""
        out: list[Delivery] = []
        for publisher, t in self._trackers.items():
            got = t.tick(float("inf"))
            self._remember(self._recent.setdefault(publisher, {}), got)
            out += got
        return out


def as_deliveries(source: Any, **options: Any) -> Iterator[Delivery]:
    """Deliveries from a recording path, a :class:`Recording`, Records, Deliveries, or tuples.

    Tuples are ``(publisher, seq, batch)`` or ``(publisher, seq, batch, replayed)``, healed by a
    :class:`SeqHealer` (``options`` go to it); Records and recordings are healed by
    :class:`~kvevents.recordstream.DeliveryStream` (``options`` go to it).
    """
    if isinstance(source, (str, os.PathLike)):
        source = Recording.load(source)
    if isinstance(source, Recording):
        yield from source.deliveries(**options)
        return
    it = iter(source)
    first = next(it, None)
    if first is None:
        return
    if isinstance(first, Delivery):
        yield first
        yield from it
        return
    if isinstance(first, Record):
        stream = DeliveryStream(**options)
        yield from stream.push(first)
        for rec in it:
            yield from stream.push(rec)
        yield from stream.finish()
        return
    healer = SeqHealer(**options)
    for item in _chain(first, it):
        if not isinstance(item, tuple) or len(item) not in (3, 4):
            raise TypeError(f"expected Delivery, Record or (publisher, seq, batch[, replayed]) tuples, got {item!r:.80}")
        yield from healer.push(item[0], item[1], item[2], replayed=bool(item[3]) if len(item) == 4 else False)
    yield from healer.finish()


def _chain(first, it):
    yield first
    yield from it
