"""The mask index: the :class:`~consumers.index.Index` role over one bit mask per key
(:class:`MaskIndex`), and its ``"python"`` backend (:class:`BlockIndex`, masks in a dict;
``consumers.nativeindex.NativeBlockIndex`` keeps them in a C table, a sibling).

The Python backend is compact by design (no object per entry):

* ``masks``: ``dict[key, int]``: one bitmask per request key; bit ``tier * cap + slot``
  says "endpoint ``slot`` holds this prefix in tier ``tier``". Tier-major layout keeps the
  GPU bits low. Mask values are *interned* (``intern``: one shared int object per distinct
  mask), so a key costs its dict slot and its 32-byte key int, not a 36-44-byte mask int of
  its own: keys of one document held by the same pods share one mask object.
  The dict's insertion order is the LRU order: storing a key moves it to the end.
* ``parents``: ``dict[key, parent_key]`` so an offloaded chunk (named by its last block)
  can be walked back to the blocks it spans.

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
from collections import Counter
from itertools import compress, islice
from typing import Any

from .index import Index, IndexImage
from .score import walk

__all__ = ["BlockIndex", "MaskIndex"]

_COMPACT_EVERY = 1 << 16


def _compact_bytes(n: int) -> int:
    """Bytes of a freshly built dict of ``n`` non-string keys (its minimal table)."""
    size = 8
    while size * 2 // 3 < n:
        size *= 2
    width = 1 if size <= 0x80 else 2 if size <= 0x8000 else 4 if size <= 0x80000000 else 8
    return size * width + size * 2 // 3 * 24 + 64


class MaskIndex(Index):
    """The :class:`~consumers.index.Index` verbs over one bit mask per key (not a backend:
    :class:`BlockIndex` keeps the masks in a dict, ``NativeBlockIndex`` in a C table).

    Bit ``tier * cap + endpoint`` says "``endpoint`` holds this key in ``tier``"; tier-major,
    so the GPU bits are low. ``cap`` (endpoints per tier) doubles when an endpoint past it is
    stored. A backend supplies ``store`` and ``remove`` (its hot verbs, written out) and the
    storage operations: ``clear_bits``, ``grow``, ``walk_back``, ``items``, ``load``,
    ``lane_counts``, ``nbytes`` and ``masks`` (a mapping key -> mask, read by :meth:`match`)."""

    __slots__ = ()
    cap: int
    max_tiers: int
    max_entries: int
    entries: int
    evicted_keys: int
    evicted_entries: int
    masks: Any

    # --- the role's verbs (store and remove are each backend's own, written out: the Python
    # ingest's per-event path); _place is their check for an endpoint past the layout
    def _place(self, endpoint: int, tier: int) -> None:
        if not 0 <= tier < self.max_tiers or endpoint < 0:
            raise ValueError(f"index: endpoint {endpoint} / tier {tier} out of range (max_tiers={self.max_tiers})")
        cap = self.cap
        while cap <= endpoint:
            cap *= 2
        self.grow(cap)

    def clear(self, endpoint: int) -> int:
        if not 0 <= endpoint < self.cap:
            return 0
        return self.clear_bits(self.slot_bits(endpoint))

    def match(self, keys: list[int], tiers, endpoints):
        cap = self.cap
        full = (1 << cap) - 1
        start = 0
        for e in endpoints:
            if 0 <= e < cap:
                start |= 1 << e
        return walk(self.masks.get, keys, [(t * cap, full) for t in tiers], start)

    def lineage(self, key: int, n: int, stop: int | None = None) -> list[int]:
        return self.walk_back(key, n, stop)

    def stats(self, detail: str | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"entries": self.entries, "keys": len(self.masks), "evicted_keys": self.evicted_keys,
                               "evicted_entries": self.evicted_entries}
        if detail == "tiers":
            out["by_tier"] = self.lane_counts(self.max_tiers)
        elif detail == "endpoints":
            out["by_endpoint"] = self._by_endpoint()
        elif detail == "bytes":
            nb = self.nbytes()
            out.update(bytes=nb["masks"] + nb["parents"], bytes_masks=nb["masks"], bytes_parents=nb["parents"],
                       distinct_masks=nb["distinct_masks"])
        elif detail is not None:
            raise ValueError(f"index stats: unknown detail {detail!r} (tiers, endpoints, bytes)")
        return out

    def _by_endpoint(self) -> dict[int, list[int]]:
        """Entries per endpoint and tier: each distinct mask counted at C speed, its bits once."""
        cap, T = self.cap, self.max_tiers
        out: dict[int, list[int]] = {}
        for m, n in Counter(self.masks.values()).items():
            while m:
                low = m & -m
                b = low.bit_length() - 1
                m ^= low
                row = out.get(b % cap)
                if row is None:
                    row = out[b % cap] = [0] * T
                row[b // cap] += n
        return out

    def snapshot(self) -> IndexImage:
        return IndexImage(self.cap, self.items(), self.evicted_keys, self.evicted_entries)

    def restore(self, image: IndexImage) -> None:
        width, records = image.width, image.records
        if width > self.cap:
            self._place(width - 1, 0)  # (doubling, as a store past the layout does)
        if width != self.cap:  # re-lay each mask for this index's width
            records = [(k, _relay(m, width, self.cap, self.max_tiers), p) for k, m, p in records]
        self.load(records)
        self.evicted_keys, self.evicted_entries = image.evicted_keys, image.evicted_entries

    # --- the bit layout
    def slot_bits(self, slot: int) -> int:
        """Every tier's bit of endpoint ``slot``."""
        b = 0
        for t in range(self.max_tiers):
            b |= 1 << (t * self.cap + slot)
        return b

    def lane(self, tier: int) -> tuple[int, int]:
        """``(shift, full)``: ``(mask >> shift) & full`` is tier ``tier``'s endpoint mask."""
        return tier * self.cap, (1 << self.cap) - 1


def _relay(m: int, old: int, new: int, tiers: int) -> int:
    """Mask ``m`` laid out for ``old`` endpoints per tier, re-laid for ``new``."""
    full = (1 << old) - 1
    out = 0
    for t in range(tiers):
        lane = (m >> (t * old)) & full
        if lane:
            out |= lane << (t * new)
    return out


class BlockIndex(MaskIndex):
    """The ``"python"`` backend: masks in a dict of interned ints, parents in a dict."""

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

    def store(self, endpoint: int, tier: int, keys: list[int], parent: int | None = None, *,
              chain: bool = True) -> None:
        """Set the (endpoint, tier) bit on ``keys``; with ``chain`` (distinct keys) link each key
        to its predecessor, the first to ``parent``."""
        if not (0 <= endpoint < self.cap and 0 <= tier < self.max_tiers):
            self._place(endpoint, tier)
        if chain:
            parents = self.parents
            if keys and parent is not None:
                parents[keys[0]] = parent
            parents.update(zip(keys[1:], keys))
        self._set(keys, 1 << (tier * self.cap + endpoint))

    def remove(self, endpoint: int, tier: int, keys: list[int]) -> int:
        """Clear the (endpoint, tier) bit on ``keys``; returns how many entries went away."""
        if not (0 <= endpoint < self.cap and 0 <= tier < self.max_tiers):
            return 0
        bit = 1 << (tier * self.cap + endpoint)
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

    def stats(self, detail: str | None = None) -> dict[str, Any]:
        out = super().stats(detail)
        out["compactions"] = self.compactions
        return out

    def mask(self, key: int) -> int | None:
        return self.masks.get(key)

    def items(self):
        parents = self.parents
        for k, m in list(self.masks.items()):
            yield k, m, parents.get(k)

    def load(self, items) -> None:
        self.clear_all()
        masks, intern, parents = self.masks, self.intern, self.parents
        n = 0
        for k, m, p in items:
            masks[k] = intern.setdefault(m, m)
            if p is not None:
                parents[k] = p
            n += m.bit_count()
        self.entries = n

    def clear_all(self) -> None:
        self.masks = self._new_masks(self.cap, self.max_tiers)
        self.parents = {}
        self.intern = {}
        self.entries = 0

    def nbytes(self) -> dict[str, int]:
        return {"masks": self.masks_nbytes(), "parents": self.parents_nbytes(), "distinct_masks": self.distinct_masks()}

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
