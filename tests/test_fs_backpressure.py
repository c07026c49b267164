"""Store backpressure and asynchronous secondary-tier lookups, under the connector and the
simulated engine (issue 14): a tier that falls behind skips stores (counted, never claimed);
loads never wait behind stores; a pending lookup makes the connector ask again in a later
step, and the request's blocks are then found and loaded with the right bytes."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvevents import BlockStored, decode_batch, encode_batch
from kvevents.errors import ConfigError
from kvevents.publisher_base import EventPublisher, ShutdownReport
from manager import NumpyBlockIO, make_offload_key
from manager.cpu import CPUOffloadingManager
from manager.engine_sim import SimEngine
from manager.hashing import wire_hash
from manager.tiering import JobMetadata, JobResult, SecondaryTierFactory, TieringOffloadingManager
from manager.tiering.backpressure import BoundedBacklog, StorePolicy, create_store_policy, register_store_policy


class ListPublisher(EventPublisher):
    def __init__(self) -> None:
        super().__init__(data_parallel_rank=0)
        self.payloads: list[bytes] = []

    def publish(self, batch) -> None:  # type: ignore[no-untyped-def]
        self.payloads.append(encode_batch(batch))

    def shutdown(self, timeout: float = 1.0) -> ShutdownReport:
        return ShutdownReport()

    def stored(self, medium: str) -> set:
        return {h for p in self.payloads for ev in decode_batch(p).events
                if isinstance(ev, BlockStored) and ev.medium == medium for h in ev.block_hashes}


def engine(tier, pub=None, **kw) -> tuple[SimEngine, TieringOffloadingManager]:  # type: ignore[no-untyped-def]
    m = TieringOffloadingManager(CPUOffloadingManager(64, enable_events=True), [tier])
    e = SimEngine(m, pub, gpu_blocks=64, block_size=4, offload_block_size=8, use_torch=False,
                  sync_transfers=True, **kw)
    return e, m


DOC = list(range(100, 141))  # 41 tokens: 5 offloaded blocks of 8 tokens, and one to compute


def wait_until(cond, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        threading.Event().wait(0.002)


# --- policies ------------------------------------------------------------------------------


def test_policies() -> None:
    p = create_store_policy(None, max_backlog_blocks=8)
    assert isinstance(p, BoundedBacklog)
    assert p.admit(0, 100)  # an idle tier takes any job
    assert p.admit(4, 4) and not p.admit(5, 4)
    assert create_store_policy("unbounded").admit(10**9, 10**9)
    with pytest.raises(ConfigError, match="unknown store policy"):
        create_store_policy("nope")
    with pytest.raises(ConfigError, match="max_backlog_blocks"):
        create_store_policy("bounded", max_backlog_blocks=0)


class EveryOther(StorePolicy):
    def __init__(self) -> None:
        self.n = 0

    def admit(self, backlog_blocks: int, job_blocks: int) -> bool:
        self.n += 1
        return self.n % 2 == 1


register_store_policy("every_other_test", __name__, "EveryOther")


def test_a_plugged_policy_reaches_the_example_tier() -> None:
    ex = SecondaryTierFactory.create_secondary_tier({"type": "example", "store_policy": "every_other_test"})
    m = TieringOffloadingManager(CPUOffloadingManager(8, enable_events=True), [ex],
                                 block_io=NumpyBlockIO.allocate(8, 16))
    from manager import ReqContext

    ctx = ReqContext("a")
    for i in range(4):
        key = make_offload_key(bytes([i]) * 8)
        assert m.prepare_store([key], ctx) is not None
        m.complete_store([key], ctx)
    assert len(ex.cached_keys()) == 2 and ex.stores_skipped == 2 and ex.blocks_skipped == 2
    assert m.stats()["blocks_skipped"] == 2


# --- backpressure in the fs tier -------------------------------------------------------------


def test_loads_never_wait_behind_stores(tmp_path: Path) -> None:
    io = NumpyBlockIO.allocate(4, 4096)
    io.write_block(0, b"\x07" * 4096)
    t = SecondaryTierFactory.create_secondary_tier({"type": "fs", "root": str(tmp_path), "store_threads": 1},
                                                   block_io=io)
    k = make_offload_key(b"k" * 8)
    t.submit_store(JobMetadata(1, [k], np.array([0]), False))
    assert t.drain_jobs(10) and t.get_finished_jobs() == [JobResult(1, True)]
    gate = threading.Event()
    t._stores.submit(gate.wait)  # the disk "falls behind": the store pool is stuck
    t.submit_store(JobMetadata(2, [make_offload_key(b"x" * 8)], np.array([1]), False))
    assert t.store_backlog() == 1
    t.submit_load(JobMetadata(3, [k], np.array([2]), True))
    got: list[JobResult] = []
    wait_until(lambda: got.extend(t.get_finished_jobs()) or got)
    assert got == [JobResult(3, True)] and bytes(io.read_block(2)) == b"\x07" * 4096
    gate.set()
    assert t.drain_jobs(10) and t.get_finished_jobs() == [JobResult(2, True)] and t.store_backlog() == 0
    t.shutdown()


def test_a_tier_that_falls_behind_skips_stores_under_the_engine(tmp_path: Path) -> None:
    """The fs tier's store pool is stuck: the first store job is taken (an idle tier takes
    any job), the following ones are skipped — nothing pinned, written or announced — and the
    engine keeps stepping; once the tier catches up, what it announced is what it holds."""
    fs = SecondaryTierFactory.create_secondary_tier(
        {"type": "fs", "root": str(tmp_path), "store_threads": 1, "max_store_backlog_blocks": 4})
    gate = threading.Event()
    fs._stores.submit(gate.wait)  # type: ignore[attr-defined]
    pub = ListPublisher()
    e, m = engine(fs, pub, max_num_seqs=1)
    for i in range(4):
        e.add_request(f"r{i}", [1000 * i + j for j in range(41)], max_new_tokens=1)
    for _ in range(200):
        if e.requests_finished == 4:
            break
        e.step()
    assert e.requests_finished == 4  # the engine did not wait for the stuck tier
    assert fs.stores_skipped == 3 and fs.blocks_skipped == 15  # 5 blocks each
    assert fs.store_backlog() == 5 and m.stats()["blocks_skipped"] == 15
    assert pub.stored("STORAGE") == set()  # nothing claimed while nothing is written
    gate.set()
    e.run_until_idle(max_steps=500)
    held = fs.cached_keys()
    assert len(held) == 5 and fs.store_backlog() == 0
    assert pub.stored("STORAGE") == {wire_hash(k[:-4], True) for k in held}
    assert e.store_failures == 0 and not m.has_pending_work()
    e.shutdown()
    fs.shutdown()


# --- asynchronous lookup -----------------------------------------------------------------------


def _fill_root(root: Path) -> None:
    """An engine that computes DOC once and leaves its blocks in the fs tier at ``root``."""
    fs = SecondaryTierFactory.create_secondary_tier({"type": "fs", "root": str(root)})
    e, _ = engine(fs)
    e.add_request("writer", DOC, max_new_tokens=1)
    e.run_until_idle(max_steps=500)
    assert len(fs.cached_keys()) == 5
    e.shutdown()
    fs.shutdown()


def test_async_lookup_finds_blocks_written_by_another_engine_on_a_later_step(tmp_path: Path) -> None:
    shared = SecondaryTierFactory.create_secondary_tier({"type": "fs", "root": str(tmp_path), "shared_root": True})
    private = SecondaryTierFactory.create_secondary_tier({"type": "fs", "root": str(tmp_path)})
    _fill_root(tmp_path)  # after both started: neither found the blocks at start-up
    assert shared.cached_keys() == set() and private.cached_keys() == set()
    pub = ListPublisher()
    e, m = engine(shared, pub)
    e.add_request("reader", DOC, max_new_tokens=1)
    first = e.step()
    assert first.offload_hit_tokens == 0 and e.connector.lookup_retries >= 1  # pending: asked again later
    assert shared.lookups_pending >= 1 and m.stats()["lookups_pending"] >= 1
    steps = [first] + e.run_until_idle(max_steps=500)
    hit_step = next(s.step for s in steps if s.offload_hit_tokens)
    assert hit_step > first.step
    assert e.offload_hit_tokens == 40 and e.load_verify_failures == 0 and e.requests_finished == 1
    assert shared.lookups_found_on_disk == 5 and len(pub.stored("STORAGE")) == 5
    e.shutdown()
    shared.shutdown()
    # a private root's tier answers from memory only: the other engine's blocks are a miss
    e2, _ = engine(private)
    e2.add_request("reader", DOC, max_new_tokens=1)
    e2.run_until_idle(max_steps=500)
    assert e2.offload_hit_tokens == 0 and private.lookups_pending == 0
    e2.shutdown()
    private.shutdown()


def test_example_tier_with_delayed_lookups() -> None:
    ex = SecondaryTierFactory.create_secondary_tier({"type": "example", "lookup_delay_steps": 2})
    e, m = engine(ex)
    e.add_request("a", DOC, max_new_tokens=1)
    e.run_until_idle(max_steps=500)
    assert len(ex.cached_keys()) == 5
    m.primary.reset_cache()  # only the tier holds the blocks now
    e.gpu = type(e.gpu)(64, 4)  # and the GPU forgets them
    e.add_request("b", DOC, max_new_tokens=1)
    steps = e.run_until_idle(max_steps=500)
    assert ex.lookups_pending > 0 and e.connector.lookup_retries >= 2
    assert e.offload_hit_tokens == 40 and e.load_verify_failures == 0
    assert next(s.step for s in steps if s.offload_hit_tokens) >= steps[0].step + 2
    e.shutdown()
