"""vLLM's kv_offload names that ours mirror or accept as well (the table in docs/manager.md): each
row of the table has a check here, through the public API."""

from __future__ import annotations

import inspect

import pytest

from kvevents import ConfigError
from manager import (
    CPUOffloadingManager,
    LookupResult,
    OffloadingManager,
    OffloadPolicy,
    ReqContext,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)
from manager.connector import OffloadingConnectorScheduler
from manager.connector_types import EngineRequest
from manager.engine_sim import SimEngine
from manager.tiering import (
    ExampleSecondaryTierManager,
    SecondaryTierFactory,
    SecondaryTierManager,
    TieringOffloadingManager,
)

_PER_REQUEST = ("lookup", "prepare_load", "touch", "complete_load", "prepare_store", "complete_store",
                "on_new_request", "on_request_finished")


def K(i: int) -> bytes:
    return make_offload_key(i.to_bytes(8, "big"), 0)


@pytest.mark.parametrize("cls", [OffloadingManager, CPUOffloadingManager, TieringOffloadingManager])
def test_the_per_request_argument_is_named_req_context(cls) -> None:  # type: ignore[no-untyped-def]
    for name in _PER_REQUEST:
        assert "req_context" in inspect.signature(getattr(cls, name)).parameters, (cls.__name__, name)


@pytest.mark.parametrize("tier_type", [None, "example", "fs"])
def test_tiers_take_req_context_too(tier_type) -> None:  # type: ignore[no-untyped-def]
    cls = SecondaryTierManager if tier_type is None else SecondaryTierFactory.get_tier_class(tier_type)
    for name in ("lookup", "touch", "on_new_request", "on_request_finished"):
        assert "req_context" in inspect.signature(getattr(cls, name)).parameters, (cls.__name__, name)


def test_a_whole_request_by_keyword_req_context() -> None:
    tier = SecondaryTierFactory.create_secondary_tier({"type": "example"})
    m = TieringOffloadingManager(primary_tier=CPUOffloadingManager(4), secondary_tiers=[tier])
    rc = ReqContext("r1")
    assert m.on_new_request(req_context=rc).policy is OffloadPolicy.BLOCK_LEVEL
    out = m.prepare_store([K(1)], req_context=rc)  # TypeError before: the argument was `ctx`
    assert out is not None and out.keys_to_store == [K(1)]
    m.complete_store([K(1)], req_context=rc, success=True)
    assert m.lookup(K(1), req_context=rc) is LookupResult.HIT
    m.prepare_load([K(1)], req_context=rc)
    m.touch([K(1)], req_context=rc)
    m.complete_load([K(1)], req_context=rc)
    m.on_request_finished(req_context=rc)
    m.on_schedule_end()
    assert tier.lookup(K(1), req_context=rc) is LookupResult.HIT  # cascaded
    assert tier.finished_requests == ["r1"]


def test_tiering_manager_exposes_primary_tier_and_secondary_tiers() -> None:
    p = CPUOffloadingManager(4)
    tiers = [ExampleSecondaryTierManager(), ExampleSecondaryTierManager(medium="X")]
    m = TieringOffloadingManager(primary_tier=p, secondary_tiers=tiers)
    assert m.primary_tier is p and m.secondary_tiers == tiers
    assert m.primary is p and m.tiers is m.secondary_tiers  # our names, the same objects
    assert m.num_blocks == 4
    m2 = TieringOffloadingManager(p, tiers)  # positionally, as before
    assert m2.primary_tier is p
    with pytest.raises(TypeError, match="exactly one of primary / primary_tier"):
        TieringOffloadingManager(p, tiers, primary_tier=p)
    with pytest.raises(TypeError):
        TieringOffloadingManager(secondary_tiers=tiers)


def test_example_tier_get_num_blocks() -> None:
    tier = ExampleSecondaryTierManager()
    m = TieringOffloadingManager(CPUOffloadingManager(4), [tier])
    rc = ReqContext("a")
    m.on_new_request(rc)
    assert tier.get_num_blocks() == 0
    out = m.prepare_store([K(1), K(2)], rc)
    assert out is not None
    m.complete_store(out.keys_to_store, rc)
    assert tier.get_num_blocks() == 2
    tier.remove([K(1)])
    assert tier.get_num_blocks() == 1


def test_factory_get_tier_class_by_type_or_config() -> None:
    assert SecondaryTierFactory.get_tier_class("example") is ExampleSecondaryTierManager
    assert SecondaryTierFactory.get_tier_class({"type": "example", "custom_param": 1}) is ExampleSecondaryTierManager
    with pytest.raises(ConfigError, match="nope"):
        SecondaryTierFactory.get_tier_class("nope")
    with pytest.raises(ConfigError, match="no 'type'"):
        SecondaryTierFactory.get_tier_class({"custom_param": 1})
    tier = SecondaryTierFactory.create_secondary_tier(tier_config={"type": "example", "custom_param": 3})
    assert tier.custom_param == 3


def test_key_helpers_policy_alias_and_schedule_end_context() -> None:
    key = make_offload_key(b"\x01" * 8, 3)
    assert get_offload_block_hash(key) == b"\x01" * 8 and get_offload_group_idx(key) == 3
    assert OffloadPolicy.CHUNK_LEVEL is OffloadPolicy.BLOCK_LEVEL
    m = TieringOffloadingManager(CPUOffloadingManager(2), [])
    m.on_schedule_end(object())  # vLLM passes a ScheduleEndContext
    CPUOffloadingManager(2).on_schedule_end(None)


class _CountingCPU(CPUOffloadingManager):
    def __init__(self, *a, **kw) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*a, **kw)
        self.new_requests: list[str] = []

    def on_new_request(self, req_context: ReqContext):  # type: ignore[no-untyped-def]
        self.new_requests.append(req_context.req_id)
        return super().on_new_request(req_context)


def test_connector_on_new_request_runs_once_when_the_engine_adds_the_request() -> None:
    m = _CountingCPU(32)
    e = SimEngine(m, None, gpu_blocks=16, block_size=4, use_torch=False)
    try:
        e.add_request("a", list(range(10)), max_new_tokens=3)
        assert m.new_requests == ["a"]  # at add time, before any step
        assert e.connector.policy_of("a") is OffloadPolicy.BLOCK_LEVEL
        e.run_until_idle()
        assert m.new_requests == ["a"]  # and never again
        assert e.connector.stats()["requests_seen"] == 1
    finally:
        e.shutdown()


def test_connector_request_finished_takes_the_request_object_and_block_ids() -> None:
    m = _CountingCPU(8)
    c = OffloadingConnectorScheduler(m, 4, 4)
    req = EngineRequest("r", [b"\x00" * 32], 4)
    c.on_new_request(req)
    c.on_new_request(req)
    assert m.new_requests == ["r"]
    assert c.request_finished(req, [0]) is False  # vLLM passes (request, block_ids)
    assert c.tracked_requests() == set()
