"""The offload data model and the :class:`OffloadingManager` role.

Keys
    An :data:`OffloadKey` is ``bytes``: the block hash followed by the KV-cache group index
    as 4 big-endian bytes (:func:`make_offload_key` / :func:`split_offload_key`). One key
    names one offloaded block of one KV-cache group.

Lifecycle
    A manager is driven by the scheduler. Per request: :meth:`~OffloadingManager.on_new_request`
    (the manager says which :class:`OffloadPolicy` it wants), then any number of
    ``lookup`` / ``prepare_load`` / ``complete_load`` / ``prepare_store`` / ``complete_store``
    calls, then :meth:`~OffloadingManager.on_request_finished`. Once per scheduler step,
    :meth:`~OffloadingManager.on_schedule_end` runs: it is the one home of step-lifecycle work
    (processing finished jobs, submitting queued work). :meth:`~OffloadingManager.take_events`
    is a pure drain: it hands over the events accumulated so far and changes no job or cache
    state, so draining more or less often changes nothing.

Events
    :class:`OffloadingEvent` carries keys, a medium and whether they were removed. It carries
    no block size: the engine's GPU events report block sizes and consumers join the two by
    hash, so one event may mix blocks of different sizes.

Block bytes
    :class:`BlockIO` is how tiers reach the bytes of primary (host) blocks: ``read_block``
    returns a read-only view of one block, ``write_block`` fills one. :class:`NumpyBlockIO`
    wraps any C-contiguous numpy array shaped ``[num_blocks, ...]`` (e.g. a host KV buffer;
    a torch CPU tensor becomes one with ``t.view(torch.uint8).numpy()`` without a copy).
"""

from __future__ import annotations

import enum
import struct
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvevents.errors import KVEventsError

__all__ = [
    "BlockIO",
    "LoadStoreSpec",
    "LookupResult",
    "NumpyBlockIO",
    "OffloadKey",
    "OffloadPolicy",
    "OffloadingEvent",
    "OffloadingManager",
    "PrepareStoreOutput",
    "ReqContext",
    "RequestLifecycleError",
    "RequestOffloadingContext",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "make_offload_key",
    "split_offload_key",
]

#: block-hash bytes + 4 big-endian bytes of group index.
OffloadKey = bytes

_GROUP = struct.Struct(">I")
_GROUP_SUFFIX = [_GROUP.pack(i) for i in range(16)]


def make_offload_key(block_hash: bytes, group_idx: int = 0) -> OffloadKey:
    """The key of ``block_hash`` in KV-cache group ``group_idx`` (0 <= group_idx < 2**32)."""
    if not isinstance(block_hash, (bytes, bytearray, memoryview)):
        raise TypeError(f"make_offload_key: block_hash must be bytes, got {type(block_hash).__name__}")
    if 0 <= group_idx < 16:
        return bytes(block_hash) + _GROUP_SUFFIX[group_idx]
    if not 0 <= group_idx < 1 << 32:
        raise ValueError(f"make_offload_key: group_idx {group_idx} out of range [0, 2**32)")
    return bytes(block_hash) + _GROUP.pack(group_idx)


def split_offload_key(key: OffloadKey) -> tuple[bytes, int]:
    """``(block_hash, group_idx)`` of a key made by :func:`make_offload_key`."""
    if not isinstance(key, bytes) or len(key) < 4:
        raise ValueError(f"split_offload_key: not an offload key (bytes of length >= 4): {key!r:.60}")
    return key[:-4], _GROUP.unpack_from(key, len(key) - 4)[0]


def get_offload_block_hash(key: OffloadKey) -> bytes:
    """The block hash of ``key`` (vLLM's name; ``split_offload_key(key)[0]``)."""
    return split_offload_key(key)[0]


def get_offload_group_idx(key: OffloadKey) -> int:
    """The KV-cache group index of ``key`` (vLLM's name; ``split_offload_key(key)[1]``)."""
    return split_offload_key(key)[1]


class RequestLifecycleError(KVEventsError, ValueError):
    """A request finished twice, or finished without being announced (strict mode only)."""


class LookupResult(enum.Enum):
    HIT = "hit"
    MISS = "miss"
    #: not answerable now (e.g. a promotion is in flight): ask again in a later step.
    RETRY = "retry"


class OffloadPolicy(enum.Enum):
    #: offload only newly computed blocks; prefix hits are not stored again (default).
    BLOCK_LEVEL = "block_level"
    #: vLLM's later name for BLOCK_LEVEL (an alias: the same member)
    CHUNK_LEVEL = "block_level"
    #: offload every block of the request, prefix hits included (tiers needing whole contexts).
    REQUEST_LEVEL = "request_level"


@dataclass(slots=True)
class ReqContext:
    """What a manager knows of a request. Built once per request by the connector.

    A manager also takes any object with ``req_id`` and ``kv_transfer_params`` that takes new
    attributes (vLLM's own ``ReqContext``, as the plugin hands it over): it sets
    ``manager_state`` on it, and reads positions with its ``key_positions_of``."""

    req_id: str
    kv_transfer_params: dict[str, Any] | None = None
    #: where the request's keys sit: ``key_positions[key]`` is a key's token position (the end
    #: token of its block: any number growing from head to tail); a key missing, or None/empty,
    #: is unknown. A live mapping (the caller may fill it as the request runs). With it the LRU
    #: keeps a request's prefix head to tail whatever order its blocks are stored in.
    key_positions: Mapping[OffloadKey, int] | None = None
    #: what the manager keeps per request (its recency record); not for callers
    manager_state: Any = field(default=None, repr=False, compare=False)


@dataclass(slots=True)
class RequestOffloadingContext:
    """What a manager asks for a request (returned by ``on_new_request``)."""

    policy: OffloadPolicy = OffloadPolicy.BLOCK_LEVEL


@dataclass(slots=True, frozen=True)
class OffloadingEvent:
    """``keys`` became present in (``removed=False``) or left (``removed=True``) ``medium``.

    ``never_stored`` (with ``removed``): the keys' store failed, so they were never announced
    as present; the event only tells who noted something for them at prepare time to forget
    it (the wire sends nothing for it: no consumer heard of these keys)."""

    keys: list[OffloadKey]
    medium: str
    removed: bool
    never_stored: bool = False


@dataclass(slots=True)
class LoadStoreSpec:
    """Where blocks live in a medium: block ids (numpy int64, one per key, in key order)."""

    medium: str
    block_ids: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.int64))

    def __post_init__(self) -> None:
        ids = self.block_ids
        if not isinstance(ids, np.ndarray) or ids.dtype != np.int64:
            self.block_ids = np.asarray(ids, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.block_ids)


@dataclass(slots=True)
class PrepareStoreOutput:
    """Result of ``prepare_store``: the keys to write (those not already present), where to
    write them (``store_spec.block_ids`` aligned with ``keys_to_store``), and the keys evicted
    to make room."""

    keys_to_store: list[OffloadKey]
    store_spec: LoadStoreSpec
    evicted_keys: list[OffloadKey]


class OffloadingManager(ABC):
    """The offload role the scheduler talks to (a primary tier, or tiers behind one)."""

    #: the medium name this manager's blocks live in (e.g. ``"CPU"``).
    medium: str = "CPU"
    #: how many host blocks the manager addresses (sizes the host buffer); None: no fixed pool.
    num_blocks: int | None = None
    #: what a manager that makes events builds each one with, called ``(keys, medium, removed)``
    #: or, for a failed store's removal, ``(keys, medium, True, True)`` (``never_stored``; a
    #: factory may return None for it: not kept): :class:`OffloadingEvent`; an adapter to
    #: another framework's event type sets its own (the vLLM adapter's builds vLLM's event for
    #: this manager's medium, no conversion later)
    event_factory: Callable[..., Any] = OffloadingEvent
    #: where a request's keys sit, read from its context once, when the manager first records
    #: the request: None reads the context's ``key_positions``; an adapter whose contexts keep
    #: positions elsewhere sets a reader ``(context) -> mapping or None`` (the vLLM adapter's
    #: reads the table vLLM's scheduler fills)
    key_positions_of: Callable[[Any], Mapping[OffloadKey, int] | None] | None = None

    @abstractmethod
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """Whether ``key`` can be loaded now (HIT), not at all (MISS), or later (RETRY)."""

    @abstractmethod
    def prepare_load(self, keys: Sequence[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        """Pin ``keys`` (all must be HITs) until :meth:`complete_load`; where to read them."""

    @abstractmethod
    def touch(self, keys: Sequence[OffloadKey], req_context: ReqContext) -> None:
        """Mark ``keys`` recently used (unknown keys are ignored)."""

    @abstractmethod
    def complete_load(self, keys: Sequence[OffloadKey], req_context: ReqContext) -> None:
        """Unpin keys pinned by :meth:`prepare_load`."""

    @abstractmethod
    def prepare_store(self, keys: Sequence[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        """Reserve room for the keys not already present, all or nothing; None: cannot now."""

    @abstractmethod
    def complete_store(self, keys: Sequence[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        """Finish a store: on success the keys become loadable; on failure they are freed."""

    @abstractmethod
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        """Called once per request before any other call for it."""

    def on_request_finished(self, req_context: ReqContext) -> None:  # noqa: B027 - default no-op
        """Called once when the request is done (after its jobs completed or were flushed)."""

    def bind_block_io(self, block_io: BlockIO) -> None:  # noqa: B027 - default no-op
        """The host buffer's bytes, once the worker side has built it (an
        :class:`~manager.spec.OffloadingSpec` calls this): managers whose parts move bytes
        (secondary tiers) keep it; the default ignores it."""

    def take_events(self) -> list[OffloadingEvent]:
        """Pure drain of the events accumulated so far; changes no job or cache state."""
        return []

    #: who hears each ``on_schedule_end`` (telemetry): ``schedule_end_started() -> state``
    #: before the step's lifecycle work, ``schedule_end_finished(state)`` after it. A manager
    #: that overrides :meth:`on_schedule_end` brackets its work with
    #: ``_schedule_end_started`` / ``_schedule_end_finished`` when there are observers.
    schedule_end_observers: tuple[Any, ...] = ()

    def add_schedule_end_observer(self, observer: Any) -> None:
        self.schedule_end_observers = (*self.schedule_end_observers, observer)

    def remove_schedule_end_observer(self, observer: Any) -> None:
        self.schedule_end_observers = tuple(o for o in self.schedule_end_observers if o is not observer)

    def _schedule_end_started(self) -> list[Any]:
        return [o.schedule_end_started() for o in self.schedule_end_observers]

    def _schedule_end_finished(self, states: list[Any]) -> None:
        for o, state in zip(reversed(self.schedule_end_observers), reversed(states)):
            o.schedule_end_finished(state)

    def on_schedule_end(self, context: Any = None) -> None:
        """Once at the end of every scheduler step: the one home of step-lifecycle work (none
        by default; observers still hear it). ``context``: accepted for vLLM's signature (its
        ScheduleEndContext); unused here."""
        if self.schedule_end_observers:
            self._schedule_end_finished(self._schedule_end_started())

    def has_pending_work(self) -> bool:
        """Whether jobs are in flight or queued (a driver keeps stepping while True)."""
        return False

    def reset_cache(self) -> None:  # noqa: B027 - default no-op
        """Drop every cached block that is not in use (emitting removals when events are on)."""

    def shutdown(self) -> None:  # noqa: B027 - default no-op
        """Release resources (threads, files). Idempotent."""


class BlockIO(ABC):
    """Access to the bytes of host blocks by block id (used by secondary tiers)."""

    #: size of one block in bytes.
    block_nbytes: int

    @abstractmethod
    def read_block(self, block_id: int) -> memoryview:
        """A read-only view of block ``block_id`` (valid while the block stays pinned)."""

    @abstractmethod
    def write_block(self, block_id: int, data: bytes | bytearray | memoryview) -> None:
        """Fill block ``block_id`` with ``data`` (exactly ``block_nbytes`` bytes)."""

    def writable_block(self, block_id: int) -> memoryview | None:
        """A writable view of block ``block_id``'s own memory, for tiers that read straight
        into it (no intermediate copy); None if this BlockIO cannot give one (tiers then call
        :meth:`write_block`)."""
        return None


class NumpyBlockIO(BlockIO):
    """:class:`BlockIO` over a C-contiguous numpy array shaped ``[num_blocks, ...]``."""

    __slots__ = ("array", "block_nbytes", "num_blocks", "_flat")

    def __init__(self, array: np.ndarray) -> None:
        if not isinstance(array, np.ndarray) or array.ndim < 1 or not array.flags.c_contiguous:
            raise TypeError("NumpyBlockIO needs a C-contiguous numpy array shaped [num_blocks, ...]")
        self.array = array
        self.num_blocks = int(array.shape[0])
        self._flat = array.reshape(self.num_blocks, -1).view(np.uint8)
        self.block_nbytes = int(self._flat.shape[1])

    @classmethod
    def allocate(cls, num_blocks: int, block_nbytes: int) -> NumpyBlockIO:
        """A zeroed host buffer of ``num_blocks`` blocks of ``block_nbytes`` bytes."""
        return cls(np.zeros((num_blocks, block_nbytes), dtype=np.uint8))

    def _check(self, block_id: int) -> int:
        b = int(block_id)
        if not 0 <= b < self.num_blocks:
            raise IndexError(f"block id {b} out of range [0, {self.num_blocks})")
        return b

    def read_block(self, block_id: int) -> memoryview:
        return memoryview(self._flat[self._check(block_id)]).toreadonly()

    def writable_block(self, block_id: int) -> memoryview:
        return memoryview(self._flat[self._check(block_id)])

    def write_block(self, block_id: int, data: bytes | bytearray | memoryview) -> None:
        src = np.frombuffer(data, dtype=np.uint8)
        if src.size != self.block_nbytes:
            raise ValueError(f"write_block({block_id}): got {src.size} bytes, block holds {self.block_nbytes}")
        self._flat[self._check(block_id)] = src
