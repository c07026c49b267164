"""Telemetry decorators of the :class:`~consumers.index.Index` role: each holds the ``next``
index (a backend or another decorator) and forwards the eight verbs to it.
:class:`InstrumentedIndex` counts what goes through it (plain ints, read by
:func:`consumers.telemetry.observe_router`); :class:`TracedIndex` makes a span for each of the
rare, heavy operations (an endpoint's clear, an eviction a store caused, a snapshot restore).

Chosen with ``RouterConfig(index_metrics=True)`` / ``index_tracing=True``; the decorated
backend is whichever ``RouterConfig.index`` picks. Observability decorates: the backend never
knows it is watched.

The C ingest and score paths do not go through the role at all: the router hands them the
native backend's table once, at construction (:func:`consumers.index.accelerator`), whatever
decorates it. Their work is what the router's own counters count (``blocks_stored``,
``offload_blocks``, ``blocks_removed``, ``lookups``); the entry, key and eviction counts read
here come from the backend itself and include it. What a decorator counts is every call made
through the role: the Python ingest path's stores and removals, clears, matches (the Python
score walk and ``explain``), lineage walks, snapshots.
"""

from __future__ import annotations

import time
from typing import Any

from .index import Index, IndexImage

__all__ = ["IndexDecorator", "InstrumentedIndex", "OPS", "TracedIndex", "find_wrapper"]

#: operations counted per call (``calls``) and per key handled (``keys``)
OPS = ("store", "remove", "clear", "match", "lineage", "snapshot", "restore")


class IndexDecorator(Index):
    """The Index role in front of ``next``: every verb forwarded; a telemetry decorator
    overrides the ones it watches."""

    __slots__ = ("next",)

    def __init__(self, next: Index) -> None:  # noqa: A002 (the decorated index, as llm-d names it)
        self.next = next

    def store(self, endpoint: int, tier: int, keys: list[int], parent: int | None = None, *,
              chain: bool = True) -> None:
        self.next.store(endpoint, tier, keys, parent, chain=chain)

    def remove(self, endpoint: int, tier: int, keys: list[int]) -> int:
        return self.next.remove(endpoint, tier, keys)

    def clear(self, endpoint: int) -> int:
        return self.next.clear(endpoint)

    def match(self, keys: list[int], tiers, endpoints):
        return self.next.match(keys, tiers, endpoints)

    def lineage(self, key: int, n: int, stop: int | None = None) -> list[int]:
        return self.next.lineage(key, n, stop)

    def keys_between(self, key: int, stop: int, limit: int) -> list[int] | None:
        return self.next.keys_between(key, stop, limit)

    def stats(self, detail: str | None = None) -> dict[str, Any]:
        return self.next.stats(detail)

    def snapshot(self) -> IndexImage:
        return self.next.snapshot()

    def restore(self, image: IndexImage) -> None:
        self.next.restore(image)

    def __len__(self) -> int:
        return len(self.next)


class InstrumentedIndex(IndexDecorator):
    """Counts calls and keys per verb through the role (``calls``, ``keys``)."""

    __slots__ = ("calls", "keys")

    def __init__(self, next: Index) -> None:  # noqa: A002
        super().__init__(next)
        self.calls: dict[str, int] = dict.fromkeys(OPS, 0)
        self.keys: dict[str, int] = dict.fromkeys(OPS, 0)

    def _count(self, op: str, n: int) -> None:
        self.calls[op] += 1
        self.keys[op] += n

    def store(self, endpoint: int, tier: int, keys: list[int], parent: int | None = None, *,
              chain: bool = True) -> None:
        self._count("store", len(keys))
        self.next.store(endpoint, tier, keys, parent, chain=chain)

    def remove(self, endpoint: int, tier: int, keys: list[int]) -> int:
        self._count("remove", len(keys))
        return self.next.remove(endpoint, tier, keys)

    def clear(self, endpoint: int) -> int:
        n = self.next.clear(endpoint)
        self._count("clear", n)
        return n

    def match(self, keys: list[int], tiers, endpoints):
        self._count("match", len(keys))
        return self.next.match(keys, tiers, endpoints)

    def lineage(self, key: int, n: int, stop: int | None = None) -> list[int]:
        out = self.next.lineage(key, n, stop)
        self._count("lineage", len(out))
        return out

    def snapshot(self) -> IndexImage:
        image = self.next.snapshot()
        self._count("snapshot", 0)
        return image

    def restore(self, image: IndexImage) -> None:
        records = list(image.records)
        self._count("restore", len(records))
        self.next.restore(image._replace(records=records))

    def stats(self, detail: str | None = None) -> dict[str, Any]:
        out = self.next.stats(detail)
        out.update({f"{op}_calls": n for op, n in self.calls.items()})
        return out


#: the operations TracedIndex makes a span for: rare, and each may touch the whole index
TRACED_OPS = ("clear", "evict", "restore")


class TracedIndex(IndexDecorator):
    """A ``kvevents.router.index.<op>`` span (INTERNAL) for each clear, each store that made the
    backend evict (``evict``, with the entries evicted) and each snapshot restore, with the
    entries it touched (``kvevents.index.entries``) and the index's size after it
    (``kvevents.index.size``). The per-key verbs otherwise pass straight through: they are the
    score span's and the process span's children in time, not spans of their own.

    Chosen with ``RouterConfig(index_tracing=True)``; spans are made while ``tracer`` is set
    (:func:`consumers.telemetry.instrument_router` sets it, and clears it on ``close()``)."""

    __slots__ = ("tracer",)

    def __init__(self, next: Index, tracer: Any = None) -> None:  # noqa: A002
        super().__init__(next)
        self.tracer = tracer

    def _span(self, op: str, t0: int, touched: int, **attrs: int) -> None:
        attributes = {"kvevents.index.entries": touched, "kvevents.index.size": len(self.next), **attrs}
        span = self.tracer.start_span(f"kvevents.router.index.{op}", start_time=t0, attributes=attributes)
        span.end()

    def store(self, endpoint: int, tier: int, keys: list[int], parent: int | None = None, *,
              chain: bool = True) -> None:
        if self.tracer is None:
            return self.next.store(endpoint, tier, keys, parent, chain=chain)
        t0 = time.time_ns()
        before = self.next.stats()["evicted_entries"]
        self.next.store(endpoint, tier, keys, parent, chain=chain)
        evicted = self.next.stats()["evicted_entries"] - before
        if evicted:
            self._span("evict", t0, evicted)

    def clear(self, endpoint: int) -> int:
        if self.tracer is None:
            return self.next.clear(endpoint)
        t0 = time.time_ns()
        n = self.next.clear(endpoint)
        self._span("clear", t0, n, **{"kvevents.index.slot": endpoint})
        return n

    def restore(self, image: IndexImage) -> None:
        if self.tracer is None:
            return self.next.restore(image)
        t0 = time.time_ns()
        self.next.restore(image)
        self._span("restore", t0, len(self.next))


def find_wrapper(index: Index, kind: type) -> Any:
    """The first decorator of type ``kind`` in front of ``index`` (outermost first), or None."""
    while isinstance(index, IndexDecorator):
        if isinstance(index, kind):
            return index
        index = index.next
    return None
