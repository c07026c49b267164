"""``kv_connector_extra_config`` as our spec reads it, validated before the engine starts.

vLLM's own keys keep their meaning (those the connector itself reads are accepted and left to
it); ours live under one key, ``"kvevents"``::

    {"spec_name": "KVEventsOffloadingSpec",
     "cpu_bytes_to_use": 268435456,          # vLLM's key: the CPU tier's size
     "eviction_policy": "lru",               # vLLM's key: the CPU tier's policy (lru, arc, ...)
     "store_threshold": 2,                   # vLLM's key: store a block on its 2nd offer (0, 1: always)
     "max_tracker_size": 64000,              # vLLM's key: offer counts kept for that many blocks
     "kvevents": {
        "cpu_blocks": 2048,                  # instead of cpu_bytes_to_use: offloaded blocks
        "secondary_tiers": [{"type": "fs", "root": "/var/kv", "capacity_blocks": 65536,
                             "store_policy": "backlog", "store_policy_args": {...}}],
        "strict": false}}

The mapping is read into msgspec Structs (:class:`ExtraConfig`, :class:`OurKeys`): an unknown key
(at the top or under ``"kvevents"``), a wrong type or a value out of range is a :class:`ConfigError`
in one line naming the key by msgspec's path
(``kv_connector_extra_config['kvevents']['cpu_blocks'] must be int >= 1, got 0``), raised when
vLLM builds the spec, i.e. during start-up.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct

from kvevents.errors import ConfigError
from kvevents.settings import MAPPING_WORDS, decode, subscripted

__all__ = ["OUR_KEY", "ExtraConfig", "OurKeys", "PluginConfig", "parse_extra_config"]

#: the key under which our own settings live
OUR_KEY = "kvevents"

Positive = Annotated[int, Meta(ge=1)]
NonNegative = Annotated[int, Meta(ge=0)]


class OurKeys(Struct, forbid_unknown_fields=True, kw_only=True):
    """``"kvevents"``: our own settings."""

    #: instead of cpu_bytes_to_use: the CPU tier's size in offloaded blocks
    cpu_blocks: Positive | None = None
    #: tier configs behind the CPU tier (each checked by its tier class: spec._check_tiers)
    secondary_tiers: list[dict[str, Any]] = msgspec.field(default_factory=list)
    strict: bool = False


class ExtraConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    """``kv_connector_extra_config``: vLLM's keys the spec reads, vLLM's keys read by vLLM's
    connector or its OffloadingSpec base (accepted, not ours to read), and ``"kvevents"``."""

    cpu_bytes_to_use: Positive | None = None
    eviction_policy: Annotated[str, Meta(min_length=1)] = "lru"
    store_threshold: NonNegative = 0
    max_tracker_size: Positive = 64_000
    kvevents: OurKeys = msgspec.field(default_factory=OurKeys)
    spec_name: Any = None
    spec_module_path: Any = None
    block_size: Any = None
    blocks_per_chunk: Any = None
    canonical_layout: Any = None
    self_describing_kv_events: Any = None
    offload_prompt_only: Any = None


#: what the spec reads (a flat view of ExtraConfig)
class PluginConfig(Struct, kw_only=True):
    cpu_bytes_to_use: int | None = None
    cpu_blocks: int | None = None
    eviction_policy: str = "lru"
    store_threshold: int = 0
    max_tracker_size: int = 64_000
    secondary_tiers: list[dict[str, Any]] = msgspec.field(default_factory=list)
    strict: bool = False


def parse_extra_config(extra: Mapping[str, Any]) -> PluginConfig:
    """Our settings from vLLM's ``kv_connector_extra_config``; ConfigError naming a bad key."""
    root = "kv_connector_extra_config"
    if not isinstance(extra, Mapping):
        raise ConfigError(f"{root} must be a mapping, got {type(extra).__name__}")
    x = decode(dict(extra), ExtraConfig, name=subscripted(root), words=MAPPING_WORDS,
               unknown="{where}: unknown key {key!r} (known: {known})")
    if x.cpu_bytes_to_use is None and x.kvevents.cpu_blocks is None:
        raise ConfigError(
            f"{root}: give 'cpu_bytes_to_use' (vLLM's key) or {OUR_KEY!r}: {{'cpu_blocks': N}} to size the CPU tier")
    if x.store_threshold >= 2 and x.kvevents.secondary_tiers:
        raise ConfigError(
            f"{root}['store_threshold'] ({x.store_threshold}) cannot be used with {OUR_KEY!r}: {{'secondary_tiers': ...}}: "
            "blocks promoted from a secondary tier would be refused by the CPU tier's admission filter")
    return PluginConfig(cpu_bytes_to_use=x.cpu_bytes_to_use, cpu_blocks=x.kvevents.cpu_blocks,
                        eviction_policy=x.eviction_policy, store_threshold=x.store_threshold,
                        max_tracker_size=x.max_tracker_size, secondary_tiers=x.kvevents.secondary_tiers,
                        strict=x.kvevents.strict)
