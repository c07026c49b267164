"""The router's block index: which (endpoint, tier) slots hold each prefix key.

:class:`Index` is the role (what the ingestor, the scorer, snapshots and telemetry use);
backends register in :data:`INDEX_BACKENDS` and are chosen by ``RouterConfig.index``:
``"python"`` (:class:`BlockIndex`, below) and ``"native"``
(:class:`consumers.nativeindex.NativeBlockIndex`, the same logic over a C table).

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
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from itertools import compress, islice

from kvevents.registry import LazyRegistry

from .score import walk

__all__ = ["INDEX_BACKENDS", "BlockIndex", "Index", "make_index"]

_COMPACT_EVERY = 1 << 16


def _compact_bytes(n: int) -> int:
    """Bytes of a freshly built dict of ``n`` non-string keys (its minimal table)."""
    size = 8
    while size * 2 // 3 < n:
        size *= 2
    width = 1 if size <= 0x80 else 2 if size <= 0x8000 else 4 if size <= 0x80000000 else 8
    return size * width + size * 2 // 3 * 24 + 64


class Index(ABC):
    """The index role: which (endpoint slot, tier) lanes hold each router key.

    A key's *mask* has bit ``tier * cap + slot`` set when endpoint ``slot`` holds that prefix in
    tier ``tier``. Backends are chosen by ``RouterConfig.index`` through :data:`INDEX_BACKENDS`;
    a wrapper of the same role (telemetry) may stand in front of one. Every backend passes
    ``tests/test_index_contract.py``.
    """

    __slots__ = ()
    cap: int  #: slots per tier lane
    max_tiers: int
    max_entries: int
    evicted_keys: int
    evicted_entries: int

    @classmethod
    def create(cls, max_entries: int, *, max_tiers: int) -> "Index":
        return cls(max_entries, max_tiers=max_tiers)  # type: ignore[call-arg]

    # --- updates
    @abstractmethod
    def add_chain(self, keys: list[int], bit: int, parent: int | None) -> None:
        """Set ``bit`` on ``keys`` (a chain) and link each key to its predecessor (the first to ``parent``)."""

    @abstractmethod
    def add(self, keys: list[int], bit: int) -> None:
        """Set ``bit`` on ``keys`` (no links)."""

    @abstractmethod
    def remove(self, keys: list[int], bit: int) -> int:
        """Clear ``bit`` on ``keys``; entries that went away."""

    @abstractmethod
    def clear_bits(self, bits: int) -> int:
        """Clear ``bits`` on every key; entries cleared."""

    def clear_slot(self, slot: int) -> int:
        """Clear every tier's bit of endpoint ``slot`` (a reset, a clear, a purge)."""
        return self.clear_bits(self.slot_bits(slot))

    @abstractmethod
    def grow(self, new_cap: int) -> None:
        """Re-lay the masks for ``new_cap`` slots per tier."""

    @abstractmethod
    def evict(self) -> None:
        """Drop least recently stored keys down to the low-water mark."""

    # --- queries
    @abstractmethod
    def mask(self, key: int) -> int | None:
        """The key's mask, None if the key is not indexed."""

    @abstractmethod
    def match(self, keys: list[int], lanes: list[tuple[int, int]], start: int):
        """The staged walk of :func:`consumers.score.walk` over this index."""

    @abstractmethod
    def walk_back(self, key: int, n: int, stop: int | None = None) -> list[int]:
        """Up to ``n`` keys ending at ``key`` along the parent links, oldest first."""

    @abstractmethod
    def keys_between(self, key: int, stop: int, limit: int) -> list[int] | None:
        """The keys after ancestor ``stop`` up to ``key``; None if not within ``limit``."""

    @abstractmethod
    def items(self) -> Iterator[tuple[int, int, int | None]]:
        """``(key, mask, parent)`` oldest first (the LRU order): what a snapshot holds."""

    @abstractmethod
    def load(self, items: Iterable[tuple[int, int, int | None]]) -> None:
        """Replace the content with ``items`` (``(key, mask, parent)``, oldest first)."""

    def native_table(self):
        """The C table (``consumers._fastpath.MaskTable``) a native ingestor may write the common
        events to directly and the scorer may walk in C, or None (both then go through this role
        in Python)."""
        return None

    def matched_natively(self, n_keys: int) -> None:
        """Told after the scorer walked ``n_keys`` keys of :meth:`native_table` in C (a match
        that did not pass through :meth:`match`); a wrapper counts it, a backend ignores it."""

    @abstractmethod
    def lane_counts(self, tiers: int) -> list[int]:
        """Set bits per tier."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def nbytes(self) -> dict[str, int]:
        """Approximate bytes held: ``{"masks": .., "parents": .., "distinct_masks": n}``."""

    # --- bits
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

    def stats(self) -> dict[str, int]:
        return {"entries": self.entries, "keys": len(self), "evicted_keys": self.evicted_keys,  # type: ignore[attr-defined]
                "evicted_entries": self.evicted_entries}


class BlockIndex(Index):
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

    def mask(self, key: int) -> int | None:
        return self.masks.get(key)

    def match(self, keys: list[int], lanes: list[tuple[int, int]], start: int):
        return walk(self.masks.get, keys, lanes, start)

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




#: index backends by name (``RouterConfig.index``); plug a new one in with ``INDEX_BACKENDS.register``
INDEX_BACKENDS = LazyRegistry("index backend", {
    "python": ("consumers.index", "BlockIndex"),
    "native": ("consumers.nativeindex", "NativeBlockIndex"),
}, base=Index, hint=" (or 'auto': native where the C extension is in use, else python)")


def make_index(name: str, max_entries: int, *, max_tiers: int, native: bool) -> Index:
    """The backend ``name`` (``"auto"``: ``"native"`` if ``native``, else ``"python"``)."""
    if name == "auto":
        name = "native" if native else "python"
    return INDEX_BACKENDS.get(name).create(max_entries, max_tiers=max_tiers)
