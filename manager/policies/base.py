"""The :class:`CachePolicy` role: which resident block to evict next.

A policy owns the map of resident keys to block ids (:attr:`CachePolicy.blocks`, read
directly by the manager on its hot path) and the order in which they would be evicted. It
knows nothing of ref counts beyond what :meth:`CachePolicy.evict` is handed: a block is
evictable iff ``ref_counts[block_id] == 0`` and its key is not in ``protected``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container, Iterable, Sequence

__all__ = ["CachePolicy"]


class CachePolicy(ABC):
    """Resident keys, their block ids, and eviction order."""

    #: the registry name (set by subclasses).
    name: str = ""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"{type(self).__name__}: capacity must be > 0, got {capacity}")
        self.capacity = capacity
        #: key -> block id of every resident key (do not mutate from outside).
        self.blocks: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, key: object) -> bool:
        return key in self.blocks

    def get(self, key: bytes) -> int | None:
        """The block id of ``key`` without changing its recency."""
        return self.blocks.get(key)

    @abstractmethod
    def insert(self, key: bytes, block_id: int) -> None:
        """Make ``key`` resident in ``block_id`` (``key`` is not resident)."""

    @abstractmethod
    def remove(self, key: bytes) -> int | None:
        """Forget ``key`` without recording it as evicted; its block id, or None."""

    @abstractmethod
    def touch(self, keys: Iterable[bytes], ref_counts: Sequence[int]) -> None:
        """Record a use of each resident key in ``keys`` (others are ignored). A key whose
        block is being written (``ref_counts[block] < 0``) has not been used yet."""

    def refresh(self, keys: Iterable[bytes]) -> None:
        """Make each resident key in ``keys`` the most recent *without* counting a use (the
        last key ends most recent). Used when a request finishes to order its blocks so
        that a prefix's tail is evicted before its head. Default: no reordering."""

    @abstractmethod
    def evict(
        self, n: int, ref_counts: Sequence[int], protected: Container[bytes]
    ) -> list[tuple[bytes, int]] | None:
        """Remove ``n`` evictable keys and return ``(key, block_id)`` pairs, or return None and
        change nothing when fewer than ``n`` are evictable (all or nothing)."""

    def clear(self) -> None:
        """Forget every key (and any history)."""
        self.blocks.clear()
