"""Recordings and event streams as :class:`~kvevents.Delivery` objects, for consumers and their tests.

* :class:`Recording`: a recording file (``.kvrec``) or a conformance capture (``.jsonl``) loaded
  in memory, with its damage counters; ``deliveries()`` heals it as a live subscriber would have.
* :class:`SeqHealer`: the same for hand-made streams of ``(publisher, seq, batch)``: batches
  arriving out of order are held until the gap is filled (a replayed batch fills a gap,
  duplicates are dropped), a seq going backwards is a publisher restart (RESET), holes left at
  the end are GAPs.
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
        return cls(records, path, reader.meta, reader.truncated_bytes, reader.bad_records)

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

    A seq below the next expected one is a duplicate when it is flagged ``replayed`` or equals the
    batch already delivered at that seq (the last ``recent`` are kept), else the publisher
    restarted (RESET). ``from_zero``: a publisher's stream starts at seq 0 (earlier seqs missing
    are a gap), else at the first seq seen. At most ``max_pending`` batches are held per publisher; past that the
    lowest hole is given up as a GAP.
    """

    def __init__(self, *, from_zero: bool = False, max_pending: int = 10_000, recent: int = 1024) -> None:
        self.from_zero = from_zero
        self.max_pending = max_pending
        self.recent_size = recent
        self.duplicates = 0
        self._next: dict[str, int] = {}
        self._pending: dict[str, dict[int, tuple[KVEventBatch, str, float, bool]]] = {}
        self._recent: dict[str, dict[int, KVEventBatch]] = {}

    def push(self, publisher: str, seq: int, batch: KVEventBatch, *, replayed: bool = False,
             topic: str = "", recv_ts: float = 0.0) -> list[Delivery]:
        out: list[Delivery] = []
        nxt = self._next.get(publisher)
        pending = self._pending.setdefault(publisher, {})
        recent = self._recent.setdefault(publisher, {})
        if nxt is None:
            nxt = self._next[publisher] = 0 if self.from_zero else seq
        if seq < nxt:
            if replayed or recent.get(seq) == batch:
                self.duplicates += 1
                return out
            self._flush(publisher, out)  # the old run's held batches, then the restart
            out.append(Delivery(RESET, publisher, topic, seq, None, recv_ts))
            recent.clear()
            nxt = self._next[publisher] = 0
        if seq in pending:
            self.duplicates += 1
            return out
        pending[seq] = (batch, topic, recv_ts, replayed)
        self._drain(publisher, out)
        if len(pending) > self.max_pending:
            self._give_up_one(publisher, out)
        return out

    def _drain(self, publisher: str, out: list[Delivery]) -> None:
        pending, recent = self._pending[publisher], self._recent[publisher]
        nxt = self._next[publisher]
        while nxt in pending:
            batch, topic, ts, replayed = pending.pop(nxt)
            out.append(Delivery(BATCH, publisher, topic, nxt, batch, ts, 0, replayed))
            recent[nxt] = batch
            if len(recent) > self.recent_size:
                del recent[next(iter(recent))]
            nxt += 1
        self._next[publisher] = nxt

    def _give_up_one(self, publisher: str, out: list[Delivery]) -> None:
        pending = self._pending[publisher]
        nxt = self._next[publisher]
        first = min(pending)
        _, topic, ts, _ = pending[first]
        out.append(Delivery(GAP, publisher, topic, nxt, None, ts, first - nxt, False, "lost"))
        self._next[publisher] = first
        self._drain(publisher, out)

    def _flush(self, publisher: str, out: list[Delivery]) -> None:
        while self._pending.get(publisher):
            self._give_up_one(publisher, out)

    def finish(self) -> list[Delivery]:
        """Holes still open are given up as GAPs; what was held after them is delivered."""
        out: list[Delivery] = []
        for publisher in list(self._pending):
            self._flush(publisher, out)
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
