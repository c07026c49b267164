"""The ``"reference"`` index backend: the :class:`~consumers.index.Index` role over plain
dicts, no bit masks, no slot layout — each key's holders as a set of (endpoint, tier) pairs.

It exists to keep the role honest (a backend that shares nothing with the mask backends passes
the same contract, so a remote or shared-store backend is a matter of writing the eight verbs)
and as the plain statement of what the role means. It is slower than the mask backends and is
not chosen by ``"auto"``; ``RouterConfig(index="reference")`` picks it.

* ``held``: key -> set of (endpoint, tier); the dict's insertion order is the LRU order
  (storing a key moves it to the end). A key nobody holds any more is kept (its link is still
  useful) and counts against the budget, as in the mask backends.
* ``parents``: key -> the key before it in its chain.

The budget counts entries ((key, endpoint, tier) pairs) and keys; past either, the least
recently stored keys go, down to a low-water mark 1/64 below the budget.
"""

from __future__ import annotations

import sys
from typing import Any

from .index import Index, IndexImage

__all__ = ["ChainIndex"]

_EMPTY: frozenset = frozenset()


class ChainIndex(Index):
    """Holders per key in a dict of sets, links in a dict."""

    __slots__ = ("held", "parents", "max_tiers", "max_entries", "low_water", "entries", "evicted_keys",
                 "evicted_entries")

    def __init__(self, max_entries: int = 1 << 22, *, max_tiers: int = 4) -> None:
        if max_entries <= 0:
            raise ValueError(f"max_entries must be > 0, got {max_entries}")
        self.held: dict[int, set[tuple[int, int]]] = {}
        self.parents: dict[int, int] = {}
        self.max_tiers = max_tiers
        self.max_entries = max_entries
        self.low_water = max_entries - max(1, max_entries // 64)
        self.entries = 0
        self.evicted_keys = 0
        self.evicted_entries = 0

    # --- updates
    def store(self, endpoint: int, tier: int, keys: list[int], parent: int | None = None, *,
              chain: bool = True) -> None:
        if not 0 <= tier < self.max_tiers or endpoint < 0:
            raise ValueError(f"index: endpoint {endpoint} / tier {tier} out of range (max_tiers={self.max_tiers})")
        if chain:
            prev = parent
            for k in keys:
                if prev is not None:
                    self.parents[k] = prev
                prev = k
        held, pair = self.held, (endpoint, tier)
        for k in keys:
            s = held.pop(k, None)
            if s is None:
                s = set()
            if pair not in s:
                s.add(pair)
                self.entries += 1
            held[k] = s
        if self.entries > self.max_entries or len(held) > self.max_entries:
            self._evict()

    def remove(self, endpoint: int, tier: int, keys: list[int]) -> int:
        held, pair = self.held, (endpoint, tier)
        gone = 0
        for k in keys:
            s = held.get(k)
            if s is not None and pair in s:
                s.discard(pair)
                gone += 1
        self.entries -= gone
        return gone

    def clear(self, endpoint: int) -> int:
        gone = 0
        for s in self.held.values():
            mine = [p for p in s if p[0] == endpoint]
            s.difference_update(mine)
            gone += len(mine)
        self.entries -= gone
        return gone

    def _evict(self) -> None:
        held, parents, target = self.held, self.parents, self.low_water
        while held and (self.entries > target or len(held) > target):
            k = next(iter(held))
            n = len(held.pop(k))
            parents.pop(k, None)
            self.entries -= n
            self.evicted_entries += n
            self.evicted_keys += 1

    # --- queries
    def match(self, keys: list[int], tiers, endpoints):
        segments: dict[int, list[tuple[int, int]]] = {}
        ends: dict[int, int] = {}
        held = self.held
        T = len(tiers)
        for e in endpoints:
            stage, seg = 0, []
            for j, k in enumerate(keys):
                h = held.get(k, _EMPTY)
                while stage < T and (e, tiers[stage]) not in h:
                    stage += 1  # this stage stops holding the chain: a lighter one may go on
                if stage == T:
                    if seg:
                        ends[e] = j
                    break
                if not seg or seg[-1][0] != stage:
                    seg.append((stage, j))
            else:
                if seg:
                    ends[e] = len(keys)
            if seg:
                segments[e] = seg
        return segments, ends

    def lineage(self, key: int, n: int, stop: int | None = None) -> list[int]:
        parents = self.parents
        out = [key]
        k: int | None = key
        while len(out) < n:
            k = parents.get(k)  # type: ignore[arg-type]
            if k is None or k == stop:
                break
            out.append(k)
        out.reverse()
        return out

    def stats(self, detail: str | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"entries": self.entries, "keys": len(self.held), "evicted_keys": self.evicted_keys,
                               "evicted_entries": self.evicted_entries}
        if detail in ("tiers", "endpoints"):
            T = self.max_tiers
            by_tier = [0] * T
            by_ep: dict[int, list[int]] = {}
            for s in self.held.values():
                for e, t in s:
                    by_tier[t] += 1
                    row = by_ep.get(e)
                    if row is None:
                        row = by_ep[e] = [0] * T
                    row[t] += 1
            out["by_tier" if detail == "tiers" else "by_endpoint"] = by_tier if detail == "tiers" else by_ep
        elif detail == "bytes":
            size = sys.getsizeof
            out["bytes"] = (size(self.held) + sum(map(size, self.held.values())) + 72 * self.entries
                            + size(self.parents))
        elif detail is not None:
            raise ValueError(f"index stats: unknown detail {detail!r} (tiers, endpoints, bytes)")
        return out

    def snapshot(self) -> IndexImage:
        width = 1 + max((e for s in self.held.values() for e, _ in s), default=0)
        parents = self.parents
        records = [(k, sum(1 << (t * width + e) for e, t in s), parents.get(k)) for k, s in self.held.items()]
        return IndexImage(width, records, self.evicted_keys, self.evicted_entries)

    def restore(self, image: IndexImage) -> None:
        width = image.width
        held: dict[int, set[tuple[int, int]]] = {}
        parents: dict[int, int] = {}
        n = 0
        for k, m, p in image.records:
            s = set()
            while m:
                low = m & -m
                b = low.bit_length() - 1
                m ^= low
                s.add((b % width, b // width))
            held[k] = s
            n += len(s)
            if p is not None:
                parents[k] = p
        self.held, self.parents, self.entries = held, parents, n
        self.evicted_keys, self.evicted_entries = image.evicted_keys, image.evicted_entries
