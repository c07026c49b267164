"""Least-recently-used eviction, by rank.

Recency is a rank (lowest evicted first), an int read from one clock:

- a key inserted without a known position, touched, or refreshed when its request finishes
  gets a fresh rank, the newest (touch: the first key of a call ends the most recent,
  refresh: the last);
- a key a request inserts or uses while it runs, with a known token position, is ranked by
  its request: ``request.rank - position``, one request rank drawn at the request's
  first such use and shared by all its batches. Within a request the tail goes before the
  head, and a prefix still being written survives pressure from its own later batches;
  between requests, an older request's blocks go first, and a use by an older request never
  lowers a newer rank.

A rank only changes by a use, never by a transfer ending: a block pinned by a load or a store
keeps its place and is ordered by its rank once evictable again.

Fresh ranks never fall, so keys holding one sit in an ordered dict in rank order (appending
is ranking; keys of equal fresh rank are ordered by the dict). Request-ranked keys sit in a min-heap of ``(rank, key)``, lazily invalidated (an
entry whose rank is no longer the key's is skipped and dropped); eviction merges the two.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence
from heapq import heapify, heappop, heappush

from .base import CachePolicy, RequestRecord

__all__ = ["LRUCachePolicy", "SPAN"]

#: token positions per rank step: a position must lie in [0, SPAN)
SPAN = 1 << 40


class LRUCachePolicy(CachePolicy):
    """Evicts the evictable key of lowest rank (see the module docstring)."""

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._fresh: OrderedDict[bytes, int] = OrderedDict()  # key -> fresh rank, ascending
        self._placed: dict[bytes, int] = {}  # key -> request rank
        self._heap: list[tuple[int, bytes]] = []  # (rank, key) over _placed, lazily invalidated
        self._heap_limit = 64  # compact the heap past this many entries
        # The rank a fresh use gets now. Fresh ranks only need ordering against request ranks
        # (the ordered dict orders fresh keys among themselves), so the clock moves only when
        # a request rank is drawn: R = now + SPAN, then now = R + SPAN.
        self._now = 0

    # -- ranks ------------------------------------------------------------------------------

    def _request_base(self, request: RequestRecord) -> int:
        """The request's rank, drawn from the clock at its first positioned key."""
        base = request.rank
        if not base:
            base = request.rank = self._now + SPAN
            self._now = base + SPAN
        return base

    @staticmethod
    def _bad_position(key: bytes, position: object) -> ValueError:
        return ValueError(f"LRU: token position {position!r} of key {key.hex()[:24]}... is outside [0, 2**40)")

    def _placed_all(self) -> None:
        """After pushes: rebuild the heap from the live ranks once stale entries dominate."""
        if len(self._heap) > self._heap_limit:
            self._heap = [(r, k) for k, r in self._placed.items()]
            heapify(self._heap)
            self._heap_limit = 2 * len(self._heap) + 64

    def _renew(self, keys: Iterable[bytes]) -> None:
        """Fresh ranks for the resident ``keys``, in order (the last ends most recent)."""
        fresh, placed, now = self._fresh, self._placed, self._now
        move = fresh.move_to_end
        for key in keys:
            if key in fresh:
                fresh[key] = now
                move(key)
            elif key in placed:
                del placed[key]  # its heap entry is now stale
                fresh[key] = now

    # -- CachePolicy ------------------------------------------------------------------------

    def insert(self, key: bytes, block_id: int, request: RequestRecord | None = None) -> None:
        self.insert_many((key,), (block_id,), request)

    def insert_many(self, keys: Sequence[bytes], block_ids: Sequence[int], request: RequestRecord | None = None) -> None:
        self.blocks.update(zip(keys, block_ids))
        fresh, now = self._fresh, self._now
        positions = None if request is None else request.positions
        if not positions:
            for key in keys:
                fresh[key] = now
            return
        placed, heap, base = self._placed, self._heap, 0
        position_of = positions.get
        for key in keys:
            position = position_of(key)
            if position is None:
                fresh[key] = self._now  # (a request rank drawn just before moved the clock)
                continue
            if not 0 <= position < SPAN:
                raise self._bad_position(key, position)
            if not base:
                base = self._request_base(request)  # type: ignore[arg-type]
            rank = placed[key] = base - position
            heappush(heap, (rank, key))
        if base:
            self._placed_all()

    def remove(self, key: bytes) -> int | None:
        block = self.blocks.pop(key, None)
        if block is not None and self._fresh.pop(key, None) is None:
            del self._placed[key]
        return block

    def touch(self, keys: Iterable[bytes], ref_counts: Sequence[int]) -> None:
        self._renew(reversed(keys if isinstance(keys, (list, tuple)) else list(keys)))

    def refresh(self, keys: Iterable[bytes]) -> None:
        self._renew(keys)

    def access(self, keys: Iterable[bytes], request: RequestRecord) -> None:
        positions = request.positions
        if not positions:
            return
        position_of = positions.get
        blocks, fresh, placed, heap, base = self.blocks, self._fresh, self._placed, self._heap, 0
        for key in keys:
            position = position_of(key)
            if position is None or key not in blocks:
                continue
            if not 0 <= position < SPAN:
                raise self._bad_position(key, position)
            if not base:
                base = self._request_base(request)
            rank = base - position
            current = fresh.get(key)
            if current is None:
                if placed[key] >= rank:
                    continue  # a newer use already ranks it higher
            elif current >= rank:
                continue
            else:
                del fresh[key]
            placed[key] = rank
            heappush(heap, (rank, key))
        if base:
            self._placed_all()

    def evict(
        self, n: int, ref_counts: Sequence[int], protected: Container[bytes]
    ) -> list[tuple[bytes, int]] | None:
        if n <= 0:
            return []
        blocks, fresh, placed = self.blocks, self._fresh, self._placed
        held: list[tuple[int, bytes]] = []  # heap entries of keys not evictable now
        next_placed = self._next_placed
        # Merge the fresh keys (in rank order) with the request-ranked ones (from the heap).
        picked: list[tuple[bytes, int]] = []  # in eviction order
        picked_placed: list[tuple[int, bytes]] = []
        h = next_placed(ref_counts, protected, held) if placed else None
        want = n
        for key, rank in fresh.items():
            if h is not None and h[0] < rank:
                while h is not None and h[0] < rank:
                    picked.append((h[1], blocks[h[1]]))
                    picked_placed.append(h)
                    del placed[h[1]]  # (a duplicate entry of this key is now stale)
                    want -= 1
                    h = next_placed(ref_counts, protected, held) if want else None
                if not want:
                    break
            block = blocks[key]
            if ref_counts[block] == 0 and key not in protected:
                picked.append((key, block))
                want -= 1
                if not want:
                    break
        while want and h is not None:
            picked.append((h[1], blocks[h[1]]))
            picked_placed.append(h)
            del placed[h[1]]
            want -= 1
            h = next_placed(ref_counts, protected, held) if want else None
        if h is not None:
            held.append(h)
        if want:  # not enough: put everything back
            for entry in picked_placed:
                placed[entry[1]] = entry[0]
            held.extend(picked_placed)
        if held:
            heap = self._heap
            for entry in held:
                heappush(heap, entry)
        if want:
            return None
        if picked_placed:
            pop = fresh.pop
            for key, _ in picked:
                pop(key, None)
                del blocks[key]
        else:
            for key, _ in picked:
                del fresh[key]
                del blocks[key]
        return picked

    def _next_placed(
        self, ref_counts: Sequence[int], protected: Container[bytes], held: list[tuple[int, bytes]]
    ) -> tuple[int, bytes] | None:
        """Pop the heap to its lowest current, evictable entry (None: none left); entries of
        keys not evictable now go to ``held``, stale ones are dropped."""
        heap, placed, blocks = self._heap, self._placed, self.blocks
        while heap:
            entry = heappop(heap)
            key = entry[1]
            if placed.get(key) != entry[0]:
                continue
            if ref_counts[blocks[key]] != 0 or key in protected:
                held.append(entry)
                continue
            return entry
        return None

    def clear(self) -> None:
        super().clear()
        self._fresh.clear()
        self._placed.clear()
        self._heap.clear()
        self._heap_limit = 64
