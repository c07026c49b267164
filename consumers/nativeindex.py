"""The ``"native"`` index backend: the mask index over the C mask table, and the one
capability the C ingest and score paths use (:meth:`NativeBlockIndex.accelerator`)."""

from __future__ import annotations

from . import _accel
from .keys import _FAST
from .maskindex import MaskIndex

__all__ = ["NativeBlockIndex", "TableAccess"]


class NativeBlockIndex(MaskIndex):
    """The index with its masks in C (``consumers._fastpath.MaskTable``), a sibling of the
    dict backend (:class:`consumers.maskindex.BlockIndex`), not a subclass.

    ``masks`` is a MaskTable: fixed-width bit words per key, LRU-linked, in an open-addressing
    table, read through the mapping interface (``get``, ``[]``, ``in``, ``len``, iteration
    oldest first, ``values``) with Python ints as values. No mask objects exist, so nothing is
    interned and nothing needs compacting. The parent links live in the table's entries too
    (``parents`` is a snapshot). The C ingest path writes to the table directly and the C score
    walk reads it: :meth:`accelerator`.
    """

    __slots__ = ("_table", "masks", "cap", "max_tiers", "max_entries", "low_water", "evicted_keys",
                 "evicted_entries", "_access")

    def __init__(self, max_entries: int = 1 << 22, *, cap: int = 64, max_tiers: int = 4,
                 table: type | None = None) -> None:
        if max_entries <= 0:
            raise ValueError(f"max_entries must be > 0, got {max_entries}")
        if table is None:
            fast = _FAST
            if fast is None:
                from kvevents.errors import ConfigError

                raise ConfigError(f"index backend 'native': the C extension is not in use ({_accel.status()})")
            table = fast.MaskTable
        self._table = table
        self.cap = cap
        self.max_tiers = max_tiers
        self.max_entries = max_entries
        self.low_water = max_entries - max(1, max_entries // 64)
        self.evicted_keys = 0
        self.evicted_entries = 0
        self.masks = table(bits=cap * max_tiers)
        self._access = TableAccess(self)

    def accelerator(self) -> "TableAccess":
        """What the C paths need of this backend (the router asks once, at construction)."""
        return self._access

    @property
    def entries(self) -> int:
        """Set bits over every key, counted by the table itself (the C ingest path updates it)."""
        return self.masks.entries

    @entries.setter
    def entries(self, value: int) -> None:
        self.masks.entries = value

    @property
    def parents(self) -> dict[int, int]:
        """A snapshot ``{key: parent}``: the links live in the table's entries."""
        return self.masks.parents()

    # --- storage operations (MaskIndex's)
    def grow(self, new_cap: int) -> None:
        old = self.cap
        if new_cap <= old:
            return
        self.masks.grow(old, new_cap, self.max_tiers)
        self.cap = self._access.cap = new_cap

    def store(self, endpoint: int, tier: int, keys: list[int], parent: int | None = None, *,
              chain: bool = True) -> None:
        if not (0 <= endpoint < self.cap and 0 <= tier < self.max_tiers):
            self._place(endpoint, tier)
        masks = self.masks
        bit = tier * self.cap + endpoint  # (the bit's number in the table)
        if chain:
            masks.set_chain(keys, bit, parent)
        else:
            masks.set_bit(keys, bit)
        if masks.entries > self.max_entries or len(masks) > self.max_entries:
            self.evict()

    def remove(self, endpoint: int, tier: int, keys: list[int]) -> int:
        if not (0 <= endpoint < self.cap and 0 <= tier < self.max_tiers):
            return 0
        return self.masks.clear_bit(keys, tier * self.cap + endpoint)

    def clear_bits(self, bits: int) -> int:
        return self.masks.clear_bits([i for i in range(bits.bit_length()) if bits >> i & 1])

    def evict(self) -> None:
        keys, dropped = self.masks.evict(self.low_water)
        self.evicted_entries += dropped
        self.evicted_keys += len(keys)

    def walk_back(self, key: int, n: int, stop: int | None = None) -> list[int]:
        return self.masks.walk_back(key, n, stop)

    def keys_between(self, key: int, stop: int, limit: int) -> list[int] | None:
        return self.masks.keys_between(key, stop, limit)

    def mask(self, key: int) -> int | None:
        return self.masks.get(key)

    def __len__(self) -> int:
        return len(self.masks)

    def items(self):
        masks = self.masks
        par = masks.parent
        for k, m in masks.items():
            yield k, m, par(k)

    def load(self, items) -> None:
        self.masks = self._access.table = self._table(bits=self.cap * self.max_tiers)
        self.masks.load(list(items))

    def lane_counts(self, tiers: int) -> list[int]:
        return self.masks.lane_counts(self.cap, tiers)

    def nbytes(self) -> dict[str, int]:
        return {"masks": self.masks.nbytes(), "parents": 0, "distinct_masks": len(set(self.masks.values()))}


class TableAccess:
    """The native backend's C table as the C ingest (``consumers/nativeingest.py``) and the C
    score walk (``consumers/scorer.py``) use it, and its slot layout as the endpoints table
    keeps it: those paths write and walk the table without the role (their work is what the
    router's own counters count). ``table`` and ``cap`` are plain attributes (read per score
    call) that the backend keeps current: a restore replaces the table, a grow the layout."""

    __slots__ = ("_index", "table", "cap")

    def __init__(self, index: NativeBlockIndex) -> None:
        self._index = index
        self.table = index.masks  #: the MaskTable
        self.cap = index.cap  #: endpoints per tier in its bit layout

    @property
    def max_entries(self) -> int:
        return self._index.max_entries

    @property
    def low_water(self) -> int:
        return self._index.low_water

    def grow(self, new_cap: int) -> None:
        self._index.grow(new_cap)

    def lane(self, tier: int) -> tuple[int, int]:
        return self._index.lane(tier)

    def evicted(self, keys: int, entries: int) -> None:
        """The C ingest evicted ``keys`` keys holding ``entries`` entries."""
        index = self._index
        index.evicted_keys += keys
        index.evicted_entries += entries
