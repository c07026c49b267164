"""Through vLLM's types: the CPU tier's store admission configured by vLLM's keys
(``store_threshold``, ``max_tracker_size``) and reported as vLLM's skipped-stores counter, and
a failed store's removal handed to vLLM as ``metadata_only``."""

from __future__ import annotations

import dataclasses

import pytest
from vllm.v1.kv_offload import base as vbase
from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics as CM

from kvevents.errors import ConfigError
from kvevents_vllm.spec import KVEventsOffloadingSpec
from tests.vllm.test_spec_adapter import PAGE, K, offloading_config


def manager(**extra):
    return KVEventsOffloadingSpec(offloading_config({"cpu_bytes_to_use": 4 * 2 * PAGE, **extra})).get_manager()


def test_store_threshold_from_vllms_keys_and_its_counter():
    m = manager(store_threshold=2, max_tracker_size=3)
    ctx = vbase.ReqContext(req_id="r")
    m.on_new_request(ctx)
    assert m.counts is not None and len(m.counts) == 0
    assert m.prepare_store([K(1), K(2)], ctx).keys_to_store == []
    assert dict(m.counts) == {K(1): 1, K(2): 1} and m.stores_skipped_in_current_batch == 2
    out = m.prepare_store([K(1), K(2), K(3)], ctx)
    assert out.keys_to_store == [K(1), K(2)] and m.stores_skipped_in_current_batch == 3
    m.complete_store(out.keys_to_store, ctx)
    assert m.get_stats().reduce()[CM.STORES_SKIPPED] == 3
    assert m.get_stats().reduce()[CM.STORES_SKIPPED] == 0 and m.stores_skipped_in_current_batch == 0
    assert m.stats()["stores_not_admitted"] == 3  # our counter keeps the total
    assert CM.STORES_SKIPPED in KVEventsOffloadingSpec.build_metric_definitions({"store_threshold": 2})
    assert CM.STORES_SKIPPED not in KVEventsOffloadingSpec.build_metric_definitions({"store_threshold": 1})


def test_without_a_threshold_nothing_is_filtered_nor_reported():
    m = manager()
    ctx = vbase.ReqContext(req_id="r")
    assert m.counts is None
    assert m.prepare_store([K(1)], ctx).keys_to_store == [K(1)]
    assert CM.STORES_SKIPPED not in m.get_stats().reduce()


@pytest.mark.parametrize("extra, match", [
    ({"store_threshold": -1}, r"^kv_connector_extra_config\['store_threshold'\] must be int >= 0, got -1$"),
    ({"max_tracker_size": 0}, r"^kv_connector_extra_config\['max_tracker_size'\] must be int >= 1, got 0$"),
    ({"store_threshold": 2, "kvevents": {"secondary_tiers": [{"type": "example"}]}},
     r"^kv_connector_extra_config\['store_threshold'\] \(2\) cannot be used with 'kvevents'"),
])
def test_bad_admission_keys_fail_at_start_up_naming_the_key(extra, match):
    with pytest.raises(ConfigError, match=match):
        KVEventsOffloadingSpec(offloading_config({"cpu_bytes_to_use": 1 << 20, **extra}))


def test_a_failed_store_is_a_metadata_only_removal_without_the_keys_stored_again():
    m = manager()
    ctx = vbase.ReqContext(req_id="r")
    m.prepare_store([K(1), K(2)], ctx)
    m.complete_store([K(1), K(2)], ctx, success=False)
    m.prepare_store([K(2)], ctx)  # a retry before the drain
    if "metadata_only" not in {f.name for f in dataclasses.fields(vbase.OffloadingEvent)}:
        assert list(m.take_events()) == []  # vLLM 0.32: no such event (its own manager makes none)
        m.complete_store([K(2)], ctx)
        [ev] = m.take_events()
        assert (ev.keys, ev.removed) == ([K(2)], False)
        return
    [ev] = m.take_events()
    assert type(ev) is vbase.OffloadingEvent
    assert (ev.keys, ev.medium, ev.removed, ev.metadata_only, ev.ownership) == (
        [K(1)], vbase.Medium.CPU, True, True, None)
    m.complete_store([K(2)], ctx)
    [ev] = m.take_events()
    assert (ev.keys, ev.removed, ev.metadata_only) == ([K(2)], False, False)
