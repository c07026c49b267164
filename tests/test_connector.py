"""The scheduler-side connector: lookups, load/store jobs, policies, flushing, the request
lifecycle and the conversion of OffloadingEvents into wire events."""

from __future__ import annotations

import numpy as np
import pytest

from kvevents import BlockRemoved, BlockStored, KVEventBatch, decode_batch, encode_batch
from manager.base import (
    LookupResult,
    OffloadingEvent,
    OffloadPolicy,
    RequestOffloadingContext,
    make_offload_key,
)
from manager.connector import (
    CachedRequestData,
    ConnectorError,
    EngineRequest,
    NewRequestData,
    OffloadingConnectorScheduler,
    SchedulerOutput,
    offload_events_to_kv_events,
)
from manager.cpu import CPUOffloadingManager
from manager.hashing import hash_request_blocks

GBS = 4  # GPU block size (tokens)
OBS = 8  # offloaded block size: 2 GPU blocks per chunk


class RecordingManager(CPUOffloadingManager):
    """A CPU manager that logs every call (and can be told which policy to ask for)."""

    def __init__(self, num_blocks=32, policy=OffloadPolicy.BLOCK_LEVEL, **kw):
        super().__init__(num_blocks, enable_events=True, **kw)
        self.want = policy
        self.calls: list[tuple] = []
        self.connector: OffloadingConnectorScheduler | None = None
        self.tracked_at_finish: list[bool] = []
        self.retry_keys: set[bytes] = set()

    def on_new_request(self, ctx):
        self.calls.append(("on_new_request", ctx.req_id, id(ctx)))
        return RequestOffloadingContext(self.want)

    def lookup(self, key, ctx=None):
        self.calls.append(("lookup", getattr(ctx, "req_id", None), id(ctx)))
        if key in self.retry_keys:
            return LookupResult.RETRY
        return super().lookup(key, ctx)

    def prepare_load(self, keys, ctx=None):
        self.calls.append(("prepare_load", getattr(ctx, "req_id", None), list(keys)))
        return super().prepare_load(keys, ctx)

    def complete_load(self, keys, ctx=None):
        self.calls.append(("complete_load", getattr(ctx, "req_id", None), list(keys)))
        return super().complete_load(keys, ctx)

    def prepare_store(self, keys, ctx=None):
        self.calls.append(("prepare_store", getattr(ctx, "req_id", None), list(keys)))
        return super().prepare_store(keys, ctx)

    def complete_store(self, keys, ctx=None, success=True):
        self.calls.append(("complete_store", getattr(ctx, "req_id", None), list(keys), success))
        return super().complete_store(keys, ctx, success)

    def on_request_finished(self, ctx):
        self.calls.append(("on_request_finished", ctx.req_id))
        if self.connector is not None:
            self.tracked_at_finish.append(ctx.req_id in self.connector.tracked_requests())

    def on_schedule_end(self):
        self.calls.append(("on_schedule_end",))

    def names(self):
        return [c[0] for c in self.calls]


def make(policy=OffloadPolicy.BLOCK_LEVEL, num_blocks=32):
    m = RecordingManager(num_blocks, policy)
    c = OffloadingConnectorScheduler(m, GBS, OBS)
    m.connector = c
    return m, c


def request(req_id, n_tokens, seed=0):
    toks = [(seed * 1000 + i) % 997 for i in range(n_tokens)]
    return EngineRequest(req_id, hash_request_blocks(toks, GBS), n_tokens)


def schedule_new(c, req, block_ids, computed, n, **extra):
    so = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData(req, block_ids, computed)], num_scheduled_tokens={req.req_id: n}, **extra
    )
    return c.build_connector_meta(so)


def finish_jobs(c, meta):
    return c.update_connector_output([j.job_id for j in meta.load_jobs + meta.store_jobs])


def offload_all(c, m, req, block_ids):
    """Run ``req`` through one step so every full chunk is stored, and complete the stores."""
    c.get_num_new_matched_tokens(req, 0)
    c.update_state_after_alloc(req, block_ids, 0)
    meta = schedule_new(c, req, block_ids, 0, req.num_tokens)
    finish_jobs(c, meta)
    assert c.request_finished(req.req_id) is False  # released at once: no job left
    return meta


# --- construction ---------------------------------------------------------------------------


def test_offloaded_block_must_be_a_whole_multiple():
    with pytest.raises(ConnectorError, match="not a whole multiple"):
        OffloadingConnectorScheduler(RecordingManager(), 16, 24)
    with pytest.raises(ConnectorError):
        OffloadingConnectorScheduler(RecordingManager(), 0, 16)


def test_chunk_key_is_the_hash_of_its_last_gpu_block():
    m, c = make()
    req = request("a", 33)
    assert c.blocks_per_chunk == 2
    assert c.chunk_key(req, 0) == make_offload_key(req.block_hashes[1], 0)
    assert c.chunk_key(req, 3) == make_offload_key(req.block_hashes[7], 0)


# --- on_new_request -------------------------------------------------------------------------


def test_on_new_request_builds_the_context_once_and_keeps_the_policy():
    m, c = make(OffloadPolicy.REQUEST_LEVEL)
    req = request("r", 20)
    assert c.on_new_request(req) is OffloadPolicy.REQUEST_LEVEL
    c.get_num_new_matched_tokens(req, 0)
    c.get_num_new_matched_tokens(req, 0)
    c.on_new_request(req)
    c.update_state_after_alloc(req, list(range(5)), 0)
    news = [x for x in m.calls if x[0] == "on_new_request"]
    assert len(news) == 1
    ctx_ids = {x[2] for x in m.calls if x[0] in ("on_new_request", "lookup")}
    assert len(ctx_ids) == 1  # the same ReqContext object every time
    m.want = OffloadPolicy.BLOCK_LEVEL  # asking again would change it: the kept one rules
    assert c.policy_of("r") is OffloadPolicy.REQUEST_LEVEL


# --- lookups and loads ----------------------------------------------------------------------


def test_matched_tokens_count_consecutive_hits_and_leave_one_token():
    m, c = make()
    src = request("src", 40)  # 5 chunks of 8 tokens
    offload_all(c, m, src, list(range(10)))
    assert len(m.cached_keys()) == 5
    # same prefix, longer: all 5 chunks hit
    long = EngineRequest("long", src.block_hashes + hash_request_blocks(list(range(48)), GBS)[10:], 48)
    assert c.get_num_new_matched_tokens(long, 0) == (40, True)
    # a request exactly as long as its hit: the last chunk is left to compute
    same = EngineRequest("same", list(src.block_hashes), 40)
    assert c.get_num_new_matched_tokens(same, 0) == (32, True)
    # GPU already holds 12 tokens (mid-chunk): the hit counts from there
    assert c.get_num_new_matched_tokens(long, 12) == (28, True)
    # GPU holds more than the hit: nothing to load
    other = request("other", 40, seed=5)
    assert c.get_num_new_matched_tokens(other, 0) == (0, False)


def test_a_miss_stops_the_hit_and_retry_asks_again_later():
    m, c = make()
    src = request("src", 40)
    offload_all(c, m, src, list(range(10)))
    m.reset_cache()
    # chunks 0 and 2 present, 1 missing
    for chunk in (0, 2):
        out = m.prepare_store([c.chunk_key(src, chunk)], None)
        m.complete_store(out.keys_to_store, None)
    req = EngineRequest("q", list(src.block_hashes), 41)
    assert c.get_num_new_matched_tokens(req, 0) == (8, True)
    m.retry_keys.add(c.chunk_key(src, 0))
    assert c.get_num_new_matched_tokens(req, 0) == (None, False)
    assert c.lookup_retries == 1


def test_a_retry_does_not_stop_the_scan_so_every_promotion_starts_at_once():
    m, c = make()
    src = request("src", 40)
    offload_all(c, m, src, list(range(10)))
    m.retry_keys.update({c.chunk_key(src, 0), c.chunk_key(src, 2)})
    req = EngineRequest("q", list(src.block_hashes), 41)
    m.calls.clear()
    assert c.get_num_new_matched_tokens(req, 0) == (None, False)
    assert m.names().count("lookup") == 5  # past both RETRYs, to the end of the prefix
    m.retry_keys.clear()
    assert c.get_num_new_matched_tokens(req, 0) == (40, True)


def test_update_state_after_alloc_prepares_a_load_job_and_completion_unpins():
    m, c = make()
    src = request("src", 40)
    offload_all(c, m, src, list(range(10)))
    req = EngineRequest("q", list(src.block_hashes), 44)
    ext, is_async = c.get_num_new_matched_tokens(req, 4)  # GPU holds block 0 only
    assert (ext, is_async) == (36, True)
    gpu_ids = [50 + i for i in range(11)]
    c.update_state_after_alloc(req, gpu_ids, ext)
    keys = [c.chunk_key(src, i) for i in range(5)]
    assert all(m.ref_count(k) == 1 for k in keys)  # pinned until complete_load
    meta = c.build_connector_meta(SchedulerOutput())
    [job] = meta.load_jobs
    assert job.kind == "load" and job.req_id == "q" and job.keys == keys
    cpu_ids = [m.block_id(k) for k in keys]
    rows = [r for b in cpu_ids for r in (2 * b, 2 * b + 1)][1:]  # skip the GPU-held half of chunk 0
    assert job.src_block_ids.tolist() == rows
    assert job.dst_block_ids.tolist() == gpu_ids[1:10]
    assert job.src_block_ids.dtype == np.int64
    upd = c.update_connector_output([job.job_id])
    assert upd.loaded == {"q"}
    assert all(m.ref_count(k) == 0 for k in keys)
    assert ("complete_load", "q", keys) in m.calls


def test_external_tokens_must_match_the_hit():
    m, c = make()
    src = request("src", 40)
    offload_all(c, m, src, list(range(10)))
    req = EngineRequest("q", list(src.block_hashes), 44)
    c.get_num_new_matched_tokens(req, 0)
    with pytest.raises(ConnectorError, match="do not end on an offloaded block"):
        c.update_state_after_alloc(req, list(range(11)), 5)
    fresh = request("fresh", 20, seed=9)
    with pytest.raises(ConnectorError, match="found no hit"):
        c.update_state_after_alloc(fresh, list(range(5)), 8)


# --- stores and policies ----------------------------------------------------------------------


def _hit_then_run(policy):
    """Chunks 0,1 offloaded; a new request hits them and computes chunks 2,3."""
    m, c = make(policy)
    src = request("src", 16)
    offload_all(c, m, src, [0, 1, 2, 3])
    long_hashes = request("src", 33).block_hashes  # same tokens, longer
    req = EngineRequest("q", long_hashes, 33)
    ext, _ = c.get_num_new_matched_tokens(req, 0)
    assert ext == 16
    ids = list(range(10, 19))
    c.update_state_after_alloc(req, ids, ext)
    m.calls.clear()
    meta = c.build_connector_meta(SchedulerOutput())  # the load
    finish_jobs(c, meta)
    meta = c.build_connector_meta(
        SchedulerOutput(
            scheduled_cached_reqs=[CachedRequestData("q", [], 16)], num_scheduled_tokens={"q": 17}
        )
    )
    stores = [x for x in m.calls if x[0] == "prepare_store"]
    return m, c, req, meta, stores


def test_block_level_does_not_store_its_hit_prefix_again():
    m, c, req, meta, stores = _hit_then_run(OffloadPolicy.BLOCK_LEVEL)
    assert stores == [("prepare_store", "q", [c.chunk_key(req, 2), c.chunk_key(req, 3)])]
    [job] = meta.store_jobs
    assert job.src_block_ids.tolist() == [14, 15, 16, 17]  # GPU blocks of chunks 2 and 3


def test_request_level_stores_every_block():
    m, c, req, meta, stores = _hit_then_run(OffloadPolicy.REQUEST_LEVEL)
    assert stores == [("prepare_store", "q", [c.chunk_key(req, i) for i in range(4)])]
    [job] = meta.store_jobs  # the primary already holds chunks 0,1: only 2,3 are written
    assert job.keys == [c.chunk_key(req, 2), c.chunk_key(req, 3)]


def test_block_level_skips_a_gpu_prefix_hit_request_level_offers_it():
    for policy, first in ((OffloadPolicy.BLOCK_LEVEL, 1), (OffloadPolicy.REQUEST_LEVEL, 0)):
        m, c = make(policy)
        req = request("g", 33)
        c.get_num_new_matched_tokens(req, 8)  # GPU prefix cache holds chunk 0
        c.update_state_after_alloc(req, list(range(9)), 0)
        meta = schedule_new(c, req, list(range(9)), 8, 25)
        [job] = meta.store_jobs
        assert job.keys == [c.chunk_key(req, i) for i in range(first, 4)]
        assert job.src_block_ids.tolist() == list(range(2 * first, 8))
        cpu_ids = [m.block_id(k) for k in job.keys]
        assert job.dst_block_ids.tolist() == [r for b in cpu_ids for r in (2 * b, 2 * b + 1)]


def test_stores_follow_computed_tokens_and_completion_emits_events():
    m, c = make()
    req = request("s", 30)
    c.get_num_new_matched_tokens(req, 0)
    c.update_state_after_alloc(req, list(range(8)), 0)
    meta = schedule_new(c, req, list(range(8)), 0, 12)  # chunk 0 complete, chunk 1 half
    [job] = meta.store_jobs
    assert job.keys == [c.chunk_key(req, 0)]
    keys = job.keys
    assert m.ref_count(keys[0]) == -1  # being written
    assert c.take_events() == []  # nothing stored yet
    c.update_connector_output([job.job_id])
    evs = c.take_events()
    assert [type(e) for e in evs] == [BlockStored] and evs[0].medium == "CPU"
    meta = c.build_connector_meta(
        SchedulerOutput(scheduled_cached_reqs=[CachedRequestData("s", [], 12)], num_scheduled_tokens={"s": 18})
    )
    [job] = meta.store_jobs
    assert job.keys == [c.chunk_key(req, 1), c.chunk_key(req, 2)]  # 30 tokens: 3 full chunks


def test_a_rejected_store_is_retried_on_the_next_step():
    m, c = make(num_blocks=2)
    busy = request("busy", 16, seed=3)
    c.get_num_new_matched_tokens(busy, 0)
    c.update_state_after_alloc(busy, [0, 1, 2, 3], 0)
    busy_meta = schedule_new(c, busy, [0, 1, 2, 3], 0, 16)  # fills both CPU blocks, in flight
    req = request("r", 9)
    c.get_num_new_matched_tokens(req, 0)
    c.update_state_after_alloc(req, [4, 5, 6], 0)
    meta = schedule_new(c, req, [4, 5, 6], 0, 9)
    assert meta.store_jobs == [] and c.store_rejections == 1
    finish_jobs(c, busy_meta)
    meta = c.build_connector_meta(
        SchedulerOutput(scheduled_cached_reqs=[CachedRequestData("r", [], 9)], num_scheduled_tokens={"r": 1})
    )
    assert [j.keys for j in meta.store_jobs] == [[c.chunk_key(req, 0)]]


# --- build_connector_meta: flushing and the step's end -----------------------------------------


def test_on_schedule_end_is_the_very_last_call_of_every_build():
    m, c = make()
    req = request("e", 20)
    c.get_num_new_matched_tokens(req, 0)
    c.update_state_after_alloc(req, list(range(5)), 0)
    for so in (
        SchedulerOutput(scheduled_new_reqs=[NewRequestData(req, list(range(5)), 0)], num_scheduled_tokens={"e": 20}),
        SchedulerOutput(finished_req_ids={"e"}),
        SchedulerOutput(),
    ):
        m.calls.clear()
        c.build_connector_meta(so)
        assert m.names()[-1] == "on_schedule_end"
        assert m.names().count("on_schedule_end") == 1


def test_preempted_requests_store_jobs_are_flushed():
    m, c = make()
    a, b = request("a", 16, seed=1), request("b", 16, seed=2)
    for r, ids in ((a, [0, 1, 2, 3]), (b, [4, 5, 6, 7])):
        c.get_num_new_matched_tokens(r, 0)
        c.update_state_after_alloc(r, ids, 0)
    so = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData(a, [0, 1, 2, 3], 0), NewRequestData(b, [4, 5, 6, 7], 0)],
        num_scheduled_tokens={"a": 16, "b": 16},
    )
    meta = c.build_connector_meta(so)
    job_a = next(j.job_id for j in meta.store_jobs if j.req_id == "a")
    job_b = next(j.job_id for j in meta.store_jobs if j.req_id == "b")
    assert meta.jobs_to_flush == set()
    meta2 = c.build_connector_meta(
        SchedulerOutput(
            scheduled_cached_reqs=[CachedRequestData("b", [], 16)],
            num_scheduled_tokens={"b": 1},
            preempted_req_ids={"a"},
        )
    )
    assert meta2.jobs_to_flush == {job_a}
    assert job_b not in meta2.jobs_to_flush


@pytest.mark.parametrize("direction", ["load", "store"])
def test_every_pending_job_is_flushed_once_no_request_remains(direction):
    m, c = make()
    src = request("src", 40)
    offload_all(c, m, src, list(range(10)))
    # one request with a pending load, one with a pending store
    loader = EngineRequest("loader", list(src.block_hashes), 41)
    ext, _ = c.get_num_new_matched_tokens(loader, 0)
    c.update_state_after_alloc(loader, list(range(11)), ext)
    storer = request("storer", 16, seed=7)
    c.get_num_new_matched_tokens(storer, 0)
    c.update_state_after_alloc(storer, [20, 21, 22, 23], 0)
    meta = schedule_new(c, storer, [20, 21, 22, 23], 0, 16)
    load_id, store_id = meta.load_jobs[0].job_id, meta.store_jobs[0].job_id
    assert meta.jobs_to_flush == set()
    # one finishes: the other still runs, nothing is flushed
    first, second = ("loader", "storer") if direction == "load" else ("storer", "loader")
    meta = c.build_connector_meta(SchedulerOutput(finished_req_ids={first}))
    assert meta.jobs_to_flush == set()
    # the last one finishes: no further step will come, so every pending job is flushed
    meta = c.build_connector_meta(SchedulerOutput(finished_req_ids={second}))
    assert meta.jobs_to_flush == {load_id, store_id}
    assert c.tracked_requests() == {"loader", "storer"}  # kept until their jobs complete
    c.update_connector_output([load_id, store_id])
    assert c.tracked_requests() == set()
    assert sorted(x[1] for x in m.calls if x[0] == "on_request_finished") == ["loader", "src", "storer"]


# --- the end of a request ---------------------------------------------------------------------


def test_on_request_finished_comes_before_the_state_is_dropped_and_is_never_skipped():
    m, c = make()
    req = request("f", 16)
    c.get_num_new_matched_tokens(req, 0)
    c.update_state_after_alloc(req, [0, 1, 2, 3], 0)
    meta = schedule_new(c, req, [0, 1, 2, 3], 0, 16)
    assert c.request_finished("f") is True  # a store still reads its blocks
    assert "on_request_finished" not in m.names()
    upd = c.update_connector_output([meta.store_jobs[0].job_id])
    assert upd.released == {"f"}
    assert m.names().index("complete_store") < m.names().index("on_request_finished")
    assert m.tracked_at_finish == [True]  # its state still existed when the manager heard
    assert c.tracked_requests() == set()
    # a request with no job is released at once
    idle = request("idle", 3)
    c.on_new_request(idle)
    assert c.request_finished("idle") is False
    assert m.names()[-1] == "on_request_finished"


def test_on_request_finished_even_when_completion_fails_or_the_job_failed():
    m, c = make()
    req = request("x", 16)
    c.get_num_new_matched_tokens(req, 0)
    c.update_state_after_alloc(req, [0, 1, 2, 3], 0)
    meta = schedule_new(c, req, [0, 1, 2, 3], 0, 16)
    c.build_connector_meta(SchedulerOutput(finished_req_ids={"x"}))

    def broken(*a, **k):
        raise KeyError("manager lost the block")

    m.complete_store = broken
    upd = c.update_connector_output([], failed_jobs=[meta.store_jobs[0].job_id])
    assert upd.released == {"x"} and c.manager_errors == 1 and "manager lost the block" in upd.errors[0]
    assert "on_request_finished" in m.names()
    assert c.stores_failed == 1


def test_a_failed_store_frees_the_blocks_and_emits_nothing():
    m, c = make()
    req = request("y", 16)
    c.get_num_new_matched_tokens(req, 0)
    c.update_state_after_alloc(req, [0, 1, 2, 3], 0)
    meta = schedule_new(c, req, [0, 1, 2, 3], 0, 16)
    c.update_connector_output([], failed_jobs=[meta.store_jobs[0].job_id])
    assert ("complete_store", "y", meta.store_jobs[0].keys, False) in m.calls
    assert m.cached_keys() == set() and c.take_events() == []


def test_results_for_unknown_jobs_are_counted():
    m, c = make()
    upd = c.update_connector_output([12345])
    assert c.unknown_job_results == 1 and "unknown job 12345" in upd.errors[0]


# --- events -----------------------------------------------------------------------------------


class EventManager(RecordingManager):
    def __init__(self, events):
        super().__init__()
        self.queued = list(events)

    def take_events(self):
        out, self.queued = self.queued, []
        return out


H1 = bytes(range(32))
H2 = bytes(range(100, 132))
LOW64 = (1 << 64) - 1


def test_take_events_converts_to_wire_events_with_low_64_bit_hashes():
    events = [
        OffloadingEvent([make_offload_key(H1, 0), make_offload_key(H2, 0)], "CPU", False),
        OffloadingEvent([make_offload_key(H1, 0), make_offload_key(H2, 2)], "STORAGE", True),
    ]
    c = OffloadingConnectorScheduler(EventManager(events), GBS, OBS)
    out = c.take_events()
    assert out[0] == BlockStored(
        block_hashes=[int.from_bytes(H1, "big") & LOW64, int.from_bytes(H2, "big") & LOW64],
        parent_block_hash=None,
        token_ids=[],
        block_size=0,
        lora_id=None,
        medium="CPU",
        lora_name=None,
        group_idx=0,
    )
    assert out[0].block_hashes[0] == int.from_bytes(H1[-8:], "big")  # the last 8 bytes
    assert all(0 <= h < 1 << 64 for h in out[0].block_hashes)
    # a removal mixing two KV-cache groups becomes one event per group
    assert out[1:] == [
        BlockRemoved(block_hashes=[int.from_bytes(H1[-8:], "big")], medium="STORAGE", group_idx=0),
        BlockRemoved(block_hashes=[int.from_bytes(H2[-8:], "big")], medium="STORAGE", group_idx=2),
    ]
    assert c.take_events() == []  # drained
    # they survive the wire
    back = decode_batch(encode_batch(KVEventBatch(ts=1.0, events=out)))
    assert back.events == out


def test_take_events_can_send_hash_bytes():
    events = [OffloadingEvent([make_offload_key(H1, 1)], "CPU", False)]
    c = OffloadingConnectorScheduler(EventManager(events), GBS, OBS, int_hashes=False)
    [ev] = c.take_events()
    assert ev.block_hashes == [H1] and ev.group_idx == 1
    assert offload_events_to_kv_events([], int_hashes=False) == []


def test_take_events_changes_no_job_state():
    m, c = make()
    req = request("t", 16)
    c.get_num_new_matched_tokens(req, 0)
    c.update_state_after_alloc(req, [0, 1, 2, 3], 0)
    meta = schedule_new(c, req, [0, 1, 2, 3], 0, 16)
    before = (c.pending_jobs(), c.tracked_requests(), m.stats())
    for _ in range(3):
        c.take_events()
    assert (c.pending_jobs(), c.tracked_requests(), m.stats()) == before
    finish_jobs(c, meta)
