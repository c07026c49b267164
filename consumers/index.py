"""The router's index role, in routing terms: which endpoints hold which prefix keys, in
which tier.

:class:`Index` is what the ingestor, the scorer, snapshots and telemetry use: eight verbs —
:meth:`~Index.store` a chain of keys for an endpoint and tier, :meth:`~Index.remove` keys,
:meth:`~Index.clear` an endpoint, :meth:`~Index.match` a prompt's keys to each endpoint's
per-tier prefix, follow a key's :meth:`~Index.lineage`, :meth:`~Index.stats`, and
:meth:`~Index.snapshot` / :meth:`~Index.restore`. An *endpoint* is the small int the router's
endpoints table gives each (pod, rank) engine; a *tier* is the small int of a medium (0 = GPU).
How a backend stores that is its own business.

Backends register in :data:`INDEX_BACKENDS` and are chosen by ``RouterConfig.index``:

* ``"native"`` (:class:`consumers.nativeindex.NativeBlockIndex`): bit masks in a C table;
* ``"python"`` (:class:`consumers.maskindex.BlockIndex`): the same masks in a dict;
* ``"reference"`` (:class:`consumers.refindex.ChainIndex`): plain dicts of holders, no bits.

None subclasses another; every one passes ``tests/test_index_contract.py``. Telemetry
decorators (``consumers/instrumented.py``) hold the next index and forward the verbs.

The C ingest and score paths (``consumers/_fastpath.c``) do not go through the role: they write
and walk the native backend's table directly. That is a capability of that backend only
(``NativeBlockIndex.accelerator()``), looked up once per router by :func:`accelerator`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from kvevents.registry import LazyRegistry

__all__ = ["INDEX_BACKENDS", "Index", "IndexImage", "SlotLayout", "accelerator", "innermost", "make_index"]


class IndexImage(NamedTuple):
    """What :meth:`Index.snapshot` gives and :meth:`Index.restore` takes.

    ``records`` are ``(key, holders, parent)``, least recently stored first; ``holders`` has
    bit ``tier * width + endpoint`` set for each (endpoint, tier) holding the key (a compact
    exchange form: the mask backends hand their masks over as they are)."""

    width: int  #: endpoints per tier in ``holders``
    records: Iterable[tuple[int, int, int | None]]  #: may be an iterator: read it once
    evicted_keys: int = 0
    evicted_entries: int = 0


class Index(ABC):
    """The index role (see the module's docstring). Counts are *entries*: (key, endpoint, tier)."""

    __slots__ = ()

    @classmethod
    def create(cls, max_entries: int, *, max_tiers: int) -> "Index":
        return cls(max_entries, max_tiers=max_tiers)  # type: ignore[call-arg]

    # --- updates
    @abstractmethod
    def store(self, endpoint: int, tier: int, keys: list[int], parent: int | None = None, *,
              chain: bool = True) -> None:
        """``endpoint`` holds ``keys`` in ``tier`` (each now the most recently stored). With
        ``chain`` the keys are a prefix chain: each follows the one before it and the first
        follows ``parent`` (None: a root, or unknown). ``chain=False``: only who holds what
        changes (the keys' links were learned before; duplicates are fine)."""

    @abstractmethod
    def remove(self, endpoint: int, tier: int, keys: list[int]) -> int:
        """``endpoint`` no longer holds ``keys`` in ``tier``; the entries that went away."""

    @abstractmethod
    def clear(self, endpoint: int) -> int:
        """``endpoint`` holds nothing any more, in any tier; the entries that went away."""

    # --- queries
    @abstractmethod
    def match(self, keys: list[int], tiers: Sequence[int], endpoints: Iterable[int]):
        """How much of the chain ``keys`` each of ``endpoints`` holds, tier by tier.

        ``tiers`` are the stages, heaviest first: each endpoint starts in the first stage that
        holds the first key and moves down to a lighter one where its stage stops holding the
        chain (never back up); its match ends at the first key no remaining stage holds.
        Returns ``(segments, ends)``: endpoint -> ``[(stage, first key index), ...]`` and
        endpoint -> keys matched; endpoints matching nothing are absent."""

    @abstractmethod
    def lineage(self, key: int, n: int, stop: int | None = None) -> list[int]:
        """Up to ``n`` keys of the chain ending at ``key`` (``key`` last), following the links
        :meth:`store` recorded, ending before ``stop`` or where no link is known."""

    @abstractmethod
    def stats(self, detail: str | None = None) -> dict[str, Any]:
        """``entries``, ``keys``, ``evicted_keys``, ``evicted_entries`` (cheap); ``detail`` adds
        one census, each a pass over the index: ``"tiers"`` adds ``by_tier`` (entries per tier,
        a list), ``"endpoints"`` ``by_endpoint`` (endpoint -> entries per tier, a list),
        ``"bytes"`` ``bytes`` (approximate bytes held; a backend may add its own ``bytes_*``)."""

    @abstractmethod
    def snapshot(self) -> IndexImage:
        """Everything held, least recently stored first (what a router snapshot saves)."""

    @abstractmethod
    def restore(self, image: IndexImage) -> None:
        """Replace the content with ``image`` (a :meth:`snapshot`, maybe another backend's)."""

    # --- derived from the verbs
    def __len__(self) -> int:
        """Keys held (a key nobody holds any more may still count while its link is kept)."""
        return self.stats()["keys"]

    def keys_between(self, key: int, stop: int, limit: int) -> list[int] | None:
        """The keys after ancestor ``stop`` up to and including ``key``; None if ``stop`` is not
        within ``limit`` links of ``key``."""
        path = self.lineage(key, limit + 1, stop)
        if len(path) > limit:
            return None
        above = self.lineage(path[0], 2)
        return path if len(above) == 2 and above[0] == stop else None


class SlotLayout:
    """The endpoints table's slot numbering where no C table lays out bits (every backend but
    the native one): ``cap`` only grows, ``lane`` is what the endpoints' scoring plan records
    (read by the C score walk alone, which runs only over the native backend)."""

    __slots__ = ("cap", "max_tiers")

    def __init__(self, cap: int = 64, max_tiers: int = 4) -> None:
        self.cap = cap
        self.max_tiers = max_tiers

    def grow(self, new_cap: int) -> None:
        self.cap = max(self.cap, new_cap)

    def lane(self, tier: int) -> tuple[int, int]:
        return tier * self.cap, (1 << self.cap) - 1


def innermost(index: Index) -> Index:
    """The backend behind any telemetry decorators."""
    while hasattr(index, "next"):
        index = index.next  # type: ignore[attr-defined]
    return index


def accelerator(index: Index):
    """The C table access of the backend behind ``index`` (``NativeBlockIndex.accelerator()``),
    or None: the one place the router asks for it, at construction."""
    get = getattr(innermost(index), "accelerator", None)
    return None if get is None else get()


#: index backends by name (``RouterConfig.index``); plug a new one in with ``INDEX_BACKENDS.register``
INDEX_BACKENDS = LazyRegistry("index backend", {
    "python": ("consumers.maskindex", "BlockIndex"),
    "native": ("consumers.nativeindex", "NativeBlockIndex"),
    "reference": ("consumers.refindex", "ChainIndex"),
}, base=Index, hint=" (or 'auto': native where the C extension is in use, else python)")


def make_index(name: str, max_entries: int, *, max_tiers: int, native: bool) -> Index:
    """The backend ``name`` (``"auto"``: ``"native"`` if ``native``, else ``"python"``)."""
    if name == "auto":
        name = "native" if native else "python"
    return INDEX_BACKENDS.get(name).create(max_entries, max_tiers=max_tiers)

