"""Adaptive replacement cache (Megiddo & Modha): recency list T1, frequency list T2, and ghost
lists B1/B2 of recently evicted keys that steer the target size ``p`` of T1."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Container, Iterable, Iterator, Sequence

from .base import CachePolicy, RequestRecord

__all__ = ["ARCCachePolicy"]


def _take(
    it: Iterator[tuple[bytes, int]],
    k: int,
    ref_counts: Sequence[int],
    protected: Container[bytes],
    out: list[tuple[bytes, int]],
) -> int:
    """Append up to ``k`` evictable entries from ``it`` to ``out``; how many are still wanted."""
    if k <= 0:
        return 0
    for key, block in it:
        if ref_counts[block] == 0 and key not in protected:
            out.append((key, block))
            k -= 1
            if not k:
                return 0
    return k


class ARCCachePolicy(CachePolicy):
    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.t1: OrderedDict[bytes, int] = OrderedDict()  # seen once recently
        self.t2: OrderedDict[bytes, int] = OrderedDict()  # seen at least twice
        self.b1: OrderedDict[bytes, None] = OrderedDict()  # ghosts evicted from t1
        self.b2: OrderedDict[bytes, None] = OrderedDict()  # ghosts evicted from t2
        self.p = 0.0  # target size of t1

    def insert(self, key: bytes, block_id: int, request: RequestRecord | None = None) -> None:
        b1, b2 = self.b1, self.b2
        if key in b1:
            self.p = min(float(self.capacity), self.p + max(1.0, len(b2) / len(b1)))
            del b1[key]
            self.t2[key] = block_id
        elif key in b2:
            self.p = max(0.0, self.p - max(1.0, len(b1) / len(b2)))
            del b2[key]
            self.t2[key] = block_id
        else:
            self.t1[key] = block_id
        self.blocks[key] = block_id

    def remove(self, key: bytes) -> int | None:
        block = self.blocks.pop(key, None)
        if block is not None:
            if self.t1.pop(key, None) is None:
                self.t2.pop(key, None)
        return block

    def touch(self, keys: Iterable[bytes], ref_counts: Sequence[int]) -> None:
        t1, t2 = self.t1, self.t2
        for key in keys:
            block = t1.get(key)
            if block is not None:
                if ref_counts[block] >= 0:  # a block still being written was not reused
                    del t1[key]
                    t2[key] = block
                else:
                    t1.move_to_end(key)
            elif key in t2:
                t2.move_to_end(key)

    def refresh(self, keys: Iterable[bytes]) -> None:
        t1, t2 = self.t1, self.t2
        for key in keys:
            if key in t1:
                t1.move_to_end(key)
            elif key in t2:
                t2.move_to_end(key)

    def evict(
        self, n: int, ref_counts: Sequence[int], protected: Container[bytes]
    ) -> list[tuple[bytes, int]] | None:
        if n <= 0:
            return []
        t1, t2 = self.t1, self.t2
        it1 = iter(t1.items())
        it2 = iter(t2.items())
        from1: list[tuple[bytes, int]] = []
        from2: list[tuple[bytes, int]] = []
        # REPLACE: take from T1 while it is over its target size p (or T2 is empty), then from
        # T2; when the preferred list has nothing evictable left, fall back to the other.
        k1 = n if not t2 else min(n, max(0, math.ceil(len(t1) - self.p)))
        rem = _take(it1, k1, ref_counts, protected, from1) + (n - k1)
        if rem:
            rem = _take(it2, rem, ref_counts, protected, from2)
            if rem:
                rem = _take(it1, rem, ref_counts, protected, from1)
                if rem:
                    return None
        blocks, b1, b2 = self.blocks, self.b1, self.b2
        for key, _ in from1:
            del t1[key]
            del blocks[key]
            b1[key] = None
        for key, _ in from2:
            del t2[key]
            del blocks[key]
            b2[key] = None
        cap = self.capacity
        while b1 and len(t1) + len(b1) > cap:
            b1.popitem(last=False)
        while b2 and len(blocks) + len(b1) + len(b2) > 2 * cap:
            b2.popitem(last=False)
        if from2:
            from1.extend(from2)
        return from1

    def clear(self) -> None:
        super().clear()
        self.t1.clear()
        self.t2.clear()
        self.b1.clear()
        self.b2.clear()
        self.p = 0.0
