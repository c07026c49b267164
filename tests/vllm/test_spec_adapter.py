"""KVEventsOffloadingSpec without an engine: vLLM's own config, factory and types, our manager.

Built from vLLM's real ``OffloadingConfig`` and found through vLLM's real
``OffloadingSpecFactory``; the worker runs on CPU torch tensors shaped as vLLM hands them over.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch
from vllm.v1.kv_offload import base as vbase
from vllm.v1.kv_offload import config as vconfig
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvevents.errors import ConfigError
from kvevents_vllm import versions
from kvevents_vllm.spec import KVEventsOffloadingSpec, register_spec

PAGE = 64  # bytes per device block per KV tensor


def offloading_config(extra: dict, *, bytes_per_block: int = 2 * PAGE, blocks_per_chunk: int = 1,
                      groups: int = 1, events: bool = True) -> vconfig.OffloadingConfig:
    parallel = vconfig.OffloadingParallelConfig(
        rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, data_parallel_index=0,
        data_parallel_size=1, data_parallel_rank_local=None, is_parallelism_agnostic=True)
    return vconfig.OffloadingConfig(
        groups=tuple(vconfig.OffloadingGroupConfig(16, (f"layer{g}",), g) for g in range(groups)),
        worker_kv_bytes_per_block=bytes_per_block, enable_kv_cache_events=events, extra_config=extra,
        engine_id=f"test-{uuid.uuid4().hex}", model=vconfig.OffloadingModelConfig("tiny", "float32"),
        cache=vconfig.OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=blocks_per_chunk),
        parallel=parallel)


def K(i: int, group: int = 0) -> bytes:
    return vbase.make_offload_key(i.to_bytes(8, "big"), group)


def test_vllm_factory_finds_our_spec_by_name_and_by_module_path():
    register_spec()
    register_spec()  # idempotent: every vLLM process calls it, some twice
    extra = {"spec_name": "KVEventsOffloadingSpec", "cpu_bytes_to_use": 1 << 20}
    spec = OffloadingSpecFactory.create_spec(offloading_config(extra))
    assert isinstance(spec, KVEventsOffloadingSpec) and isinstance(spec, vbase.OffloadingSpec)
    assert spec.num_chunks == (1 << 20) // (2 * PAGE)
    cls = OffloadingSpecFactory.get_spec_cls({"spec_name": "KVEventsOffloadingSpec",
                                              "spec_module_path": "kvevents_vllm.spec"})
    assert cls is KVEventsOffloadingSpec


@pytest.mark.parametrize("extra, match", [
    ({"cpu_bytes_to_use": 1 << 20, "typo_key": 1}, "unknown key 'typo_key'"),
    ({"cpu_bytes_to_use": 1 << 20, "kvevents": {"tiers": []}}, r"\['kvevents'\]: unknown key 'tiers'"),
    ({"cpu_bytes_to_use": 1 << 20, "kvevents": {"secondary_tiers": [{"type": "nope"}]}},
     r"secondary_tiers'\]\[0\]: .*'nope'"),
    ({"cpu_bytes_to_use": -5}, "cpu_bytes_to_use"),
    ({}, "cpu_bytes_to_use"),
])
def test_bad_config_is_one_line_naming_the_key(extra, match):
    with pytest.raises(ConfigError, match=match) as err:
        KVEventsOffloadingSpec(offloading_config(extra))
    assert "\n" not in str(err.value)


def test_too_small_cpu_tier_fails_when_built_not_at_first_request():
    spec = KVEventsOffloadingSpec(offloading_config({"cpu_bytes_to_use": 10}))
    with pytest.raises(ConfigError, match="holds no offloaded block"):
        spec.get_manager()


def test_unsupported_vllm_version_is_refused_naming_it(monkeypatch):
    assert versions.check_vllm_version("0.32.0") == "0.32"
    assert versions.check_vllm_version("0.33.1rc1+cpu") == "0.33"
    with pytest.raises(ConfigError, match=r"vLLM 0\.31\.2 is not supported"):
        versions.check_vllm_version("0.31.2")
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.40.0")
    with pytest.raises(ConfigError, match=r"vLLM 0\.40\.0 is not supported \(tested: 0\.32, 0\.33\)"):
        KVEventsOffloadingSpec(offloading_config({"cpu_bytes_to_use": 1 << 20}))


def test_manager_speaks_vllms_types():
    spec = KVEventsOffloadingSpec(offloading_config({"cpu_bytes_to_use": 4 * 2 * PAGE}))
    m = spec.get_manager()
    assert isinstance(m, vbase.OffloadingManager)
    ctx = vbase.ReqContext(req_id="r")
    assert m.on_new_request(ctx).policy is vbase.OffloadPolicy.CHUNK_LEVEL
    assert m.lookup(K(1), ctx) is vbase.LookupResult.MISS
    out = m.prepare_store([K(1), K(2)], ctx)
    assert out.keys_to_store == [K(1), K(2)] and list(out.store_spec.block_ids) == [0, 1]
    assert type(out.store_spec).__name__ == "CPULoadStoreSpec"
    m.complete_store([K(1), K(2)], ctx)
    assert m.lookup(K(1), ctx) is vbase.LookupResult.HIT
    assert m.get_load_source(K(1), ctx) is CacheHitSource.HOST
    load = m.prepare_load([K(1)], ctx)
    assert list(load.block_ids) == list(out.store_spec.block_ids[:1])
    m.complete_load([K(1)], ctx)
    m.on_schedule_end(vbase.ScheduleEndContext(new_req_ids=("r",), preempted_req_ids=()))
    events = list(m.take_events())
    assert [(e.keys, e.medium, e.removed, e.locality, e.ownership) for e in events] == [
        ([K(1), K(2)], vbase.Medium.CPU, False, vbase.Locality.LOCAL, None)]
    from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics as CM

    usage = m.get_stats().reduce()
    assert usage[CM.CPU_CACHE_USAGE_PERC] == 0.0  # every transfer completed: nothing pinned
    m.prepare_store([K(3)], ctx)  # one of 4 blocks reserved by a store in flight
    usage = m.get_stats().reduce()
    assert usage[CM.CPU_CACHE_USAGE_PERC] == usage[CM.CPU_CACHE_WRITE_USAGE_PERC] == 0.25
    assert usage[CM.CPU_CACHE_READ_USAGE_PERC] == 0.0
    m.complete_store([K(3)], ctx)
    assert set(KVEventsOffloadingSpec.build_metric_definitions({})) >= {CM.CPU_CACHE_USAGE_PERC, CM.CPU_ALLOCATION_SIZE}
    m.on_request_finished(ctx)
    m.shutdown()


def _canonical(num_blocks: int, groups: int, device: str = "cpu"):
    tensors = [torch.zeros((num_blocks, PAGE), dtype=torch.int8, device=device) for _ in range(2)]
    refs = [[vbase.CanonicalKVCacheRef(tensor_idx=t, page_size_bytes=PAGE) for t in range(2)] for _ in range(groups)]
    return tensors, vbase.CanonicalKVCaches([vbase.CanonicalKVCacheTensor(t, PAGE) for t in tensors], refs)


def _finish(worker, job_id):
    worker.wait({job_id})
    done = []
    while not done:
        done = [r for r in worker.get_finished() if r.job_id == job_id]
    return done[0]


CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"))


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_worker_round_trip_and_the_manager_sees_the_same_bytes(blocks_per_chunk, device):
    """Device blocks -> our CPU tier -> other device blocks, through vLLM's specs, and the
    scheduler side's host view (what secondary tiers read) holds exactly those bytes. On CUDA
    the shared host buffer is registered in place: a pinned copy would fail the host view."""
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    from kvevents_vllm.host import open_block_io

    k = blocks_per_chunk
    # a secondary tier configured: the worker shares its host buffer with the scheduler side
    cfg = offloading_config({"kvevents": {"cpu_blocks": 4, "secondary_tiers": [{"type": "example"}]}},
                            blocks_per_chunk=k)
    worker_side, sched_side = KVEventsOffloadingSpec(cfg), KVEventsOffloadingSpec(cfg)
    tensors, caches = _canonical(16, 1, device)
    for t in tensors:
        t.copy_(torch.randint(-128, 127, t.shape, dtype=torch.int8))
    w = worker_side.get_worker(caches)
    try:
        # a request's logical blocks 1..3 (so the first chunk is entered mid-way when k = 2)
        dev = [5, 6, 7]
        chunks = [2, 3] if k == 2 else [2, 3, 1]
        gpu = vbase.GPULoadStoreSpec(dev, group_sizes=[3], block_indices=[1])
        assert w.submit_store(1, gpu, CPULoadStoreSpec(chunks))
        r = _finish(w, 1)
        assert r.success and r.transfer_size == 3 * 2 * PAGE
        assert w.regions.path.exists()
        io = open_block_io(cfg.engine_id, 1)
        # mapped by the scheduler side: the files are gone, so a killed engine leaks nothing
        assert not (w.regions.path.exists() or w.regions.layout_path.exists())
        rows = [c * k + j for c in chunks for j in range(k)][k - 1 if k == 2 else 0:][:3]
        for t_idx, t in enumerate(tensors):
            for d, row in zip(dev, rows):
                c, j = divmod(row, k)
                got = np.frombuffer(io.read_block(c), dtype=np.int8)
                off = t_idx * k * PAGE + j * PAGE
                assert (got[off:off + PAGE] == t[d].cpu().numpy()).all()
        back = vbase.GPULoadStoreSpec([10, 11, 12], group_sizes=[3], block_indices=[1])
        assert w.submit_load(2, CPULoadStoreSpec(chunks), back)
        assert _finish(w, 2).success
        for t in tensors:
            assert torch.equal(t[[10, 11, 12]], t[dev])
        # a spec that does not add up is refused (False), never a crash in vLLM's worker
        assert not w.submit_store(3, vbase.GPULoadStoreSpec([1, 2], group_sizes=[2], block_indices=[0]),
                                  CPULoadStoreSpec([0, 1, 2, 3]))
        assert w.jobs_rejected == 1
        del sched_side
    finally:
        w.shutdown()
    assert not (w.regions.path.exists() or w.regions.layout_path.exists())  # shutdown removes the shm files


def test_without_secondary_tiers_the_host_buffer_is_private(tmp_path, monkeypatch):
    from kvevents_vllm import host

    monkeypatch.setattr(host, "SHM_DIR", tmp_path)
    cfg = offloading_config({"kvevents": {"cpu_blocks": 4}})
    _, caches = _canonical(8, 1)
    w = KVEventsOffloadingSpec(cfg).get_worker(caches)
    try:
        assert list(tmp_path.iterdir()) == []  # nobody else reads it: no file to leak
        assert host.open_block_io(cfg.engine_id, 1) is None
    finally:
        w.shutdown()


def test_events_are_vllms_from_where_they_are_made():
    """The adapter gives our CPU manager and each tier a constructor of vLLM's event for its
    medium (no conversion per step); an event of ours that still arrives is converted, and one
    in a medium no tier declared is counted."""
    from kvevents_vllm.manager_adapter import KVEventsManagerAdapter
    from manager.base import NumpyBlockIO, OffloadingEvent, ReqContext
    from manager.cpu import CPUOffloadingManager
    from manager.tiering import ExampleSecondaryTierManager, TieringOffloadingManager

    tiering = TieringOffloadingManager(CPUOffloadingManager(4, "lru", True), [ExampleSecondaryTierManager()],
                                       block_io=NumpyBlockIO.allocate(4, 16))
    m = KVEventsManagerAdapter(tiering)
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    m.prepare_store([K(1)], ctx)
    m.complete_store([K(1)], ctx)  # the example tier stores it at once: a STORAGE event
    m.on_schedule_end(None)
    events = m.take_events()
    assert all(type(e) is vbase.OffloadingEvent for e in events)
    assert [(e.keys, e.medium, e.removed, e.locality, e.ownership) for e in events] == [
        ([K(1)], vbase.Medium.CPU, False, vbase.Locality.LOCAL, None),
        ([K(1)], vbase.Medium.STORAGE, False, vbase.Locality.LOCAL, "example")]
    tiering.primary._events.append(OffloadingEvent([K(2)], "ELSEWHERE", True))  # made without the factory
    [ev] = m.take_events()
    assert type(ev) is vbase.OffloadingEvent and (ev.medium, ev.ownership) == (vbase.Medium.STORAGE, "ELSEWHERE")
    assert m.stats()["adapter_unknown_media"] == 1
    assert CPUOffloadingManager(4).event_factory is OffloadingEvent  # without an adapter: ours


@pytest.mark.parametrize("source", ["scheduler table", "own method"])
def test_the_requests_token_positions_order_our_lru(source):
    """vLLM's ReqContext positions reach our LRU — those its scheduler records, or those a
    subclass answers its own way: a running request's tail goes first, and the context keeps
    one of ours for every call of the request."""
    if not hasattr(vbase.ReqContext, "get_offload_key_position"):
        pytest.skip("this vLLM's ReqContext has no token positions")
    where = {K(i): 16 * (i + 1) for i in range(4)}

    class Spaced(vbase.ReqContext):
        def get_offload_key_position(self, key):
            return where.get(key)

    if source == "own method":
        ctx = Spaced(req_id="a")
    else:
        ctx = vbase.ReqContext(req_id="a")
        for k, pos in where.items():
            ctx.set_offload_key_position(k, pos)
    spec = KVEventsOffloadingSpec(offloading_config({"cpu_bytes_to_use": 5 * 2 * PAGE}))
    m = spec.get_manager()
    m.prepare_store([K(2), K(3)], ctx)  # the tail offered first (a backfill)
    m.prepare_store([K(0), K(1)], ctx)
    m.complete_store([K(0), K(1), K(2), K(3)], ctx)
    out = m.prepare_store([K(10), K(11)], vbase.ReqContext(req_id="b"))
    assert out.evicted_keys == [K(3)]


def test_vllm_contexts_reach_our_manager_as_they_are():
    """No context of ours is made per vLLM request: our manager keeps its request record on
    vLLM's own object, its positions the very table vLLM's scheduler fills; a context of another
    shape (no positions, no per-request state) is recorded too, without positions."""
    from dataclasses import dataclass

    @dataclass
    class OldReqContext:
        req_id: str
        kv_transfer_params: dict | None = None

    m = KVEventsOffloadingSpec(offloading_config({"cpu_bytes_to_use": 5 * 2 * PAGE})).get_manager()
    ctx = vbase.ReqContext(req_id="a")
    m.on_new_request(ctx)
    rec = ctx.manager_state
    assert rec is not None and not hasattr(ctx, "_kvevents_context")
    if hasattr(ctx, "_offload_key_positions"):
        assert rec.positions is ctx._offload_key_positions
    m.prepare_store([K(0)], ctx)
    assert ctx.manager_state is rec and rec.keys == [K(0)]
    m.complete_store([K(0)], ctx)
    m.on_request_finished(ctx)
    assert ctx.manager_state is None
    old = OldReqContext("b", {"a": 1})
    m.prepare_store([K(1)], old)  # never announced: recorded on its first call
    assert old.manager_state.positions is None and old.manager_state.keys == [K(1)]
    m.complete_store([K(1)], old)
    m.on_request_finished(old)
    assert old.manager_state is None
    assert m.lookup(K(1), old) == vbase.LookupResult.HIT


def test_a_vllm_written_tier_gets_the_context_vllm_made():
    """Through the adapter a vLLM-written tier is handed vLLM's own request context (its
    positions, hints and state included), not a copy rebuilt from ours; driven by our own
    connector (a context of ours) it gets one made for the request, the same on every call."""
    from kvevents_vllm.vllm_tiers import VllmTier
    from manager.base import ReqContext

    class Seen:
        def __init__(self):
            self.contexts = []

        def lookup(self, key, req_context):
            self.contexts.append(req_context)
            return vbase.LookupResult.MISS

        def on_new_request(self, req_context):
            self.contexts.append(req_context)
            return vbase.RequestOffloadingContext()

        def on_request_finished(self, req_context):
            self.contexts.append(req_context)

    inner = Seen()
    tier = VllmTier("seen", tier=inner)
    vctx = vbase.ReqContext(req_id="a")
    tier.on_new_request(vctx)
    tier.lookup(K(0), vctx)
    tier.on_request_finished(vctx)
    assert all(c is vctx for c in inner.contexts) and len(inner.contexts) == 3
    inner.contexts.clear()
    ours = ReqContext("b", {"x": 1})
    tier.on_new_request(ours)
    tier.lookup(K(0), ours)
    tier.on_request_finished(ours)
    made = inner.contexts[0]
    assert type(made) is vbase.ReqContext and (made.req_id, made.kv_transfer_params) == ("b", {"x": 1})
    assert all(c is made for c in inner.contexts)
