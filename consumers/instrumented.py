"""Telemetry wrappers of the :class:`~consumers.index.Index` role, each in front of another
backend (or of another wrapper): :class:`InstrumentedIndex` counts what goes through it (plain
ints, read by :func:`consumers.telemetry.observe_router`); :class:`TracedIndex` makes a span for
each of the rare, heavy operations (a pod's clear, an eviction pass, a grow, a snapshot load).
Both delegate everything else through :class:`IndexWrapper`.

Chosen with ``RouterConfig(index_metrics=True)``; the wrapped backend is whichever
``RouterConfig.index`` picks. Observability wraps: the backend never knows it is watched.

The native ingestor writes the common events straight into the native backend's C table
(:meth:`~consumers.index.Index.native_table`): the wrapper hands that table on, so a router
with an instrumented index keeps its C ingest. Those writes do not pass through the wrapper;
they are what the router's own counters count (``blocks_stored``, ``offload_blocks``,
``blocks_removed``), while the entry, key and eviction counts read here come from the backend
itself and include them. What the wrapper counts is every call made through the role: the
scorer's lookups, the Python ingest path's updates, clears, evictions, snapshots.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

from .index import Index

__all__ = ["IndexWrapper", "InstrumentedIndex", "OPS", "TracedIndex"]

#: operations counted per call (``calls``) and per key handled (``keys``)
OPS = ("add_chain", "add", "remove", "clear", "evict", "match", "walk_back", "load")


def _delegated(name: str) -> property:
    return property(lambda self: getattr(self.inner, name), lambda self, v: setattr(self.inner, name, v),
                    doc=f"The wrapped backend's ``{name}``.")


class IndexWrapper(Index):
    """The Index role in front of ``inner``: every operation delegated; a telemetry wrapper
    overrides the ones it watches."""

    __slots__ = ("inner",)

    def __init__(self, inner: Index) -> None:
        self.inner = inner

    cap = _delegated("cap")
    max_tiers = _delegated("max_tiers")
    max_entries = _delegated("max_entries")
    entries = _delegated("entries")
    evicted_keys = _delegated("evicted_keys")
    evicted_entries = _delegated("evicted_entries")

    def __getattr__(self, name: str):  # a backend's own extras (low_water, masks, compact, ...)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    # --- updates
    def add_chain(self, keys: list[int], bit: int, parent: int | None) -> None:
        self.inner.add_chain(keys, bit, parent)

    def add(self, keys: list[int], bit: int) -> None:
        self.inner.add(keys, bit)

    def remove(self, keys: list[int], bit: int) -> int:
        return self.inner.remove(keys, bit)

    def clear_bits(self, bits: int) -> int:
        return self.inner.clear_bits(bits)

    def clear_slot(self, slot: int) -> int:
        return self.inner.clear_slot(slot)

    def grow(self, new_cap: int) -> None:
        self.inner.grow(new_cap)

    def evict(self) -> None:
        self.inner.evict()

    # --- queries
    def mask(self, key: int) -> int | None:
        return self.inner.mask(key)

    def match(self, keys: list[int], lanes: list[tuple[int, int]], start: int):
        return self.inner.match(keys, lanes, start)

    def matched_natively(self, n_keys: int) -> None:
        self.inner.matched_natively(n_keys)

    def walk_back(self, key: int, n: int, stop: int | None = None) -> list[int]:
        return self.inner.walk_back(key, n, stop)

    def keys_between(self, key: int, stop: int, limit: int) -> list[int] | None:
        return self.inner.keys_between(key, stop, limit)

    def items(self) -> Iterator[tuple[int, int, int | None]]:
        return self.inner.items()

    def load(self, items: Iterable[tuple[int, int, int | None]]) -> None:
        self.inner.load(items)

    def lane_counts(self, tiers: int) -> list[int]:
        return self.inner.lane_counts(tiers)

    def __len__(self) -> int:
        return len(self.inner)

    def nbytes(self) -> dict[str, int]:
        return self.inner.nbytes()

    def native_table(self):
        """The wrapped backend's C table: the native ingestor writes to it directly and the
        scorer walks it in C (those writes are the router's counters, not a wrapper's)."""
        return self.inner.native_table()

    def stats(self) -> dict[str, int]:
        return self.inner.stats()


class InstrumentedIndex(IndexWrapper):
    """Counts calls and keys per operation through the Index role (``calls``, ``keys``), C
    scoring walks included (:meth:`~consumers.index.Index.matched_natively`)."""

    __slots__ = ("calls", "keys")

    def __init__(self, inner: Index) -> None:
        super().__init__(inner)
        self.calls: dict[str, int] = dict.fromkeys(OPS, 0)
        self.keys: dict[str, int] = dict.fromkeys(OPS, 0)

    def _count(self, op: str, n: int) -> None:
        self.calls[op] += 1
        self.keys[op] += n

    def add_chain(self, keys: list[int], bit: int, parent: int | None) -> None:
        self._count("add_chain", len(keys))
        self.inner.add_chain(keys, bit, parent)

    def add(self, keys: list[int], bit: int) -> None:
        self._count("add", len(keys))
        self.inner.add(keys, bit)

    def remove(self, keys: list[int], bit: int) -> int:
        self._count("remove", len(keys))
        return self.inner.remove(keys, bit)

    def clear_bits(self, bits: int) -> int:
        n = self.inner.clear_bits(bits)
        self._count("clear", n)
        return n

    def clear_slot(self, slot: int) -> int:
        n = self.inner.clear_slot(slot)
        self._count("clear", n)
        return n

    def evict(self) -> None:
        before = self.inner.evicted_entries
        self.inner.evict()
        self._count("evict", self.inner.evicted_entries - before)

    def match(self, keys: list[int], lanes: list[tuple[int, int]], start: int):
        self._count("match", len(keys))
        return self.inner.match(keys, lanes, start)

    def matched_natively(self, n_keys: int) -> None:
        self._count("match", n_keys)
        self.inner.matched_natively(n_keys)

    def walk_back(self, key: int, n: int, stop: int | None = None) -> list[int]:
        out = self.inner.walk_back(key, n, stop)
        self._count("walk_back", len(out))
        return out

    def load(self, items: Iterable[tuple[int, int, int | None]]) -> None:
        items = list(items)
        self._count("load", len(items))
        self.inner.load(items)

    def stats(self) -> dict[str, int]:
        out = self.inner.stats()
        out.update({f"{op}_calls": n for op, n in self.calls.items()})
        return out


#: the operations TracedIndex makes a span for: rare, and each may touch the whole index
TRACED_OPS = ("clear", "evict", "grow", "load")


class TracedIndex(IndexWrapper):
    """A ``kvevents.router.index.<op>`` span (INTERNAL) for each clear, eviction pass, grow and
    snapshot load, with the entries it touched (``kvevents.index.entries``) and the index's
    size after it (``kvevents.index.size``). The per-key hot operations pass straight through:
    they are the score span's and the process span's children in time, not spans of their own.

    Chosen with ``RouterConfig(index_tracing=True)``; spans are made while ``tracer`` is set
    (:func:`consumers.telemetry.instrument_router` sets it, and clears it on ``close()``)."""

    __slots__ = ("tracer",)

    def __init__(self, inner: Index, tracer: Any = None) -> None:
        super().__init__(inner)
        self.tracer = tracer

    def _span(self, op: str, t0: int, touched: int, **attrs: int) -> None:
        attributes = {"kvevents.index.entries": touched, "kvevents.index.size": len(self.inner), **attrs}
        span = self.tracer.start_span(f"kvevents.router.index.{op}", start_time=t0, attributes=attributes)
        span.end()

    def clear_bits(self, bits: int) -> int:
        if self.tracer is None:
            return self.inner.clear_bits(bits)
        t0 = time.time_ns()
        n = self.inner.clear_bits(bits)
        self._span("clear", t0, n)
        return n

    def clear_slot(self, slot: int) -> int:
        if self.tracer is None:
            return self.inner.clear_slot(slot)
        t0 = time.time_ns()
        n = self.inner.clear_slot(slot)
        self._span("clear", t0, n, **{"kvevents.index.slot": slot})
        return n

    def evict(self) -> None:
        if self.tracer is None:
            return self.inner.evict()
        t0 = time.time_ns()
        before = self.inner.evicted_entries
        self.inner.evict()
        self._span("evict", t0, self.inner.evicted_entries - before)

    def grow(self, new_cap: int) -> None:
        if self.tracer is None:
            return self.inner.grow(new_cap)
        t0 = time.time_ns()
        self.inner.grow(new_cap)
        self._span("grow", t0, len(self.inner), **{"kvevents.index.cap": new_cap})

    def load(self, items: Iterable[tuple[int, int, int | None]]) -> None:
        if self.tracer is None:
            return self.inner.load(items)
        t0 = time.time_ns()
        self.inner.load(items)
        self._span("load", t0, len(self.inner))


def find_wrapper(index: Index, kind: type) -> Any:
    """The first wrapper of type ``kind`` in front of ``index`` (outermost first), or None."""
    while isinstance(index, IndexWrapper):
        if isinstance(index, kind):
            return index
        index = index.inner
    return None
