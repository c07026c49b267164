"""Learned engine hashes: per model, engine block hash -> the router key of that block (an
int) when the engine block is exactly one canonical block, else ``(key, tail_tokens, n_keys)``
(the block's keys counted in its value). Bounded; the oldest learned go first."""

from __future__ import annotations

import sys
from itertools import islice

__all__ = ["LearnedMap"]


class LearnedMap:
    """Engine block hash -> router key, one map per model, bounded (oldest learned go first).

    A map is a dict, or where the C extension is built a ``LearnedTable`` (the same mapping
    with the int keys and values stored inline: fewer cache misses per lookup)."""

    __slots__ = ("maps", "odd", "size", "max_size", "evicted", "table")

    def __init__(self, max_size: int, *, table: type | None = None) -> None:
        self.maps: dict[str, dict[object, object]] = {}
        #: per model, ``[True]`` once its map holds a non-int value (lets the common path skip
        #: type checks); shared by reference with the model's endpoints
        self.odd: dict[str, list[bool]] = {}
        self.size = 0
        self.max_size = max_size
        self.evicted = 0
        self.table = table

    def for_model(self, model: str) -> dict[object, object]:
        m = self.maps.get(model)
        if m is None:
            m = self.maps[model] = {} if self.table is None else self.table()
            self.odd[model] = [False]
        return m

    def recount(self) -> None:
        self.size = sum(len(m) for m in self.maps.values())
        if self.size > self.max_size:
            self._evict()

    def _evict(self) -> None:
        low = self.max_size - max(1, self.max_size // 64)
        while self.size > low:
            biggest = max(self.maps.values(), key=len)
            n = min(len(biggest), self.size - low)
            oldest = biggest.oldest(n) if hasattr(biggest, "oldest") else list(islice(biggest, n))
            for h in oldest:
                del biggest[h]
            self.size -= n
            self.evicted += n

    def nbytes(self) -> int:
        """Bytes of every map (dicts: the dict and 28 bytes per key int)."""
        total = 0
        for m in list(self.maps.values()):
            nb = getattr(m, "nbytes", None)
            total += nb() if nb is not None else sys.getsizeof(m) + sum(map(sys.getsizeof, m))
        return total
