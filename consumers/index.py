"""The router's block index: which (endpoint, tier) slots hold each prefix key.

Compact by design (no object per entry):

* ``masks``: ``dict[key, int]``: one bitmask per request key; bit ``tier * cap + slot``
  says "endpoint ``slot`` holds this prefix in tier ``tier``". Tier-major layout keeps the
  GPU bits low. Mask values are *interned* (``intern``: one shared int object per distinct
  mask), so a key costs its dict slot and its 32-byte key int, not a 36-44-byte mask int of
  its own: keys of one document held by the same pods share one mask object.
  The dict's insertion order is the LRU order: storing a key moves it to the end.
* ``parents``: ``dict[key, parent_key]`` so an offloaded chunk (named by its last block)
  can be walked back to the blocks it spans.
* ``LearnedMap``: per model, engine block hash -> the router key of that block (an int), or
  ``(key, tail_tokens, n_keys)`` when the engine block does not end on a canonical boundary.

Updates are plain loops: for an event's few keys, C-level ``map``/``dict.update`` passes
were measured slower (2.3 us vs 0.75 us for 4 keys). Moving keys to the end leaves deleted slots behind, and a
dict that resizes while holding them doubles its table; ``compact`` copies ``masks`` back to
its minimal size when it has grown past 1.5x of that, and ``reintern`` drops masks no key
holds any more once ``intern`` has doubled (both checked every 64k moved keys).

The entry budget counts (key, slot, tier) entries, i.e. set bits; keys whose mask fell to
zero are kept (their parent link is still useful) but count against the budget too.
Eviction removes least recently stored keys, in chunks, down to a low-water mark, so the
budget holds after every ``apply``.
"""

from __future__ import annotations

import sys
from itertools import compress, islice, repeat

__all__ = ["BlockIndex", "LearnedMap", "NativeBlockIndex", "make_index"]

_COMPACT_EVERY = 1 << 16


def _compact_bytes(n: int) -> int:
    """Bytes of a freshly built dict of ``n`` non-string keys (its minimal table)."""
    size = 8
    while size * 2 // 3 < n:
        size *= 2
    width = 1 if size <= 0x80 else 2 if size <= 0x8000 else 4 if size <= 0x80000000 else 8
    return size * width + size * 2 // 3 * 24 + 64


class BlockIndex:
    __slots__ = (
        "masks",
        "parents",
        "intern",
        "intern_limit",
        "cap",
        "max_tiers",
        "entries",
        "max_entries",
        "low_water",
        "evicted_keys",
        "evicted_entries",
        "moves",
        "compactions",
    )

    def __init__(self, max_entries: int = 1 << 22, *, cap: int = 64, max_tiers: int = 4) -> None:
        if max_entries <= 0:
            raise ValueError(f"max_entries must be > 0, got {max_entries}")
        self.masks: dict[int, int] = self._new_masks(cap, max_tiers)
        self.parents: dict[int, int] = {}
        self.intern: dict[int, int] = {}
        self.intern_limit = 1 << 16
        self.cap = cap
        self.max_tiers = max_tiers
        self.entries = 0
        self.max_entries = max_entries
        self.low_water = max_entries - max(1, max_entries // 64)
        self.evicted_keys = 0
        self.evicted_entries = 0
        self.moves = 0
        self.compactions = 0

    def _new_masks(self, cap: int, max_tiers: int):
        return {}

    # --- bits -----------------------------------------------------------------------------
    def bit(self, tier: int, slot: int) -> int:
        return 1 << (tier * self.cap + slot)

    def lane(self, tier: int) -> tuple[int, int]:
        """``(shift, full)``: ``(mask >> shift) & full`` is tier ``tier``'s slot mask."""
        return tier * self.cap, (1 << self.cap) - 1

    def slot_bits(self, slot: int) -> int:
        """Every tier's bit of ``slot``."""
        b = 0
        for t in range(self.max_tiers):
            b |= 1 << (t * self.cap + slot)
        return b

    def grow(self, new_cap: int) -> None:
        """Re-lay every mask for ``new_cap`` slots per tier (rare: O(keys))."""
        old, T = self.cap, self.max_tiers
        if new_cap <= old:
            return
        full = (1 << old) - 1
        masks = self.masks
        for k, m in masks.items():
            if m:
                n = 0
                for t in range(T):
                    lane = (m >> (t * old)) & full
                    if lane:
                        n |= lane << (t * new_cap)
                masks[k] = n
        self.cap = new_cap
        self.reintern()

    def reintern(self) -> None:
        """Rebuild ``intern`` from the masks in use (drops masks no key holds any more)."""
        masks = self.masks
        seen: dict[int, int] = {}
        setdefault = seen.setdefault
        keys, vals = list(masks), list(masks.values())
        masks.update(zip(keys, map(setdefault, vals, vals)))  # same keys: order unchanged
        self.intern = seen
        self.intern_limit = max(1 << 16, 2 * len(seen))

    def compact(self, force: bool = False) -> bool:
        """Copy ``masks`` to a minimal table if deleted slots have bloated it (or ``force``)."""
        self.moves = 0
        masks = self.masks
        if force or sys.getsizeof(masks) > 1.5 * _compact_bytes(len(masks)):
            self.masks = dict(masks)
            self.compactions += 1
            return True
        return False

    # --- updates --------------------------------------------------------------------------
    def _set(self, keys: list[int], bit: int) -> None:
        """Set ``bit`` on distinct ``keys``, moving them to the LRU end."""
        masks = self.masks
        pop = masks.pop
        setdefault = self.intern.setdefault
        new = 0
        for k in keys:
            m = pop(k, 0)
            if not m & bit:
                new += 1
                m |= bit
            masks[k] = setdefault(m, m)
        self._added(new, len(keys))

    def _added(self, new: int, moved: int) -> None:
        """Bookkeeping after a batch of keys was set: counts, compaction, the entry budget."""
        self.entries += new
        self.moves += moved
        if self.moves >= _COMPACT_EVERY:
            self.compact()
            if len(self.intern) > self.intern_limit:
                self.reintern()
        if self.entries > self.max_entries or len(self.masks) > self.max_entries:
            self.evict()

    def add_chain(self, keys: list[int], bit: int, parent: int | None) -> None:
        """Set ``bit`` on ``keys`` (a chain: distinct) and link each key to its predecessor."""
        parents = self.parents
        if keys and parent is not None:
            parents[keys[0]] = parent
        parents.update(zip(keys[1:], keys))
        self._set(keys, bit)

    def add(self, keys: list[int], bit: int) -> None:
        """Set ``bit`` on ``keys`` (no parent links: an offload join); duplicates are fine."""
        self._set(keys, bit)

    def remove(self, keys: list[int], bit: int) -> int:
        """Clear ``bit`` on ``keys``; returns how many entries went away."""
        masks = self.masks
        intern = self.intern
        gone = 0
        for k in keys:
            m = masks.get(k)
            if m is not None and m & bit:
                m &= ~bit
                masks[k] = intern.setdefault(m, m)
                gone += 1
        self.entries -= gone
        return gone

    def clear_bits(self, bits: int) -> int:
        """Clear ``bits`` on every key (a reset/clear/purge: O(keys), the scan at C level);
        returns entries cleared."""
        masks = self.masks
        hit = list(compress(masks, map(bits.__and__, masks.values())))
        keep = ~bits
        intern = self.intern
        gone = 0
        for k in hit:
            m = masks[k]
            gone += (m & bits).bit_count()
            m &= keep
            masks[k] = intern.setdefault(m, m)
        self.entries -= gone
        return gone

    def evict(self) -> None:
        """Drop least recently stored keys until under the low-water mark."""
        masks, parents = self.masks, self.parents
        target = self.low_water
        while self.entries > target or len(masks) > target:
            victims = list(islice(masks, 256))
            if not victims:
                break
            for k in victims:
                m = masks.pop(k)
                parents.pop(k, None)
                n = m.bit_count()
                self.entries -= n
                self.evicted_entries += n
                self.evicted_keys += 1
                if self.entries <= target and len(masks) <= target:
                    break

    # --- queries --------------------------------------------------------------------------
    def walk_back(self, key: int, n: int, stop: int | None = None) -> list[int]:
        """Up to ``n`` keys ending at ``key`` (``key`` last), or until ``stop`` is reached."""
        parents = self.parents
        out = [key]
        k = key
        while len(out) < n:
            k = parents.get(k)  # type: ignore[assignment]
            if k is None or k == stop:
                break
            out.append(k)
        out.reverse()
        return out

    def keys_between(self, key: int, stop: int, limit: int) -> list[int] | None:
        """The keys after ``stop`` up to and including ``key``; None if ``stop`` is not an
        ancestor within ``limit`` steps."""
        parents = self.parents
        out = [key]
        k = key
        for _ in range(limit):
            k = parents.get(k)  # type: ignore[assignment]
            if k is None:
                return None
            if k == stop:
                out.reverse()
                return out
            out.append(k)
        return None

    def __len__(self) -> int:
        return len(self.masks)

    # --- introspection ---------------------------------------------------------------------
    def lane_counts(self, tiers: int) -> list[int]:
        """Set bits (entries) per tier."""
        cap = self.cap
        full = (1 << cap) - 1
        counts = [0] * tiers
        for m in list(self.masks.values()):  # one C-level copy: consistent under the GIL
            if m:
                for t in range(tiers):
                    lane = (m >> (t * cap)) & full
                    if lane:
                        counts[t] += lane.bit_count()
        return counts

    def masks_nbytes(self) -> int:
        """Bytes of the mask dict, its key ints and the interned masks (each counted once)."""
        size = sys.getsizeof
        return size(self.masks) + sum(map(size, self.masks)) + size(self.intern) + sum(map(size, self.intern))

    def distinct_masks(self) -> int:
        return len(self.intern)

    def parents_nbytes(self) -> int:
        return sys.getsizeof(self.parents)


class NativeBlockIndex(BlockIndex):
    """The same index with its masks in C (``consumers._fastpath.MaskTable``).

    ``masks`` is a MaskTable: fixed-width bit words per key, LRU-linked, in an open-addressing
    table, read through the mapping interface (``get``, ``[]``, ``in``, ``len``, iteration
    oldest first, ``values``) with Python ints as values, so scoring and ``explain`` read it
    as they read the dict. No mask objects exist, so nothing is interned and nothing needs
    compacting. Used whenever the C extension is built; the C ingest path writes to it
    directly. The parent links live in the table's entries too (``parents`` is a snapshot).
    """

    __slots__ = ("_table",)

    def __init__(self, max_entries: int = 1 << 22, *, cap: int = 64, max_tiers: int = 4, table: type) -> None:
        self._table = table
        super().__init__(max_entries, cap=cap, max_tiers=max_tiers)

    def _new_masks(self, cap: int, max_tiers: int):
        return self._table(bits=cap * max_tiers)

    @property  # type: ignore[override]
    def entries(self) -> int:
        """Set bits over every key, counted by the table itself (the C ingest path updates it)."""
        return self.masks.entries  # type: ignore[attr-defined]

    @entries.setter
    def entries(self, value: int) -> None:
        self.masks.entries = value  # type: ignore[attr-defined]

    def grow(self, new_cap: int) -> None:
        old = self.cap
        if new_cap <= old:
            return
        self.masks.grow(old, new_cap, self.max_tiers)  # type: ignore[attr-defined]
        self.cap = new_cap

    def reintern(self) -> None:  # no mask objects to share
        return None

    def compact(self, force: bool = False) -> bool:  # no deleted slots to shed
        self.moves = 0
        return False

    def _added(self, new: int, moved: int) -> None:  # the table has counted the new entries
        if self.masks.entries > self.max_entries or len(self.masks) > self.max_entries:  # type: ignore[attr-defined]
            self.evict()

    def _set(self, keys: list[int], bit: int) -> None:
        self._added(self.masks.set_bit(keys, bit.bit_length() - 1), len(keys))  # type: ignore[attr-defined]

    def add_chain(self, keys: list[int], bit: int, parent: int | None) -> None:
        self._added(self.masks.set_chain(keys, bit.bit_length() - 1, parent), len(keys))  # type: ignore[attr-defined]

    @property  # type: ignore[override]
    def parents(self) -> dict[int, int]:
        """A snapshot ``{key: parent}``: the links live in the table's entries."""
        return self.masks.parents()  # type: ignore[attr-defined]

    @parents.setter
    def parents(self, value: object) -> None:  # (the base class's __init__ sets a dict: ignored)
        return None

    def walk_back(self, key: int, n: int, stop: int | None = None) -> list[int]:
        return self.masks.walk_back(key, n, stop)  # type: ignore[attr-defined]

    def keys_between(self, key: int, stop: int, limit: int) -> list[int] | None:
        return self.masks.keys_between(key, stop, limit)  # type: ignore[attr-defined]

    def parents_nbytes(self) -> int:
        return 0  # inside masks_nbytes()

    def remove(self, keys: list[int], bit: int) -> int:
        return self.masks.clear_bit(keys, bit.bit_length() - 1)  # type: ignore[attr-defined]

    def clear_bits(self, bits: int) -> int:
        return self.masks.clear_bits([i for i in range(bits.bit_length()) if bits >> i & 1])  # type: ignore[attr-defined]

    def evict(self) -> None:
        keys, dropped = self.masks.evict(self.low_water)  # type: ignore[attr-defined]
        self.evicted_entries += dropped
        self.evicted_keys += len(keys)

    def lane_counts(self, tiers: int) -> list[int]:
        return self.masks.lane_counts(self.cap, tiers)  # type: ignore[attr-defined]

    def masks_nbytes(self) -> int:
        return self.masks.nbytes()  # type: ignore[attr-defined]

    def distinct_masks(self) -> int:
        return len(set(self.masks.values()))  # type: ignore[attr-defined]


def make_index(max_entries: int, *, max_tiers: int, fast: object) -> BlockIndex:
    """The C-backed index where the extension is in use (``fast``), else the dict one."""
    table = getattr(fast, "MaskTable", None)
    if table is not None:
        return NativeBlockIndex(max_entries, max_tiers=max_tiers, table=table)
    return BlockIndex(max_entries, max_tiers=max_tiers)


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
