"""Store admission by repeat offers: a block is stored only once it has been offered often enough.

A one-off prefix (a prompt seen once) costs a host block and a GPU->CPU copy and is usually
evicted before anyone reads it. :class:`RepeatOfferAdmission` counts, per key, how many
``prepare_store`` calls offered it; a key not yet in the tier is admitted once its count reaches
``threshold``. The counts live in a bounded table (``capacity`` keys) that forgets its least
recently offered key first, so memory stays fixed however many distinct blocks pass.

Rules (what :class:`~manager.cpu.CPUOffloadingManager` relies on):

- only offers count: lookups, loads and touches do not;
- every key of an offer counts once, resident or not (a resident key's count keeps it in the
  table, it never changes whether the key stays cached);
- the keys of the current offer are never forgotten to make room for each other: when an offer
  has more new keys than the table has forgettable entries, the surplus new keys are not counted
  this time. A later offer of the remaining keys then finds a table with room, so an offer larger
  than the table still gets stored over successive offers instead of evicting its own counts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from types import MappingProxyType

from kvevents.errors import ConfigError

__all__ = ["RepeatOfferAdmission", "check_admission_settings"]


def check_admission_settings(threshold: object, capacity: object, where: str = "") -> None:
    """ConfigError in one line naming the bad setting (``threshold`` >= 0, ``capacity`` >= 1)."""
    for name, value, low in (("store_threshold", threshold, 0), ("max_tracker_size", capacity, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"{where}{name} must be an int >= {low}, got {value!r}")


class RepeatOfferAdmission:
    """Admit a key for store once ``threshold`` offers of it have been counted (``capacity``:
    how many keys the count table holds)."""

    __slots__ = ("threshold", "capacity", "_counts", "_view")

    def __init__(self, threshold: int, capacity: int) -> None:
        check_admission_settings(threshold, capacity, "RepeatOfferAdmission: ")
        if threshold < 2:
            raise ConfigError(f"RepeatOfferAdmission: store_threshold must be >= 2 to filter, got {threshold}")
        self.threshold = threshold
        self.capacity = capacity
        self._counts: OrderedDict[bytes, int] = OrderedDict()  # least recently offered first
        self._view = MappingProxyType(self._counts)

    @property
    def counts(self) -> Mapping[bytes, int]:
        """A read-only live view of the count table (key -> offers counted)."""
        return self._view

    def __len__(self) -> int:
        return len(self._counts)

    def offer(self, keys: Sequence[bytes], candidates: list[bytes]) -> list[bytes]:
        """Count one offer of ``keys``; of ``candidates`` (the offered keys not in the tier),
        those admitted for store, in their order."""
        counts = self._counts
        if len(keys) != len(set(keys)):
            keys = list(dict.fromkeys(keys))
        new = []
        for key in keys:
            n = counts.get(key)
            if n is None:
                new.append(key)
            else:
                counts[key] = n + 1
                counts.move_to_end(key)
        if new:
            # entries not offered now are the ones that may be forgotten
            forgettable = len(counts) - (len(keys) - len(new))
            room = self.capacity - len(counts)
            popitem = counts.popitem
            for key in new:
                if room <= 0:
                    if forgettable <= 0:
                        break
                    popitem(last=False)
                    forgettable -= 1
                else:
                    room -= 1
                counts[key] = 1
        threshold = self.threshold
        return [k for k in candidates if counts.get(k, 0) >= threshold]

    def clear(self) -> None:
        self._counts.clear()
