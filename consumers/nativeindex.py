"""The ``"native"`` index backend: the dict index's logic over the C mask table."""

from __future__ import annotations

from . import _accel
from .keys import _FAST
from .index import BlockIndex
from .score import walk

__all__ = ["NativeBlockIndex"]


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

    def __init__(self, max_entries: int = 1 << 22, *, cap: int = 64, max_tiers: int = 4,
                 table: type | None = None) -> None:
        if table is None:
            fast = _FAST
            if fast is None:
                from kvevents.errors import ConfigError

                raise ConfigError(f"index backend 'native': the C extension is not in use ({_accel.status()})")
            table = fast.MaskTable
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

    def match(self, keys: list[int], lanes: list[tuple[int, int]], start: int):
        return walk(self.masks.get, keys, lanes, start)

    def clear_all(self) -> None:
        self.masks = self._new_masks(self.cap, self.max_tiers)

    def load(self, items) -> None:
        self.clear_all()
        self.masks.load(list(items))  # type: ignore[attr-defined]

    def native_table(self):
        return self.masks

    def lane_counts(self, tiers: int) -> list[int]:
        return self.masks.lane_counts(self.cap, tiers)  # type: ignore[attr-defined]

    def masks_nbytes(self) -> int:
        return self.masks.nbytes()  # type: ignore[attr-defined]

    def distinct_masks(self) -> int:
        return len(set(self.masks.values()))  # type: ignore[attr-defined]

    def items(self):
        masks = self.masks
        par = masks.parent  # type: ignore[attr-defined]
        for k, m in masks.items():
            yield k, m, par(k)
