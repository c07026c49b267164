"""The :class:`CachePolicy` role: which resident block to evict next.

A policy owns the map of resident keys to block ids (:attr:`CachePolicy.blocks`, read
directly by the manager on its hot path) and the order in which they would be evicted. It
knows nothing of ref counts beyond what :meth:`CachePolicy.evict` is handed: a block is
evictable iff ``ref_counts[block_id] == 0`` and its key is not in ``protected``.

Requests: the manager hands a policy the :class:`RequestRecord` of the request behind an
insert or a use. Its ``positions`` say where keys sit in the request (token positions,
growing from head to tail; a key missing: unknown), and its ``rank`` is a slot the policy may fill once per
request (0 until then): the LRU ranks every positioned block of one unfinished request
together, tails before heads.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container, Iterable, Mapping, Sequence
from typing import Any

__all__ = ["CachePolicy", "RequestRecord"]


class RequestRecord:
    """One request as its manager sees it, kept in the request's context by the manager.

    ``owner`` / ``generation``: the manager that made it and its cache generation (a record of
    another manager, or from before ``reset_cache``, is replaced); ``positions``: the context's
    ``key_positions`` (key -> token position; None or empty: unknown); ``keys``: the keys it
    stored or used, in the order of use (repeats included); ``rank``: the policy's per-request slot (0: unset)."""

    __slots__ = ("owner", "generation", "positions", "keys", "rank")

    def __init__(self, owner: Any, generation: int, positions: Mapping[bytes, int] | None) -> None:
        self.owner = owner
        self.generation = generation
        self.positions = positions
        self.keys: list[bytes] = []
        self.rank = 0


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
    def insert(self, key: bytes, block_id: int, request: RequestRecord | None = None) -> None:
        """Make ``key`` resident in ``block_id`` (``key`` is not resident); ``request``: the
        request storing it, if known."""

    def insert_many(self, keys: Sequence[bytes], block_ids: Sequence[int], request: RequestRecord | None = None) -> None:
        """Make each of ``keys`` (none resident, no repeats) resident in the block of the same
        index: what the manager calls. The default calls ``insert(key, block_id)`` for each, so
        a policy written against the two-argument ``insert`` keeps working; a policy that
        ranks by request overrides this (the LRU does)."""
        insert = self.insert
        for key, block_id in zip(keys, block_ids):
            insert(key, block_id)

    @abstractmethod
    def remove(self, key: bytes) -> int | None:
        """Forget ``key`` without recording it as evicted; its block id, or None."""

    @abstractmethod
    def touch(self, keys: Iterable[bytes], ref_counts: Sequence[int]) -> None:
        """Record a use of each resident key in ``keys`` (others are ignored). A key whose
        block is being written (``ref_counts[block] < 0``) has not been used yet."""

    def access(self, keys: Iterable[bytes], request: RequestRecord) -> None:  # noqa: B027 - default no-op
        """``request`` (not finished) loads, or offers again, ``keys`` (a key may come again;
        non-resident ones are ignored). Default: nothing (the use counts when the request
        finishes)."""

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
