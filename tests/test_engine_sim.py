"""The simulated engine: hashing, the GPU prefix cache, and an end-to-end run whose published
GPU and offload events decode and agree with each other and with the caches."""

from __future__ import annotations

import random
import subprocess
import sys
import threading

import pytest

from kvevents import BlockRemoved, BlockStored, decode_batch, encode_batch
from kvevents.publisher_base import EventPublisher, ShutdownReport
from manager.base import split_offload_key
from manager.cpu import CPUOffloadingManager
from manager.engine_sim import SimEngine
from manager.hashing import hash_block, hash_request_blocks, wire_hash
from manager.prefix_cache import GPUPrefixCache, OutOfBlocksError


class ListPublisher(EventPublisher):
    """Captures every batch as wire bytes."""

    def __init__(self) -> None:
        super().__init__(data_parallel_rank=0)
        self.payloads: list[bytes] = []

    def publish(self, batch) -> None:
        self.payloads.append(encode_batch(batch))

    def shutdown(self, timeout: float = 1.0) -> ShutdownReport:
        return ShutdownReport()


# --- hashing ----------------------------------------------------------------------------------


def test_hashes_chain_and_go_on_the_wire_as_vllm_sends_them():
    toks = list(range(12))
    hs = hash_request_blocks(toks, 4)
    assert len(hs) == 3 and all(len(h) == 32 for h in hs)
    assert hs[1] == hash_block(hs[0], toks[4:8])
    assert hash_request_blocks(toks, 4, start=2, parent=hs[1]) == hs[2:]
    assert hash_request_blocks(toks, 4, "lora-a")[0] != hs[0]  # LoRA is part of the key
    assert hash_request_blocks([9] + toks[1:], 4)[2] != hs[2]  # a block's hash names its prefix
    assert hash_request_blocks(toks[:11], 4) == hs[:2]  # only full blocks
    assert wire_hash(hs[0]) == int.from_bytes(hs[0][-8:], "big") and wire_hash(hs[0]) < 1 << 64
    assert wire_hash(hs[0], int_hashes=False) == hs[0]


# --- the GPU prefix cache ---------------------------------------------------------------------


def _hashes(n, seed=0):
    return hash_request_blocks([seed * 100 + i for i in range(4 * n)], 4)


def test_prefix_cache_emits_stored_with_tokens_and_reuses_blocks_lru():
    c = GPUPrefixCache(4, 4)
    hs = _hashes(2)
    ids = c.allocate([], 2)
    c.cache_blocks(ids, hs, list(range(8)), None, lora_id=None, lora_name=None)
    [ev] = c.take_events()
    assert ev == BlockStored(
        block_hashes=[wire_hash(h) for h in hs],
        parent_block_hash=None,
        token_ids=list(range(8)),
        block_size=4,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    c.free(ids)
    assert c.find_prefix(hs) == ids  # still cached while free
    other = _hashes(2, seed=1)
    ids2 = c.allocate([], 2)  # the never-used blocks go first
    assert set(ids2).isdisjoint(ids) and c.take_events() == []
    c.free(ids2)
    # freed tail first: the request's last block is evicted before its first
    new = c.allocate([], 1)
    assert new == [ids[1]]
    assert c.take_events() == [BlockRemoved(block_hashes=[wire_hash(hs[1])], medium="GPU")]
    assert c.find_prefix(hs) == [ids[0]]
    assert other  # (hashes of the second request were never cached)


def test_prefix_cache_hits_pin_blocks_and_allocation_is_all_or_nothing():
    c = GPUPrefixCache(3, 4)
    hs = _hashes(2)
    ids = c.allocate([], 2)
    c.cache_blocks(ids, hs, list(range(8)), None)
    c.free(ids)
    hits = c.find_prefix(hs, max_blocks=1)
    assert hits == [ids[0]]
    with pytest.raises(OutOfBlocksError):
        c.allocate(hits, 3)
    assert c.num_free == 3 and c.ref_count(ids[0]) == 0  # unchanged
    got = c.allocate(hits, 2)
    assert got[0] == ids[0] and c.ref_count(ids[0]) == 1
    with pytest.raises(ValueError, match="freed more often"):
        c.free([ids[0]] * 2)


def test_prefix_cache_parent_and_duplicates():
    c = GPUPrefixCache(8, 4)
    hs = _hashes(3)
    a = c.allocate([], 3)
    c.cache_blocks(a[:1], hs[:1], list(range(4)), None)
    c.cache_blocks(a[1:], hs[1:], list(range(4, 12)), hs[0])
    evs = c.take_events()
    assert evs[1].parent_block_hash == wire_hash(hs[0]) and evs[1].token_ids == list(range(4, 12))
    b = c.allocate([], 3)  # another request computed the same blocks concurrently
    assert c.cache_blocks(b, hs, list(range(12)), None) == 0
    assert c.duplicate_blocks == 3 and c.take_events() == []
    c.free(b)
    c.free(a)
    c.reset()
    assert c.cached_hashes() == set()
    [ev] = c.take_events()
    assert isinstance(ev, BlockRemoved) and sorted(ev.block_hashes) == sorted(wire_hash(h) for h in hs)


# --- the engine, end to end ---------------------------------------------------------------------


def _workload(engine: SimEngine, n=40, seed=1):
    rnd = random.Random(seed)
    docs = [[rnd.randrange(1000) for _ in range(32)] for _ in range(6)]
    for i in range(n):
        doc = docs[rnd.randrange(len(docs))]
        tail = [rnd.randrange(1000) for _ in range(rnd.randrange(1, 12))]
        engine.add_request(f"r{i}", doc + tail, max_new_tokens=rnd.randrange(1, 10))


def _check_stream(payloads, engine: SimEngine, manager: CPUOffloadingManager, bs: int):
    gpu_ever: set[int] = set()
    gpu_now: set[int] = set()
    cpu_now: set[int] = set()
    offload_stored = 0
    for payload in payloads:
        batch = decode_batch(payload)
        assert batch.data_parallel_rank == 0 and batch.events
        for ev in batch.events:
            if ev.medium == "GPU":
                if isinstance(ev, BlockStored):
                    assert ev.block_size == bs and len(ev.token_ids) == bs * len(ev.block_hashes)
                    assert ev.parent_block_hash is None or ev.parent_block_hash in gpu_ever
                    gpu_ever.update(ev.block_hashes)
                    gpu_now.update(ev.block_hashes)
                else:
                    assert set(ev.block_hashes) <= gpu_now
                    gpu_now.difference_update(ev.block_hashes)
            else:
                assert ev.medium == "CPU" and ev.group_idx == 0
                if isinstance(ev, BlockStored):
                    assert ev.block_size == 0 and ev.token_ids == [] and ev.parent_block_hash is None
                    # every offloaded block is one the engine's GPU events stored (the join key)
                    assert set(ev.block_hashes) <= gpu_ever
                    cpu_now.update(ev.block_hashes)
                    offload_stored += len(ev.block_hashes)
                else:
                    assert set(ev.block_hashes) <= cpu_now
                    cpu_now.difference_update(ev.block_hashes)
    # the mirrors built from the stream are exactly the caches
    assert gpu_now == {wire_hash(h) for h in engine.gpu.cached_hashes()}
    assert cpu_now == {wire_hash(split_offload_key(k)[0]) for k in manager.cached_keys()}
    return offload_stored


@pytest.mark.parametrize("use_torch", [False, True])
@pytest.mark.parametrize("sync", [True, False])
def test_shared_prefix_workload_publishes_consistent_gpu_and_offload_events(use_torch, sync):
    if use_torch:
        pytest.importorskip("torch")
    pub = ListPublisher()
    m = CPUOffloadingManager(64, enable_events=True)
    e = SimEngine(
        m, pub, gpu_blocks=24, block_size=4, offload_block_size=8, use_torch=use_torch,
        sync_transfers=sync, max_num_seqs=3,
    )
    try:
        _workload(e)
        steps = e.run_until_idle(max_steps=5000)
        assert e.backend == ("torch-cpu" if use_torch else "numpy")
        assert e.requests_finished == 40 and not e.has_work()
        assert e.connector.tracked_requests() == set() and e.connector.pending_jobs() == set()
        assert e.connector.requests_released == 40
        # one batch per step that had events, never more
        assert e.batches_published == len(pub.payloads) == sum(s.published for s in steps)
        assert e.events_published == sum(s.gpu_events + s.offload_events for s in steps)
        # every loaded block held what was stored
        assert e.load_verify_failures == 0 and e.load_failures == 0 and e.store_failures == 0
        assert e.connector.store_jobs > 0 and e.gpu.evictions > 0
        if sync:  # deterministic schedule: the tier is used both ways, and preemption happens
            assert e.offload_hit_tokens > 0 and e.connector.load_jobs > 0 and e.preemptions > 0
        assert _check_stream(pub.payloads, e, m, 4) > 0
        assert m.stats()["stores_completed"] == e.connector.blocks_stored
    finally:
        e.shutdown()


def test_every_pending_job_is_flushed_at_the_end_and_released():
    pub = ListPublisher()
    m = CPUOffloadingManager(16, enable_events=True)
    e = SimEngine(m, pub, gpu_blocks=16, block_size=4, offload_block_size=4, use_torch=False)
    gate = threading.Event()
    copy = e.worker._copy
    e.worker._copy = lambda job: (gate.wait(30), copy(job))
    e.add_request("only", list(range(17)), max_new_tokens=1)
    st = e.step()  # prefill; the store job is in flight when the request finishes
    assert st.finished == 1 and st.store_jobs == 1 and st.jobs_flushed == 0
    assert e.connector.tracked_requests() == {"only"}  # kept: its store still reads GPU blocks
    assert e.gpu.num_free == 16 - 5  # the free is deferred
    gate.set()
    st = e.step()  # the last request is gone: every pending job is flushed
    assert st.jobs_flushed == 1
    assert e.connector.tracked_requests() == set() and not e.has_work()
    assert e.gpu.num_free == 16
    assert len(m.cached_keys()) == 4
    _check_stream(pub.payloads, e, m, 4)
    e.shutdown()


def test_with_a_secondary_tier_promotions_load_the_right_bytes():
    from manager.tiering import SecondaryTierFactory, TieringOffloadingManager

    pub = ListPublisher()
    primary = CPUOffloadingManager(16, enable_events=True)
    m = TieringOffloadingManager(primary, [SecondaryTierFactory.create_secondary_tier({"type": "example"})])
    e = SimEngine(m, pub, gpu_blocks=24, block_size=4, offload_block_size=8, use_torch=False,
                  sync_transfers=True, max_num_seqs=3)
    rnd = random.Random(1)
    docs = [[rnd.randrange(1000) for _ in range(32)] for _ in range(8)]
    for i in range(40):
        e.add_request(f"r{i}", docs[rnd.randrange(8)] + [rnd.randrange(1000) for _ in range(5)], max_new_tokens=3)
    e.run_until_idle(max_steps=2000)
    e.shutdown()
    assert e.requests_finished == 40 and e.connector.tracked_requests() == set()
    assert m.promotions_started > 0 and e.offload_hit_tokens > 0
    assert e.load_verify_failures == 0  # promoted blocks carried the bytes that were stored
    gpu_ever, media = set(), set()
    for p in pub.payloads:
        for ev in decode_batch(p).events:
            media.add(ev.medium)
            if isinstance(ev, BlockStored):
                if ev.medium == "GPU":
                    gpu_ever.update(ev.block_hashes)
                else:
                    assert set(ev.block_hashes) <= gpu_ever and ev.block_size == 0
    assert media == {"GPU", "CPU", "STORAGE"}


def test_lora_requests_carry_their_adapter_in_gpu_events():
    pub = ListPublisher()
    m = CPUOffloadingManager(16, enable_events=True)
    e = SimEngine(m, pub, gpu_blocks=16, block_size=4, use_torch=False, sync_transfers=True)
    e.add_request("base", list(range(8)))
    e.add_request("adapted", list(range(8)), lora_name="sql")
    e.run_until_idle()
    stored = [ev for p in pub.payloads for ev in decode_batch(p).events if isinstance(ev, BlockStored) and ev.medium == "GPU"]
    by_lora = {ev.lora_name: ev for ev in stored}
    assert by_lora["sql"].lora_id == 1 and by_lora[None].lora_id is None
    assert set(by_lora["sql"].block_hashes).isdisjoint(by_lora[None].block_hashes)


def test_add_request_errors():
    e = SimEngine(CPUOffloadingManager(4), None, gpu_blocks=4, block_size=4, use_torch=False)
    e.add_request("a", [1, 2, 3])
    with pytest.raises(ValueError, match="already exists"):
        e.add_request("a", [1])
    with pytest.raises(ValueError, match="needs 5 GPU blocks"):
        e.add_request("big", list(range(17)))
    with pytest.raises(ValueError, match="no tokens"):
        e.add_request("empty", [])
    with pytest.raises(ValueError, match="num_blocks"):
        SimEngine(object.__new__(_NoSize), None)  # type: ignore[arg-type]
    e.shutdown()


class _NoSize(CPUOffloadingManager):
    num_blocks = 0


def test_the_engine_runs_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from manager.cpu import CPUOffloadingManager\n"
        "from manager.engine_sim import SimEngine\n"
        "from kvevents.publisher_base import NullEventPublisher\n"
        "pub = NullEventPublisher()\n"
        "e = SimEngine(CPUOffloadingManager(32, enable_events=True), pub, gpu_blocks=8, block_size=4)\n"
        "for i in range(6): e.add_request(f'r{i}', [i % 2] * 20 + [i], max_new_tokens=2)\n"
        "e.run_until_idle(); e.shutdown()\n"
        "print(e.backend, e.requests_finished, e.offload_hit_tokens > 0, pub.batches > 0, e.load_verify_failures)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["numpy", "6", "True", "True", "0"]
