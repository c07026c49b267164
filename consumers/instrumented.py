"""An instrumented index: the :class:`~consumers.index.Index` role in front of another backend,
counting what goes through it (plain ints, read by :func:`consumers.telemetry.observe_router`).

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

from collections.abc import Iterable, Iterator

from .index import Index

__all__ = ["InstrumentedIndex", "OPS"]

#: operations counted per call (``calls``) and per key handled (``keys``)
OPS = ("add_chain", "add", "remove", "clear", "evict", "match", "walk_back", "load")


def _delegated(name: str) -> property:
    return property(lambda self: getattr(self.inner, name), lambda self, v: setattr(self.inner, name, v),
                    doc=f"The wrapped backend's ``{name}``.")


class InstrumentedIndex(Index):
    """Counts calls and keys per operation through the Index role; everything else is the
    wrapped backend's (``inner``)."""

    __slots__ = ("inner", "calls", "keys")

    def __init__(self, inner: Index) -> None:
        self.inner = inner
        self.calls: dict[str, int] = dict.fromkeys(OPS, 0)
        self.keys: dict[str, int] = dict.fromkeys(OPS, 0)

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

    def _count(self, op: str, n: int) -> None:
        self.calls[op] += 1
        self.keys[op] += n

    # --- updates
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

    def grow(self, new_cap: int) -> None:
        self.inner.grow(new_cap)

    def evict(self) -> None:
        before = self.inner.evicted_entries
        self.inner.evict()
        self._count("evict", self.inner.evicted_entries - before)

    # --- queries
    def mask(self, key: int) -> int | None:
        return self.inner.mask(key)

    def match(self, keys: list[int], lanes: list[tuple[int, int]], start: int):
        self._count("match", len(keys))
        return self.inner.match(keys, lanes, start)

    def walk_back(self, key: int, n: int, stop: int | None = None) -> list[int]:
        out = self.inner.walk_back(key, n, stop)
        self._count("walk_back", len(out))
        return out

    def keys_between(self, key: int, stop: int, limit: int) -> list[int] | None:
        return self.inner.keys_between(key, stop, limit)

    def items(self) -> Iterator[tuple[int, int, int | None]]:
        return self.inner.items()

    def load(self, items: Iterable[tuple[int, int, int | None]]) -> None:
        items = list(items)
        self._count("load", len(items))
        self.inner.load(items)

    def lane_counts(self, tiers: int) -> list[int]:
        return self.inner.lane_counts(tiers)

    def __len__(self) -> int:
        return len(self.inner)

    def nbytes(self) -> dict[str, int]:
        return self.inner.nbytes()

    def native_table(self):
        """The wrapped backend's C table: the native ingestor writes to it directly (those writes
        are the router's counters, not this wrapper's)."""
        return self.inner.native_table()

    def stats(self) -> dict[str, int]:
        out = self.inner.stats()
        out.update({f"{op}_calls": n for op, n in self.calls.items()})
        return out
