"""The LRU's order by rank: a request's positioned blocks share one request rank (tails before
heads, an unfinished prefix outliving its own later batches), touches and request finish give
fresh ranks with the head most recent, transfers never reorder, an older request never demotes
a newer use, positions per KV-cache group, keys without a position ranked as fresh uses,
``reset_cache`` dropping unfinished requests' recency, and the connector's token positions."""

from __future__ import annotations

import random

import pytest

from manager import CPUOffloadingManager, ReqContext, make_offload_key
from manager.connector import EngineRequest, NewRequestData, OffloadingConnectorScheduler, SchedulerOutput
from manager.hashing import hash_request_blocks
from manager.policies import RequestRecord
from manager.policies.lru import SPAN, LRUCachePolicy


def K(i: int, group: int = 0) -> bytes:
    return make_offload_key(i.to_bytes(8, "big"), group)


def positioned(req_id: str, positions: dict[bytes, int]) -> ReqContext:
    """A context whose keys sit at the given token positions (others unknown)."""
    return ReqContext(req_id, None, positions)


def store(m: CPUOffloadingManager, keys: list[bytes], ctx: ReqContext, complete: bool = True) -> list[bytes]:
    out = m.prepare_store(keys, ctx)
    assert out is not None
    if complete:
        m.complete_store(out.keys_to_store, ctx)
    return out.evicted_keys


def test_an_unfinished_prefix_loses_its_tail_first_across_its_batches() -> None:
    m = CPUOffloadingManager(5)
    a = positioned("a", {K(i): 16 * (i + 1) for i in range(4)})
    store(m, [K(0), K(1)], a)
    store(m, [K(2), K(3)], a)  # a later batch of the same (unfinished) request
    assert store(m, [K(10), K(11)], ReqContext("b")) == [K(3)]  # its tail, not its head K(0)
    assert store(m, [K(12)], ReqContext("c")) == [K(2)]


def test_an_unfinished_prefix_survives_pressure_from_its_own_later_batch() -> None:
    m = CPUOffloadingManager(4)
    a = positioned("a", {K(i): 16 * (i + 1) for i in range(5)})
    store(m, [K(0), K(1), K(2)], a)
    assert store(m, [K(3), K(4)], a) == [K(2)]  # the prefix head K(0), K(1) stays
    assert {K(0), K(1)} <= m.cached_keys()


def test_backfilled_blocks_are_ordered_by_position_not_by_store_order() -> None:
    m = CPUOffloadingManager(3)
    a = positioned("a", {K(1): 16, K(2): 32, K(3): 48})
    for key in (K(1), K(3), K(2)):
        store(m, [key], a)
    assert store(m, [K(9)], ReqContext("b")) == [K(3)]


def test_touch_makes_the_first_key_the_most_recent() -> None:
    m = CPUOffloadingManager(3)
    ctx = ReqContext("r")
    store(m, [K(1), K(2), K(3)], ctx)
    m.touch([K(1), K(2)], ctx)
    assert store(m, [K(4)], ctx) == [K(3)]
    assert store(m, [K(5)], ctx) == [K(2)]  # the touch's tail before its head K(1)


def test_a_request_never_announced_still_orders_its_prefix_at_finish() -> None:
    m = CPUOffloadingManager(4)
    ctx = ReqContext("never-announced")  # no on_new_request, as vLLM's unit tests drive it
    store(m, [K(1), K(2), K(3), K(4)], ctx)
    m.on_request_finished(ctx)
    m.on_request_finished(ctx)  # a repeat changes nothing
    assert store(m, [K(5)], ReqContext("b")) == [K(4)]


@pytest.mark.parametrize("pin", ["store", "load"])
def test_a_transfer_ending_late_keeps_the_order_its_request_gave(pin: str) -> None:
    m = CPUOffloadingManager(4)
    old = ReqContext("old")
    if pin == "store":
        store(m, [K(1), K(2)], old, complete=False)
    else:
        store(m, [K(1), K(2)], ReqContext("seed"))
        m.prepare_load([K(1), K(2)], old)
    m.on_request_finished(old)  # recency given while the blocks are pinned
    new = ReqContext("new")
    store(m, [K(3), K(4)], new)
    m.on_request_finished(new)
    if pin == "store":
        m.complete_store([K(1), K(2)], old)  # the older request's transfer ends last
    else:
        m.complete_load([K(1), K(2)], old)
    assert store(m, [K(5)], ReqContext("b")) == [K(2)]


def test_an_older_request_never_demotes_a_newer_use() -> None:
    m = CPUOffloadingManager(4)
    old = positioned("old", {K(1): 16, K(2): 32, K(9): 48})
    store(m, [K(1), K(2)], old)
    store(m, [K(9)], positioned("new", {K(9): 16}))  # a newer request's block
    m.prepare_load([K(9)], old)  # the older one uses it too, at a later position
    m.complete_load([K(9)], old)
    assert store(m, [K(20), K(21)], ReqContext("b")) == [K(2)]  # old's tail; K(9) kept its rank
    assert K(9) in m.cached_keys()


def test_a_request_loading_a_prefix_keeps_it_before_its_new_tail() -> None:
    m = CPUOffloadingManager(4)
    store(m, [K(1), K(2)], ReqContext("seed"))
    ctx = positioned("reuse", {K(1): 16, K(2): 32, K(3): 48})
    m.prepare_load([K(1), K(2)], ctx)
    m.complete_load([K(2), K(1)], ctx)
    store(m, [K(3)], ctx)
    assert set(store(m, [K(10), K(11), K(12)], ReqContext("b"))) == {K(2), K(3)}
    assert K(1) in m.cached_keys()


def test_positions_order_the_tails_of_every_kv_cache_group() -> None:
    m = CPUOffloadingManager(4)
    keys = [K(1, 0), K(2, 0), K(1, 1), K(2, 1)]  # head and tail of groups 0 and 1
    ctx = positioned("hybrid", {K(1, 0): 16, K(1, 1): 16, K(2, 0): 32, K(2, 1): 32})
    store(m, keys, ctx)
    m.on_request_finished(ctx)
    assert set(store(m, [K(10), K(11)], ReqContext("b"))) == {K(2, 0), K(2, 1)}


def test_a_key_without_a_position_is_ranked_as_a_fresh_use() -> None:
    m = CPUOffloadingManager(4)
    a = positioned("a", {K(1): 16, K(2): 32})
    store(m, [K(1), K(2)], a)
    store(m, [K(3)], a)  # no position known: ranked when it is stored, after a's request rank
    assert store(m, [K(10), K(11)], ReqContext("b")) == [K(2)]
    assert store(m, [K(12)], ReqContext("c")) == [K(1)]


def test_reset_cache_drops_an_unfinished_requests_recency() -> None:
    m = CPUOffloadingManager(4)
    a = positioned("a", {K(1): 16, K(2): 32, K(3): 48})
    store(m, [K(1)], a)
    m.reset_cache()
    store(m, [K(9)], positioned("other", {K(9): 16}))
    store(m, [K(2), K(3)], a)  # after the reset `a` ranks as a new request, newer than other
    assert set(store(m, [K(20), K(21), K(22)], ReqContext("b"))) == {K(9), K(3)}


def test_a_failed_store_retried_keeps_the_prefix_order() -> None:
    m = CPUOffloadingManager(2)
    ctx = positioned("retry", {K(1): 16, K(2): 32})
    out = m.prepare_store([K(1)], ctx)
    assert out is not None
    m.complete_store([K(1)], ctx, success=False)
    store(m, [K(1)], ctx)
    store(m, [K(2)], ctx)
    assert store(m, [K(3)], ReqContext("b")) == [K(2)]


def test_a_position_outside_the_rank_span_is_a_clear_error() -> None:
    m = CPUOffloadingManager(2)
    with pytest.raises(ValueError, match="token position"):
        m.prepare_store([K(1)], positioned("bad", {K(1): SPAN}))


def test_connector_gives_the_manager_its_token_positions() -> None:
    """Through the connector, a running request's tail goes before its head under pressure."""
    gbs, obs = 4, 8
    m = CPUOffloadingManager(5)
    c = OffloadingConnectorScheduler(m, gbs, obs)

    def run(req_id: str, n_tokens: int, seed: int) -> EngineRequest:
        req = EngineRequest(req_id, hash_request_blocks([(seed * 1000 + i) % 997 for i in range(n_tokens)], gbs), n_tokens)
        blocks = list(range(seed * 100, seed * 100 + n_tokens // gbs))
        c.get_num_new_matched_tokens(req, 0)
        c.update_state_after_alloc(req, blocks, 0)
        so = SchedulerOutput(scheduled_new_reqs=[NewRequestData(req, blocks, 0)], num_scheduled_tokens={req_id: n_tokens})
        meta = c.build_connector_meta(so)
        c.update_connector_output([j.job_id for j in meta.store_jobs])
        return req

    a = run("a", 4 * obs, 1)  # 4 chunks stored, the request still running
    run("b", 2 * obs, 2)  # needs 2 blocks, 1 free: one of a's goes
    assert c.chunk_key(a, 3) not in m.cached_keys()
    assert all(c.chunk_key(a, i) in m.cached_keys() for i in range(3))


def test_lru_matches_a_reference_ranking_under_random_use() -> None:
    """The ordered dict + lazy heap evicts exactly what sorting every key by rank would."""
    rng = random.Random(7)
    pol = LRUCachePolicy(64)
    ranks: dict[bytes, tuple[int, int]] = {}  # the reference: key -> (clock, -position)
    clock = 0
    requests: list[tuple[RequestRecord, dict[bytes, int], int]] = []  # (record, positions, rank)
    refs = [0] * 64
    free = list(range(64))
    for step in range(3000):
        op = rng.random()
        resident = list(pol.blocks)
        if op < 0.1 or not requests:
            positions: dict[bytes, int] = {}
            requests.append((RequestRecord(None, 0, positions), positions, 0))
            requests = requests[-6:]
        elif op < 0.45 and free:
            i = rng.randrange(len(requests))
            rec, positions, rrank = requests[i]
            key = K(rng.randrange(10**6))
            if key in pol.blocks:
                continue
            if rng.random() < 0.7:
                positions[key] = rng.randrange(1, 10**6)
                if not rrank:
                    clock += 1
                    rrank = clock
                    requests[i] = (rec, positions, rrank)
                ranks[key] = (rrank, -positions[key])
            else:
                clock += 1
                ranks[key] = (clock, 0)
            pol.insert(key, free.pop(), rec)
        elif op < 0.6 and resident:
            keys = rng.sample(resident, min(len(resident), rng.randint(1, 4)))
            pol.touch(keys, refs)
            for key in reversed(keys):
                clock += 1
                ranks[key] = (clock, 0)
        elif op < 0.7 and resident:
            i = rng.randrange(len(requests))
            rec, positions, rrank = requests[i]
            keys = rng.sample(resident, min(len(resident), 3))
            for key in keys:
                positions.setdefault(key, rng.randrange(1, 10**6))
            pol.access(keys, rec)
            if not rrank and keys:
                clock += 1
                rrank = clock
                requests[i] = (rec, positions, rrank)
            for key in keys:
                ranks[key] = max(ranks[key], (rrank, -positions[key]))
        elif op < 0.8 and resident:
            b = pol.blocks[rng.choice(resident)]
            refs[b] = 0 if refs[b] else rng.choice([-1, 1])
        elif resident:
            n = rng.randint(1, 3)
            protected = set(rng.sample(resident, min(2, len(resident))))
            ok = sorted((r, k) for k, r in ranks.items() if refs[pol.blocks[k]] == 0 and k not in protected)
            got = pol.evict(n, refs, protected)
            if len(ok) < n:
                assert got is None, step
                continue
            assert got is not None and [k for k, _ in got] == [k for _, k in ok[:n]], step
            for key, b in got:
                del ranks[key]
                free.append(b)
        assert set(pol.blocks) == set(ranks), step
