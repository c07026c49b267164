"""The KV-cache event structs, field for field and in order as vLLM 0.33 puts them on the wire.

Two encodings exist in the wild and both are modelled here:

* the current one (vLLM >= 0.26): each event is a msgpack map tagged by ``"type"``; fields
  without a default are always written (``None`` included), defaulted fields are left out
  while they hold their default;
* the legacy one (vLLM <= 0.25): each event is a msgpack array ``[tag, field, ...]`` holding
  the 0.22 fields, every one of them written.

In both, the outer batch is the array ``[ts, events, data_parallel_rank]``.

A block hash is an ``int`` (vLLM's default: the low 64 bits of the hash, unsigned; some
deployments send it signed) or ``bytes`` (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``).
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

BlockHash = Union[int, bytes]

#: The medium names vLLM uses; any other string is carried through unchanged.
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"


class KVCacheEvent(msgspec.Struct, tag_field="type", omit_defaults=True, gc=False):
    """Base of every event; the class name is the ``"type"`` tag on the wire."""


class BlockStored(KVCacheEvent, tag=True):
    """Blocks became present in ``medium``.

    GPU events from the engine carry ``token_ids`` and ``block_size``; offload events
    (CPU, STORAGE, ...) carry no tokens and ``block_size == 0``: consumers learn the block
    size from the engine's GPU events and join the two by hash.
    """

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent, tag=True):
    """Blocks left ``medium`` (evicted or freed)."""

    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent, tag=True):
    """Every block of the publisher is gone (a cache reset)."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One publish: the events of one engine step, stamped with wall-clock seconds."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


# --- legacy (vLLM <= 0.25) array encoding ---------------------------------------------------
# Every field after block_size is defaulted so that arrays from releases older than 0.22
# (fewer trailing fields) still decode; extra trailing elements from newer ones are ignored.


class _LegacyEvent(msgspec.Struct, array_like=True, tag_field="type", gc=False):
    pass


class LegacyBlockStored(_LegacyEvent, tag="BlockStored"):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class LegacyBlockRemoved(_LegacyEvent, tag="BlockRemoved"):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class LegacyAllBlocksCleared(_LegacyEvent, tag="AllBlocksCleared"):
    pass


class LegacyKVEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Union[LegacyBlockStored, LegacyBlockRemoved, LegacyAllBlocksCleared]]
    data_parallel_rank: int | None = None


# --- lenient map decoding: a map from a release that lacked some required field -------------


class _LenientEvent(msgspec.Struct, tag_field="type", gc=False):
    pass


class LenientBlockStored(_LenientEvent, tag="BlockStored"):
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class LenientBlockRemoved(_LenientEvent, tag="BlockRemoved"):
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class LenientAllBlocksCleared(_LenientEvent, tag="AllBlocksCleared"):
    pass


class LenientKVEventBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[Union[LenientBlockStored, LenientBlockRemoved, LenientAllBlocksCleared]]
    data_parallel_rank: int | None = None


_CANONICAL = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}
_LEGACY = {
    BlockStored: LegacyBlockStored,
    BlockRemoved: LegacyBlockRemoved,
    AllBlocksCleared: LegacyAllBlocksCleared,
}


def to_canonical(event: msgspec.Struct) -> KVEvent:
    """Turn a legacy or lenient event into the canonical (0.33) struct, defaults filled.

    Legacy and lenient fields are a leading part of the canonical ones, in the same order
    (asserted below), so the values pass positionally.
    """
    return _CANONICAL[type(event).__struct_config__.tag](*msgspec.structs.astuple(event))


def to_legacy(event: KVEvent) -> msgspec.Struct:
    """The 0.22 array form of an event; fields the legacy layout lacks are dropped."""
    cls = _LEGACY[type(event)]
    return cls(**{f: getattr(event, f) for f in cls.__struct_fields__})


for _lax in (LegacyBlockStored, LegacyBlockRemoved, LegacyAllBlocksCleared,
             LenientBlockStored, LenientBlockRemoved, LenientAllBlocksCleared):
    _fields = _lax.__struct_fields__
    assert _CANONICAL[_lax.__struct_config__.tag].__struct_fields__[: len(_fields)] == _fields, _lax
