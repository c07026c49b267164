"""The OffloadingSpec role: one config builds the manager (scheduler side) and the transfer
worker with the host block I/O (worker side); SimEngine is configured with a spec and talks
to the manager only through its role; the wire adapter is one module."""

from __future__ import annotations

import numpy as np
import pytest

from kvevents import BlockRemoved, BlockStored, ConfigError
from manager import (
    BlockIO,
    CPUOffloadingManager,
    CPUOffloadingSpec,
    LookupResult,
    ManagerSpec,
    OffloadingEvent,
    OffloadingSpec,
    create_spec,
    make_offload_key,
)
from manager.engine_sim import SimEngine
from manager.spec import SPECS, register_spec
from manager.tiering import ExampleSecondaryTierManager, TieringOffloadingManager
from manager.wire import assemble_batch, offload_events_to_kv_events


def test_cpu_spec_builds_the_manager_once() -> None:
    spec = CPUOffloadingSpec(16, cache_policy="arc")
    m = spec.get_manager()
    assert isinstance(m, CPUOffloadingManager) and m.num_blocks == 16 and m.enable_events
    assert spec.get_manager() is m
    assert spec.num_host_blocks() == 16


def test_cpu_spec_with_tiers_builds_a_tiering_manager_and_binds_the_host_buffer() -> None:
    spec = CPUOffloadingSpec(8, secondary_tiers=[{"type": "example", "medium": "EX"}], strict=True)
    m = spec.get_manager()
    assert isinstance(m, TieringOffloadingManager) and m.strict and m.num_blocks == 8
    (tier,) = m.secondary_tiers
    assert isinstance(tier, ExampleSecondaryTierManager) and tier.block_io is None
    dev = np.zeros((12, 4), dtype=np.int64)
    h = spec.create_handlers(dev, blocks_per_chunk=2)
    try:
        assert h.host_blocks == 8 and tier.block_io is h.host_block_io
        assert h.host_block_io.block_nbytes == 2 * 4 * 8  # two device rows of 4 int64 per offloaded block
        assert h.worker.num_host_blocks == 16 and h.worker.num_device_blocks == 12
        h.worker.host_array()[2:4] = 7  # the BlockIO sees the worker's host buffer, no copy
        assert set(bytes(h.host_block_io.read_block(1))) == {7, 0}
    finally:
        h.worker.shutdown()


def test_torch_handlers_share_the_host_buffer() -> None:
    torch = pytest.importorskip("torch")
    spec = CPUOffloadingSpec(4)
    h = spec.get_handlers(torch.zeros((4, 2), dtype=torch.int64))  # vLLM's name
    try:
        h.worker.submit_store(1, [0], [3])
        assert h.worker.wait(timeout=30)
        h.worker.get_finished()
        h.worker.host_cache[3] = 5
        assert np.frombuffer(h.host_block_io.read_block(3), dtype=np.int64).tolist() == [5, 5]
    finally:
        h.worker.shutdown()


def test_create_spec_and_the_registry() -> None:
    spec = create_spec({"num_blocks": 4, "offloaded_block_size": 32})
    assert isinstance(spec, CPUOffloadingSpec) and spec.offloaded_block_size == 32
    assert "cpu" in SPECS.names()
    with pytest.raises(ConfigError, match="nope"):
        create_spec({"spec": "nope"})
    with pytest.raises(ConfigError, match="bad arguments"):
        create_spec({"spec": "cpu", "num_blocks": 4, "colour": "red"})
    with pytest.raises(ConfigError, match="num_blocks"):
        CPUOffloadingSpec(0)
    with pytest.raises(ConfigError, match="secondary_tiers"):
        CPUOffloadingSpec(4, secondary_tiers={"type": "example"})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="offloaded_block_size"):
        CPUOffloadingSpec(4, offloaded_block_size=0)
    register_spec("test-lazy-spec", "tests.spec_plugin_absent", "Nope")  # nothing imported yet
    with pytest.raises(ConfigError, match="tests.spec_plugin_absent"):
        create_spec({"spec": "test-lazy-spec"})


def test_manager_spec_wraps_a_manager_and_rejects_anything_else() -> None:
    m = CPUOffloadingManager(4)
    assert ManagerSpec(m).get_manager() is m
    with pytest.raises(TypeError, match="OffloadingManager"):
        ManagerSpec(object())  # type: ignore[arg-type]


class _OwnManager(CPUOffloadingManager):
    """A manager with parts of its own: it is told the host buffer through the role."""

    def __init__(self) -> None:
        super().__init__(8, enable_events=True)
        self.bound: list[BlockIO] = []

    def bind_block_io(self, block_io: BlockIO) -> None:
        self.bound.append(block_io)


class _OwnSpec(OffloadingSpec):
    def create_manager(self) -> _OwnManager:
        return _OwnManager()


def test_sim_engine_takes_a_spec_and_uses_only_the_role() -> None:
    spec = _OwnSpec(offloaded_block_size=8)
    e = SimEngine(spec, None, gpu_blocks=16, block_size=4, use_torch=False, sync_transfers=True)
    try:
        assert e.spec is spec and e.manager is spec.get_manager()
        assert e.offload_block_size == 8 and e.connector.blocks_per_chunk == 2  # from the spec
        assert e.manager.bound == [e.host_block_io] and e.host_block_io.num_blocks == 8
        e.add_request("a", list(range(20)), max_new_tokens=2)
        e.run_until_idle()
        assert e.requests_finished == 1 and len(e.manager.cached_keys()) == 2
    finally:
        e.shutdown()


def test_sim_engine_over_a_tiered_spec_promotes_the_right_bytes() -> None:
    spec = CPUOffloadingSpec(4, secondary_tiers=[{"type": "example"}])
    e = SimEngine(spec, None, gpu_blocks=12, block_size=4, use_torch=False, sync_transfers=True)
    try:
        for i in range(6):  # more distinct prefixes than the primary holds: promotions follow
            e.add_request(f"w{i}", [i] * 8 + [99], max_new_tokens=1)
        e.run_until_idle()
        for i in range(6):
            e.add_request(f"r{i}", [i] * 8 + [98], max_new_tokens=1)
        e.run_until_idle()
        m = e.manager
        assert isinstance(m, TieringOffloadingManager) and m.promotions_started > 0
        assert e.offload_hit_tokens > 0 and e.load_verify_failures == 0 and e.load_failures == 0
        assert m.secondary_tiers[0].block_io is e.host_block_io
    finally:
        e.shutdown()


def test_the_wire_adapter_is_one_module() -> None:
    import manager
    import manager.connector as connector

    assert connector.offload_events_to_kv_events is offload_events_to_kv_events
    assert manager.offload_events_to_kv_events is offload_events_to_kv_events
    k0, k1 = make_offload_key(b"\x00" * 7 + b"\x05", 0), make_offload_key(b"\x00" * 7 + b"\x06", 1)
    evs = offload_events_to_kv_events([OffloadingEvent([k0, k1], "CPU", False), OffloadingEvent([k0], "CPU", True)])
    assert [type(e) for e in evs] == [BlockStored, BlockStored, BlockRemoved]
    assert evs[0].block_hashes == [5] and evs[0].block_size == 0 and evs[0].token_ids == []
    assert evs[1].group_idx == 1 and evs[2].medium == "CPU"
    assert assemble_batch([], [], ts=1.0) is None
    b = assemble_batch(evs[2:], evs[:2], ts=2.0, data_parallel_rank=3)
    assert b is not None and b.events == [evs[2], *evs[:2]] and b.data_parallel_rank == 3 and b.ts == 2.0


def test_lookup_result_round_trip_through_spec_manager() -> None:
    spec = CPUOffloadingSpec(2)
    m = spec.get_manager()
    from manager import ReqContext

    rc = ReqContext("x")
    m.on_new_request(rc)
    k = make_offload_key(b"k" * 8)
    out = m.prepare_store([k], rc)
    assert out is not None
    m.complete_store([k], rc)
    assert m.lookup(k, rc) is LookupResult.HIT
