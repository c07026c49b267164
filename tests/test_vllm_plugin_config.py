"""The vLLM plugin's ``kv_connector_extra_config`` read into msgspec Structs
(``kvevents_vllm.config``, which does not import vLLM): each refusal one line naming the key by
msgspec's path, written as the mapping's subscripts. The spec built by a real vLLM is checked in
tests/vllm/test_spec_adapter.py."""

from __future__ import annotations

import re
import types

import pytest

from kvevents.errors import ConfigError
from kvevents_vllm.config import ExtraConfig, parse_extra_config

ROOT = "kv_connector_extra_config"


@pytest.mark.parametrize("extra, line", [
    ({"cpu_bytes_to_use": 1 << 20, "typo_key": 1},
     f"{ROOT}: unknown key 'typo_key' (known: {', '.join(sorted(ExtraConfig.__struct_fields__))})"),
    ({"cpu_bytes_to_use": 1 << 20, "kvevents": {"tiers": []}},
     f"{ROOT}['kvevents']: unknown key 'tiers' (known: cpu_blocks, secondary_tiers, strict)"),
    ({"cpu_bytes_to_use": -5}, f"{ROOT}['cpu_bytes_to_use'] must be int >= 1, got -5"),
    ({"cpu_bytes_to_use": True}, f"{ROOT}['cpu_bytes_to_use'] must be int, got True"),
    ({"kvevents": {"cpu_blocks": 0}}, f"{ROOT}['kvevents']['cpu_blocks'] must be int >= 1, got 0"),
    ({"kvevents": {"cpu_blocks": 8, "secondary_tiers": "fs"}},
     f"{ROOT}['kvevents']['secondary_tiers'] must be a list, got 'fs'"),
    ({"kvevents": {"cpu_blocks": 8, "secondary_tiers": [{"type": "fs"}, 3]}},
     f"{ROOT}['kvevents']['secondary_tiers'][1] must be a mapping, got 3"),
    ({"kvevents": {"cpu_blocks": 8, "strict": "yes"}}, f"{ROOT}['kvevents']['strict'] must be bool, got 'yes'"),
    ({"kvevents": None}, f"{ROOT}['kvevents'] must be a mapping, got None"),
    ({"cpu_bytes_to_use": 1, "eviction_policy": ""}, f"{ROOT}['eviction_policy'] must be str of length >= 1, got ''"),
    ({}, f"{ROOT}: give 'cpu_bytes_to_use' (vLLM's key) or 'kvevents': {{'cpu_blocks': N}} to size the CPU tier"),
    ({"cpu_bytes_to_use": 1, "store_threshold": -1}, f"{ROOT}['store_threshold'] must be int >= 0, got -1"),
    ({"cpu_bytes_to_use": 1, "store_threshold": "2"}, f"{ROOT}['store_threshold'] must be int, got '2'"),
    ({"cpu_bytes_to_use": 1, "max_tracker_size": 0}, f"{ROOT}['max_tracker_size'] must be int >= 1, got 0"),
    ({"cpu_bytes_to_use": 1, "store_threshold": 2, "kvevents": {"secondary_tiers": [{"type": "fs"}]}},
     f"{ROOT}['store_threshold'] (2) cannot be used with 'kvevents': {{'secondary_tiers': ...}}: blocks promoted "
     "from a secondary tier would be refused by the CPU tier's admission filter"),
    ([("cpu_bytes_to_use", 1)], f"{ROOT} must be a mapping, got list"),
])
def test_a_bad_extra_config_is_one_line_naming_the_key(extra, line) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_extra_config(extra)
    assert str(exc.value) == line


def test_the_vllm_suites_expectations_hold_without_vllm() -> None:
    """The messages tests/vllm/test_spec_adapter.py matches (it needs vLLM to build the spec)."""
    for extra, match in (({"cpu_bytes_to_use": 1 << 20, "typo_key": 1}, "unknown key 'typo_key'"),
                         ({"cpu_bytes_to_use": 1 << 20, "kvevents": {"tiers": []}}, r"\['kvevents'\]: unknown key 'tiers'"),
                         ({"cpu_bytes_to_use": -5}, "cpu_bytes_to_use"), ({}, "cpu_bytes_to_use")):
        with pytest.raises(ConfigError) as exc:
            parse_extra_config(extra)
        assert re.search(match, str(exc.value)), str(exc.value)


def test_vllm_s_own_keys_are_accepted_and_ours_read() -> None:
    extra = types.MappingProxyType({
        "spec_name": "KVEventsOffloadingSpec", "spec_module_path": "kvevents_vllm.spec", "block_size": 64,
        "cpu_bytes_to_use": 1 << 20, "eviction_policy": "arc",
        "kvevents": {"secondary_tiers": ({"type": "fs", "root": "/tmp/kv", "store_policy_args": {"x": 1}},),
                     "strict": True}})
    cfg = parse_extra_config(extra)
    assert (cfg.cpu_bytes_to_use, cfg.cpu_blocks, cfg.eviction_policy, cfg.strict) == (1 << 20, None, "arc", True)
    assert cfg.secondary_tiers == [{"type": "fs", "root": "/tmp/kv", "store_policy_args": {"x": 1}}]
    assert parse_extra_config({"kvevents": {"cpu_blocks": 16}}).cpu_blocks == 16


def test_vllm_s_store_admission_keys_are_read() -> None:
    cfg = parse_extra_config({"cpu_bytes_to_use": 1 << 20, "store_threshold": 3, "max_tracker_size": 100})
    assert (cfg.store_threshold, cfg.max_tracker_size) == (3, 100)
    cfg = parse_extra_config({"cpu_bytes_to_use": 1 << 20, "store_threshold": 1,
                              "kvevents": {"secondary_tiers": [{"type": "fs", "root": "/tmp/kv"}]}})
    assert (cfg.store_threshold, cfg.max_tracker_size) == (1, 64_000)  # 0 and 1: no filter, tiers allowed
