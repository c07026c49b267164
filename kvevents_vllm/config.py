"""``kv_connector_extra_config`` as our spec reads it, validated before the engine starts.

vLLM's own keys keep their meaning (those the connector itself reads are accepted and left to
it); ours live under one key, ``"kvevents"``::

    {"spec_name": "KVEventsOffloadingSpec",
     "cpu_bytes_to_use": 268435456,          # vLLM's key: the CPU tier's size
     "eviction_policy": "lru",               # vLLM's key: the CPU tier's policy (lru, arc, ...)
     "kvevents": {
        "cpu_blocks": 2048,                  # instead of cpu_bytes_to_use: offloaded blocks
        "secondary_tiers": [{"type": "fs", "root": "/var/kv", "capacity_blocks": 65536,
                             "store_policy": "backlog", "store_policy_args": {...}}],
        "strict": false}}

An unknown key (at the top or under ``"kvevents"``) is a :class:`ConfigError` naming it, raised
when vLLM builds the spec, i.e. during start-up.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvevents.errors import ConfigError

#: the key under which our own settings live
OUR_KEY = "kvevents"

#: vLLM keys the spec reads itself
SPEC_KEYS = frozenset({"cpu_bytes_to_use", "eviction_policy"})
#: vLLM keys read by vLLM's connector or its OffloadingSpec base (accepted, not ours to read)
VLLM_KEYS = frozenset({
    "spec_name", "spec_module_path", "block_size", "blocks_per_chunk", "canonical_layout",
    "self_describing_kv_events", "offload_prompt_only",
})
OUR_SUBKEYS = frozenset({"cpu_blocks", "secondary_tiers", "strict"})


@dataclass(slots=True)
class PluginConfig:
    cpu_bytes_to_use: int | None = None
    cpu_blocks: int | None = None
    eviction_policy: str = "lru"
    secondary_tiers: list[dict[str, Any]] = field(default_factory=list)
    strict: bool = False


def _positive_int(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"kv_connector_extra_config[{key!r}] must be a positive int, got {value!r}")
    return value


def parse_extra_config(extra: Mapping[str, Any]) -> PluginConfig:
    """Our settings from vLLM's ``kv_connector_extra_config``; ConfigError naming a bad key."""
    if not isinstance(extra, Mapping):
        raise ConfigError(f"kv_connector_extra_config must be a mapping, got {type(extra).__name__}")
    for key in extra:
        if key not in SPEC_KEYS and key not in VLLM_KEYS and key != OUR_KEY:
            raise ConfigError(
                f"kv_connector_extra_config: unknown key {key!r} for KVEventsOffloadingSpec "
                f"(ours go under {OUR_KEY!r}: {', '.join(sorted(OUR_SUBKEYS))})"
            )
    cfg = PluginConfig()
    if extra.get("cpu_bytes_to_use") is not None:
        cfg.cpu_bytes_to_use = _positive_int(extra["cpu_bytes_to_use"], "cpu_bytes_to_use")
    policy = extra.get("eviction_policy", "lru")
    if not isinstance(policy, str) or not policy:
        raise ConfigError(f"kv_connector_extra_config['eviction_policy'] must be a policy name, got {policy!r}")
    cfg.eviction_policy = policy
    ours = extra.get(OUR_KEY, {})
    if not isinstance(ours, Mapping):
        raise ConfigError(f"kv_connector_extra_config[{OUR_KEY!r}] must be a mapping, got {type(ours).__name__}")
    for key in ours:
        if key not in OUR_SUBKEYS:
            raise ConfigError(
                f"kv_connector_extra_config[{OUR_KEY!r}]: unknown key {key!r} "
                f"(known: {', '.join(sorted(OUR_SUBKEYS))})"
            )
    if ours.get("cpu_blocks") is not None:
        cfg.cpu_blocks = _positive_int(ours["cpu_blocks"], f"{OUR_KEY}.cpu_blocks")
    tiers = ours.get("secondary_tiers", [])
    if isinstance(tiers, (str, Mapping)) or not isinstance(tiers, (list, tuple)) or not all(
        isinstance(t, Mapping) for t in tiers
    ):
        raise ConfigError(f"kv_connector_extra_config[{OUR_KEY!r}]['secondary_tiers'] must be a list of tier configs")
    cfg.secondary_tiers = [dict(t) for t in tiers]
    strict = ours.get("strict", False)
    if not isinstance(strict, bool):
        raise ConfigError(f"kv_connector_extra_config[{OUR_KEY!r}]['strict'] must be a bool, got {strict!r}")
    cfg.strict = strict
    if cfg.cpu_bytes_to_use is None and cfg.cpu_blocks is None:
        raise ConfigError(
            "kv_connector_extra_config: give 'cpu_bytes_to_use' (vLLM's key) or "
            f"{OUR_KEY!r}: {{'cpu_blocks': N}} to size the CPU tier"
        )
    return cfg
