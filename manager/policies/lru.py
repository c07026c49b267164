"""Least-recently-used eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence

from .base import CachePolicy

__all__ = ["LRUCachePolicy"]


class LRUCachePolicy(CachePolicy):
    """Evicts the least recently inserted-or-touched evictable key."""

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        # Oldest first; the values are the block ids (``blocks`` is the same object).
        self._order: OrderedDict[bytes, int] = OrderedDict()
        self.blocks = self._order  # type: ignore[assignment]

    def insert(self, key: bytes, block_id: int) -> None:
        self._order[key] = block_id

    def remove(self, key: bytes) -> int | None:
        return self._order.pop(key, None)

    def touch(self, keys: Iterable[bytes], ref_counts: Sequence[int]) -> None:
        order = self._order
        move = order.move_to_end
        for key in keys:
            if key in order:
                move(key)

    def refresh(self, keys: Iterable[bytes]) -> None:
        order = self._order
        move = order.move_to_end
        for key in keys:
            if key in order:
                move(key)

    def evict(
        self, n: int, ref_counts: Sequence[int], protected: Container[bytes]
    ) -> list[tuple[bytes, int]] | None:
        if n <= 0:
            return []
        order = self._order
        picked: list[tuple[bytes, int]] = []
        for key, block in order.items():
            if ref_counts[block] == 0 and key not in protected:
                picked.append((key, block))
                if len(picked) == n:
                    break
        else:
            return None
        for key, _ in picked:
            del order[key]
        return picked
