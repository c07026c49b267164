"""CPU primary tier and cache policies: ref counts, pinning, all-or-nothing stores, events,
LRU and ARC eviction with pinned blocks, the policy registry."""

from __future__ import annotations

import sys
import types

import pytest

from kvevents import ConfigError
from manager import CPUOffloadingManager, LookupResult, OffloadingEvent, ReqContext, make_offload_key
from manager.wire import offload_events_to_kv_events
from manager.policies import CachePolicy, available_cache_policies, create_cache_policy, register_cache_policy
from manager.policies.arc import ARCCachePolicy
from manager.policies.lru import LRUCachePolicy

CTX = ReqContext("r")


def K(i: int) -> bytes:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def stored(m: CPUOffloadingManager, keys: list[bytes]) -> None:
    out = m.prepare_store(keys, CTX)
    assert out is not None
    m.complete_store(out.keys_to_store, CTX)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_lookup_states(policy: str) -> None:
    m = CPUOffloadingManager(4, policy)
    assert m.lookup(K(1), CTX) is LookupResult.MISS
    out = m.prepare_store([K(1)], CTX)
    assert out is not None and out.keys_to_store == [K(1)] and out.store_spec.block_ids.dtype.name == "int64"
    assert m.lookup(K(1), CTX) is LookupResult.RETRY  # being written
    assert m.ref_count(K(1)) == -1
    m.complete_store([K(1)], CTX)
    assert m.lookup(K(1), CTX) is LookupResult.HIT and m.ref_count(K(1)) == 0
    spec = m.prepare_load([K(1)], CTX)
    assert spec.block_ids.tolist() == out.store_spec.block_ids.tolist() and m.ref_count(K(1)) == 1
    m.complete_load([K(1)], CTX)
    assert m.ref_count(K(1)) == 0


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_prepare_store_skips_present_and_is_all_or_nothing(policy: str) -> None:
    m = CPUOffloadingManager(3, policy, enable_events=True)
    stored(m, [K(1), K(2)])
    out = m.prepare_store([K(1), K(2), K(3)], CTX)
    assert out is not None and out.keys_to_store == [K(3)] and out.evicted_keys == []
    # 3 blocks, all held: K(3) being written, K(1) and K(2) protected by being in the call.
    before = m.stats()
    assert m.prepare_store([K(1), K(2), K(4)], CTX) is None
    assert m.cached_keys() == {K(1), K(2)} and m.stats()["evictions"] == before["evictions"]
    assert m.store_rejections == 1
    assert m.prepare_store([K(i) for i in range(10, 14)], CTX) is None  # more than the pool


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_eviction_skips_pinned_and_writing(policy: str) -> None:
    m = CPUOffloadingManager(4, policy, enable_events=True)
    stored(m, [K(1), K(2), K(3)])
    m.prepare_load([K(1)], CTX)  # pinned by a load
    assert m.prepare_store([K(4)], CTX) is not None  # K(4) being written, pool now full
    out = m.prepare_store([K(5)], CTX)
    assert out is not None
    assert out.evicted_keys == [K(2)]  # oldest evictable: K(1) pinned
    out = m.prepare_store([K(6)], CTX)
    assert out is not None and out.evicted_keys == [K(3)]
    # Only pinned (K1) and being-written (K4, K5, K6) blocks remain: nothing evictable.
    assert m.prepare_store([K(7)], CTX) is None
    m.complete_load([K(1)], CTX)
    out = m.prepare_store([K(7)], CTX)
    assert out is not None and out.evicted_keys == [K(1)]
    removed = [k for e in m.take_events() if e.removed for k in e.keys]
    assert removed == [K(2), K(3), K(1)]


def test_lru_touch_changes_victim() -> None:
    m = CPUOffloadingManager(3, "lru")
    stored(m, [K(1), K(2), K(3)])
    m.touch([K(1)], CTX)
    out = m.prepare_store([K(4)], CTX)
    assert out is not None and out.evicted_keys == [K(2)]


def test_arc_prefers_frequent_blocks() -> None:
    m = CPUOffloadingManager(4, "arc")
    stored(m, [K(1), K(2)])
    m.touch([K(1), K(2)], CTX)  # seen twice: T2
    stored(m, [K(3), K(4)])  # seen once: T1
    out = m.prepare_store([K(5)], CTX)
    assert out is not None and out.evicted_keys == [K(3)]  # scan-resistant: T1 goes first
    pol = m.policy
    assert isinstance(pol, ARCCachePolicy) and K(3) in pol.b1
    # A ghost hit in B1 grows T1's target and inserts straight into T2.
    m.complete_store([K(5)], CTX)
    p_before = pol.p
    out = m.prepare_store([K(3)], CTX)
    assert out is not None and pol.p > p_before and K(3) in pol.t2


def test_arc_touch_of_block_being_written_is_not_a_reuse() -> None:
    pol = ARCCachePolicy(4)
    pol.insert(K(1), 0)
    pol.touch([K(1)], [-1, 0, 0, 0])
    assert K(1) in pol.t1
    pol.touch([K(1)], [0, 0, 0, 0])
    assert K(1) in pol.t2


@pytest.mark.parametrize("cls", [LRUCachePolicy, ARCCachePolicy])
def test_policy_evict_all_or_nothing(cls: type[CachePolicy]) -> None:
    pol = cls(4)
    for i in range(4):
        pol.insert(K(i), i)
    refs = [1, 0, -1, 0]
    assert pol.evict(3, refs, ()) is None and len(pol) == 4
    assert pol.evict(2, refs, {K(3)}) is None and len(pol) == 4
    got = pol.evict(2, refs, ())
    assert got is not None and sorted(got) == [(K(1), 1), (K(3), 3)] and len(pol) == 2
    assert pol.evict(0, refs, ()) == []


def test_failed_store_frees_blocks_and_announces_nothing() -> None:
    m = CPUOffloadingManager(2, "lru", enable_events=True)
    out = m.prepare_store([K(1), K(2)], CTX)
    assert out is not None and m.num_free_blocks == 0
    m.complete_store([K(1), K(2)], CTX, success=False)
    assert m.num_free_blocks == 2 and m.cached_keys() == set()
    assert m.lookup(K(1), CTX) is LookupResult.MISS and m.stores_failed == 2
    # only a never_stored removal (for whoever noted the keys at prepare time), nothing on the wire
    events = m.take_events()
    assert events == [OffloadingEvent([K(1), K(2)], "CPU", True, never_stored=True)]
    assert offload_events_to_kv_events(events) == [] and m.take_events() == []


def test_events_stored_evicted_and_reset() -> None:
    m = CPUOffloadingManager(2, "lru", enable_events=True)
    stored(m, [K(1), K(2)])
    stored(m, [K(3)])
    m.prepare_load([K(3)], CTX)
    evs = m.take_events()
    assert [(e.keys, e.removed, e.medium) for e in evs] == [
        ([K(1), K(2)], False, "CPU"),
        ([K(1)], True, "CPU"),
        ([K(3)], False, "CPU"),
    ]
    m.reset_cache()  # K(3) is pinned by a load: it stays
    evs = m.take_events()
    assert [(e.keys, e.removed) for e in evs] == [([K(2)], True)]
    assert m.cached_keys() == {K(3)} and m.num_free_blocks == 1
    assert m.take_events() == []  # drained


def test_events_disabled_by_default() -> None:
    m = CPUOffloadingManager(2)
    stored(m, [K(1)])
    assert m.take_events() == []


def test_take_events_is_a_pure_drain() -> None:
    m = CPUOffloadingManager(2, enable_events=True)
    out = m.prepare_store([K(1)], CTX)
    assert out is not None
    snap = (m.cached_keys(), m.ref_count(K(1)), m.num_free_blocks)
    m.take_events()
    m.take_events()
    assert (m.cached_keys(), m.ref_count(K(1)), m.num_free_blocks) == snap


def test_prepare_load_errors_and_undo() -> None:
    m = CPUOffloadingManager(4)
    stored(m, [K(1)])
    with pytest.raises(KeyError, match="not stored"):
        m.prepare_load([K(1), K(2)], CTX)
    assert m.ref_count(K(1)) == 0  # the pin taken before the error was undone
    with pytest.raises(KeyError, match="not pinned"):
        m.complete_load([K(1)], CTX)


def test_duplicate_keys_in_one_store() -> None:
    m = CPUOffloadingManager(4)
    out = m.prepare_store([K(1), K(1), K(2)], CTX)
    assert out is not None and out.keys_to_store == [K(1), K(2)] and len(out.store_spec) == 2


@pytest.mark.parametrize("bad", [-1, 1.5, True, "4"])
def test_bad_num_blocks(bad: object) -> None:
    with pytest.raises(ConfigError, match="num_blocks must be an int >= 0"):
        CPUOffloadingManager(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_zero_blocks_is_a_tier_that_holds_nothing(policy: str) -> None:
    m = CPUOffloadingManager(0, policy, enable_events=True)
    assert m.num_free_blocks == 0 and m.stats()["num_blocks"] == 0
    assert m.prepare_store([K(1)], CTX) is None and m.store_rejections == 1
    empty = m.prepare_store([], CTX)
    assert empty is not None and empty.keys_to_store == [] and len(empty.store_spec) == 0
    assert m.lookup(K(1), CTX) is LookupResult.MISS and m.lookup_prefix([K(1)], CTX) == 0
    m.reset_cache()
    assert m.take_events() == [] and m.cached_keys() == set()


def test_registry_unknown_name_lists_known() -> None:
    with pytest.raises(ConfigError, match="unknown cache policy 'nope'.*arc, lru"):
        CPUOffloadingManager(4, "nope")
    assert {"lru", "arc"} <= set(available_cache_policies())


def test_registry_out_of_tree_policy_loaded_lazily(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = types.ModuleType("oot_policy_mod")

    class FIFOish(LRUCachePolicy):
        name = "fifoish"

        def touch(self, keys, ref_counts):  # type: ignore[no-untyped-def]
            pass

    mod.FIFOish = FIFOish  # type: ignore[attr-defined]
    register_cache_policy("fifoish_test", "oot_policy_mod", "FIFOish")
    with pytest.raises(ConfigError, match="already registered"):
        register_cache_policy("fifoish_test", "x", "Y")
    # Not importable yet: the error names the module.
    with pytest.raises(ConfigError, match="cannot import module 'oot_policy_mod'"):
        create_cache_policy("fifoish_test", 4)
    monkeypatch.setitem(sys.modules, "oot_policy_mod", mod)
    m = CPUOffloadingManager(2, "fifoish_test")
    assert isinstance(m.policy, FIFOish)
    assert isinstance(create_cache_policy("oot_policy_mod:FIFOish", 2), FIFOish)
    with pytest.raises(ConfigError, match="has no class 'Nope'"):
        create_cache_policy("oot_policy_mod:Nope", 2)
    with pytest.raises(ConfigError, match="not a CachePolicy"):
        create_cache_policy("sys:version_info", 2)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_finished_request_loses_tail_before_head(policy: str) -> None:
    m = CPUOffloadingManager(4, policy)
    ctx = ReqContext("a")
    m.on_new_request(ctx)
    out = m.prepare_store([K(1), K(2), K(3)], ctx)  # a prefix, head K(1)
    assert out is not None
    m.complete_store(out.keys_to_store, ctx)
    m.on_request_finished(ctx)
    b = ReqContext("b")
    m.on_new_request(b)
    out = m.prepare_store([K(7), K(8)], b)
    assert out is not None and out.evicted_keys == [K(3)]  # the tail goes first


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_blocks_never_used_are_handed_out_before_freed_ones(policy: str) -> None:
    """vLLM's CPU manager's allocation order: unused blocks in ascending order first, then freed
    blocks, last freed first (vLLM 0.33's test_already_stored_chunk_not_evicted_during_prepare_store)."""
    m = CPUOffloadingManager(4, policy, enable_events=True)
    ctx = ReqContext("r")
    stored(m, [K(1), K(2)])
    m.touch([K(1)], ctx)  # K(2) is the eviction candidate, but it is offered again below
    out = m.prepare_store([K(2), K(3), K(4), K(5)], ctx)
    assert out is not None
    assert (out.keys_to_store, out.store_spec.block_ids.tolist(), out.evicted_keys) == (
        [K(3), K(4), K(5)], [2, 3, 0], [K(1)])
    m.complete_store(out.keys_to_store, ctx)
    assert m.lookup(K(2), ctx) is LookupResult.HIT and m.num_free_blocks == 0
    m.reset_cache()
    assert m.num_free_blocks == 4
    assert m.prepare_store([K(6)], ctx).store_spec.block_ids.tolist() == [0]


def test_a_policy_with_the_two_argument_insert_still_works() -> None:
    """An out-of-tree policy written before insert took the request is still driven."""

    class Fifo(CachePolicy):
        def insert(self, key, block_id):  # type: ignore[no-untyped-def, override]
            self.blocks[key] = block_id

        def remove(self, key):  # type: ignore[no-untyped-def]
            return self.blocks.pop(key, None)

        def touch(self, keys, ref_counts):  # type: ignore[no-untyped-def]
            pass

        def evict(self, n, ref_counts, protected):  # type: ignore[no-untyped-def]
            picked = [(k, b) for k, b in self.blocks.items() if ref_counts[b] == 0 and k not in protected][:n]
            if len(picked) < n:
                return None
            for k, _ in picked:
                del self.blocks[k]
            return picked

    m = CPUOffloadingManager(2, Fifo(2))
    stored(m, [K(1), K(2)])
    m.touch([K(1)], CTX)
    out = m.prepare_store([K(3)], CTX)
    assert out is not None and out.evicted_keys == [K(1)]
