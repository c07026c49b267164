"""KVRouter: joins, tiers, LoRA, lifecycle, budget, errors."""

from __future__ import annotations

import pytest

from consumers import KVRouter, RouterConfig, RouterInputError, request_keys

from .router_helpers import BS, batch, clear, gpu, off, rm, toks

M = "m"


def router(**kw) -> KVRouter:
    kw.setdefault("model", M)
    return KVRouter(RouterConfig(**kw))


def chain(r: KVRouter, pod: str, n: int, *, first: int = 0, prefix: str = "h", rank=None, lora=None, salt=0):
    """Store blocks first..first+n-1 of one chain on ``pod`` (one event); hashes f"{prefix}{i}"."""
    hashes = [f"{prefix}{i}".encode() for i in range(first, first + n)]
    parent = None if first == 0 else f"{prefix}{first - 1}".encode()
    r.apply(pod, batch(gpu(hashes, parent, toks(first, n, salt=salt), lora=lora), rank=rank))
    return hashes


def tiers(r: KVRouter, n_blocks: int, pod: str = "a", lora=None, salt=0) -> dict[str, int]:
    s = r.score(toks(0, n_blocks, salt=salt), lora)
    return s[pod].tokens_by_tier if pod in s else None


def test_gpu_prefix_and_partial_prompt():
    r = router()
    chain(r, "a", 4)
    assert tiers(r, 4) == {"GPU": 64}
    assert tiers(r, 6) == {"GPU": 64}
    s = r.score(toks(0, 2) + [5, 6, 7])  # trailing partial block never matches
    assert s["a"].matched_tokens == 32
    s = r.score(toks(1, 3))  # same blocks, but not from the start: a different prefix
    assert s["a"].matched_tokens == 0 and s["a"].tokens_by_tier == {}


def test_join_chunk_factor_one_cpu_continues_after_gpu_eviction():
    r = router()
    h = chain(r, "a", 4)
    r.apply("a", batch(off(h[:4], "CPU"), rm(h[2:], "GPU")))
    assert tiers(r, 4) == {"GPU": 32, "CPU": 32}
    s = r.score(toks(0, 4))["a"]
    assert s.total == pytest.approx((32 * 1.0 + 32 * 0.8) / 64)
    r.apply("a", batch(rm(h[3:], "CPU")))
    assert tiers(r, 4) == {"GPU": 32, "CPU": 16}
    assert r.stats.offload_blocks == 4 and r.stats.blocks_removed == 3


def test_join_chunk_factor_two_inferred_from_consecutive_hashes():
    r = router()
    h = chain(r, "a", 8)
    r.apply("a", batch(off([h[1], h[3], h[5], h[7]], "CPU")))  # each chunk = 2 GPU blocks, named by the last
    r.apply("a", batch(rm(h, "GPU")))
    assert tiers(r, 8) == {"CPU": 128}
    # a later single-hash offload uses the inferred factor
    h2 = chain(r, "a", 2, first=8)
    r.apply("a", batch(off([h2[1]], "CPU"), rm(h2, "GPU")))
    assert tiers(r, 10) == {"CPU": 160}
    # removing a chunk removes both of its blocks
    r.apply("a", batch(rm([h[3]], "CPU")))
    assert tiers(r, 10) == {"CPU": 32}


def test_join_chunk_factor_configured():
    r = router(offload_chunk_blocks={"CPU": 4})
    h = chain(r, "a", 8)
    r.apply("a", batch(off([h[3]], "CPU"), rm(h, "GPU")))
    assert tiers(r, 8) == {"CPU": 64}
    r.apply("a", batch(off([h[7]], "CPU")))
    assert tiers(r, 8) == {"CPU": 128}


def test_single_chunk_extent_from_its_chain_depth():
    # (issue 13: this used to score nothing without offload_chunk_blocks) a lone chunk hash at
    # depth 2 bounds the extent by 2 keys: both blocks are in the CPU tier
    r = router()
    h = chain(r, "a", 4)
    r.apply("a", batch(off([h[1]], "CPU"), rm(h, "GPU")))
    s = r.explain(toks(0, 4))["a"][0]
    assert s.matched_tokens == 32 and s.alone["CPU"] == 32
    assert "block 2" in s.reason
    assert r.stats.chunk_inferred == 1


def test_gpu_cpu_storage_continuation_and_no_way_back_up():
    r = router()
    h = chain(r, "a", 6)
    r.apply("a", batch(off(h[2:4], "CPU"), off(h[4:6], "STORAGE"), rm(h[2:], "GPU")))
    assert tiers(r, 6) == {"GPU": 32, "CPU": 32, "STORAGE": 32}
    w = (32 * 1.0 + 32 * 0.8 + 32 * 0.5) / 96
    assert r.score(toks(0, 6))["a"].total == pytest.approx(w)
    # once the walk has moved down to CPU, a block that is in GPU as well still counts as CPU
    r2 = router()
    h = chain(r2, "a", 3)
    r2.apply("a", batch(off(h, "CPU"), rm(h[:1], "GPU")))
    assert tiers(r2, 3) == {"CPU": 48}
    ex = r2.explain(toks(0, 3))["a"][0]
    assert ex.alone == {"GPU": 0, "CPU": 48, "STORAGE": 0}
    assert ex.ended_at_block is None and "end of prompt" in ex.reason


def test_tier_weights_configurable():
    r = router(tier_weights={"GPU": 1.0, "CPU": 0.25, "STORAGE": 0.1})
    h = chain(r, "a", 2)
    r.apply("a", batch(off(h, "CPU"), rm(h[1:], "GPU")))
    assert r.score(toks(0, 2))["a"].total == pytest.approx((16 + 16 * 0.25) / 32)


def test_engine_block_larger_than_canonical():
    r = router()  # canonical 16, engine 32: one engine block = two keys
    hs = [b"e0", b"e1"]
    r.apply("a", batch(gpu(hs, None, toks(0, 4), bs=32)))
    assert tiers(r, 4) == {"GPU": 64}
    r.apply("a", batch(off(hs[:1], "CPU"), rm(hs, "GPU")))
    assert tiers(r, 4) == {"CPU": 32}
    r.apply("a", batch(gpu([b"e2"], b"e1", toks(4, 2), bs=32)))  # child of a removed block still keys
    assert r.score(toks(0, 6))["a"].matched_tokens == 32  # blocks 2,3 gone: prefix stops there
    assert r.explain(toks(0, 6))["a"][0].alone["GPU"] == 0


def test_engine_block_smaller_than_canonical():
    r = router()  # engine 8: two engine blocks per key, split across events
    r.apply("a", batch(gpu([b"x0"], None, toks(0, 1)[:8], bs=8)))
    assert r.score(toks(0, 1))["a"].matched_tokens == 0
    r.apply("a", batch(gpu([b"x1", b"x2", b"x3"], b"x0", toks(0, 2)[8:], bs=8)))
    assert tiers(r, 2) == {"GPU": 32}
    r.apply("a", batch(rm([b"x3"], "GPU")))
    assert tiers(r, 2) == {"GPU": 16}


def test_engine_block_not_a_multiple():
    r = router()  # engine 24 vs canonical 16
    t = toks(0, 3)
    r.apply("a", batch(gpu([b"y0", b"y1"], None, t, bs=24)))
    assert tiers(r, 3) == {"GPU": 48}
    assert request_keys(t, M) == request_keys(list(t), M)


def test_lora_separation():
    r = router()
    chain(r, "a", 3, lora="sql")
    chain(r, "b", 3, prefix="g")
    assert r.score(toks(0, 3), "sql")["a"].matched_tokens == 48
    assert r.score(toks(0, 3), "sql")["b"].matched_tokens == 0
    assert r.score(toks(0, 3))["a"].matched_tokens == 0
    assert r.score(toks(0, 3))["b"].matched_tokens == 48
    assert r.pick(toks(0, 3), "sql") == "a" and r.pick(toks(0, 3)) == "b"


def test_models_are_separate():
    r = KVRouter()
    r.apply("a", batch(gpu([1], None, toks(0))), model="m1")
    r.apply("b", batch(gpu([1], None, toks(0))), model="m2")
    assert set(r.score(toks(0), model="m1")) == {"a"}
    assert r.score(toks(0), model="m2")["b"].matched_tokens == 16
    with pytest.raises(RouterInputError):
        r.score(toks(0))  # two models served: say which


def test_pending_offload_resolved_when_gpu_event_arrives():
    r = router()
    r.apply("a", batch(off([b"h0", b"h1"], "CPU")))
    assert r.stats.pending_held == 2 and r.counters()["pending"] == 2
    assert tiers(r, 2) == {}
    chain(r, "a", 2)
    assert r.stats.pending_resolved == 2 and r.counters()["pending"] == 0
    r.apply("a", batch(rm([b"h0", b"h1"], "GPU")))
    assert tiers(r, 2) == {"CPU": 32}


def test_pending_expiry_capacity_and_cancel():
    r = router(pending_capacity=2, pending_max_batches=3)
    r.apply("a", batch(off([b"p0", b"p1", b"p2"], "CPU")))
    assert r.stats.pending_held == 3 and r.stats.pending_dropped == 1
    r.apply("a", batch(rm([b"p1"], "CPU")))
    assert r.stats.pending_cancelled == 1
    for _ in range(4):
        r.apply("a", batch())
    assert r.stats.pending_expired == 1 and r.counters()["pending"] == 0
    chain(r, "a", 3, prefix="p")
    assert r.stats.pending_resolved == 0 and tiers(r, 3) == {"GPU": 48}


def test_reset_clear_and_purge():
    r = router()
    chain(r, "a", 2)
    chain(r, "b", 2, prefix="g")
    r.reset_pod("a")
    assert tiers(r, 2, "a") == {} and tiers(r, 2, "b") == {"GPU": 32}
    chain(r, "a", 2)
    r.apply("a", batch(off([b"h0", b"h1"], "CPU")))
    r.apply("a", batch(clear()))
    assert tiers(r, 2, "a") == {} and r.stats.clears == 1
    assert r.entries() == 2  # b's GPU blocks
    r.remove_pod("b")
    assert r.pods() == ["a"] and "b" not in r.score(toks(0, 2)) and r.entries() == 0
    chain(r, "c", 1, prefix="z")  # reuses b's slot: starts empty
    assert r.score(toks(0, 2))["c"].matched_tokens == 16


def test_data_parallel_ranks():
    r = router()
    chain(r, "a", 2, rank=0)
    chain(r, "a", 4, rank=1, prefix="r")
    s = r.score(toks(0, 4))["a"]
    assert s.matched_tokens == 64 and s.rank == 1
    r.apply("a", batch(clear(), rank=1))
    s = r.score(toks(0, 4))["a"]
    assert s.matched_tokens == 32 and s.rank == 0
    assert [e.rank for e in r.explain(toks(0, 4))["a"]] == [0, 1]


def test_eviction_under_budget():
    r = router(max_entries=64)
    for c in range(10):  # ten chains of 16 blocks, oldest first
        r.apply("a", batch(gpu([f"c{c}-{i}" for i in range(16)], None, toks(0, 16, salt=c + 1))))
        assert r.entries() <= 64
    cnt = r.counters()
    assert cnt["evicted_keys"] >= 160 - 64 and cnt["evicted_entries"] >= 160 - 64
    assert tiers(r, 16, salt=10) == {"GPU": 256}  # newest chain intact
    assert tiers(r, 16, salt=1) == {}  # oldest chain gone
    mem = r.memory_report()
    assert mem["entries"] == r.entries() and mem["bytes_per_entry"] > 0


def test_restore_refreshes_lru_position():
    r = router(max_entries=50)
    r.apply("a", batch(gpu([f"old{i}" for i in range(16)], None, toks(0, 16, salt=1))))
    r.apply("a", batch(gpu([f"mid{i}" for i in range(16)], None, toks(0, 16, salt=2))))
    r.apply("b", batch(gpu([f"old{i}" for i in range(16)], None, toks(0, 16, salt=1))))  # touches "old"
    r.apply("a", batch(gpu([f"new{i}" for i in range(16)], None, toks(0, 16, salt=3))))
    assert tiers(r, 16, "b", salt=1) == {"GPU": 256}
    assert tiers(r, 16, "a", salt=2) == {}


def test_unreliable_after_gap_is_discounted_not_excluded_until_cleared():
    r = router()
    chain(r, "a", 2)
    chain(r, "b", 1, prefix="g")
    r.mark_unreliable("a")
    s = r.score(toks(0, 2))["a"]  # still routed: its score discounted by state_factors["UNRELIABLE"]
    assert s.state == "UNRELIABLE" and s.factor == 0.5 and s.total == pytest.approx(0.5)
    assert r.pick(toks(0, 2)) == "a"
    ex = r.explain(toks(0, 2))["a"][0]
    assert ex.state == "UNRELIABLE" and "discounted x0.5" in ex.reason and ex.extra == {"relearn_batches_left": 512}
    assert r.uncertainty() == {"a": {"factor": 0.5, "batches_left": 512}} and r.counters()["uncertain_pods"] == 1
    r.apply("a", batch(clear()))
    assert r.score(toks(0, 2))["a"].state == "SYNCED" and r.uncertainty() == {}
    r0 = router(state_factors={"UNRELIABLE": 0.0}, relearn_batches=0)  # the old exclusion, configured
    chain(r0, "a", 2)
    r0.mark_unreliable("a")
    assert "a" not in r0.score(toks(0, 2))
    assert r0.explain(toks(0, 2))["a"][0].reason.startswith("excluded")


def test_unreliable_discount_decays_as_batches_reteach():
    from kvevents import Delivery, DeliveryKind

    r = router(relearn_batches=8)
    chain(r, "a", 2)
    r.mark_unreliable("a")
    factors = [r.score(toks(0, 2))["a"].factor]
    for i in range(8):  # each batch delivered through the feed re-teaches the index one step
        r.handle(Delivery(DeliveryKind.BATCH, "a", "kv@a@m", i, batch(gpu([f"x{i}"], None, toks(100 + i)))))
        factors.append(r.score(toks(0, 2))["a"].factor)
    assert factors == [0.5 + 0.5 * k / 8 for k in range(8)] + [1.0]
    assert r.score(toks(0, 2))["a"].state == "SYNCED" and r.stats.relearned == 1 and r.stats.gaps == 1


def test_load_term_and_pick_ties():
    r = router(load_weight=0.5)
    chain(r, "a", 2)
    chain(r, "b", 2, prefix="g")
    assert r.pick(toks(0, 2), load={"a": 0.8, "b": 0.1}) == "b"
    assert r.score(toks(0, 2), load={"a": 0.8})["a"].total == pytest.approx(1.0 - 0.4)
    assert r.pick(toks(0, 2)) == "a"  # tie: name
    assert KVRouter(model=M).pick(toks(0)) is None


def test_orphans_groups_and_bad_input():
    r = router()
    r.apply("a", batch(gpu([b"k1"], b"unknown-parent", toks(1))))
    assert r.stats.orphan_blocks == 1 and r.entries() == 0
    r.apply("a", batch(gpu([b"k2"], None, toks(0), group=1)))
    assert r.stats.ignored_group_events == 1 and r.entries() == 0
    r.apply("a", batch(gpu([b"k3", b"k4"], None, toks(0))))  # 16 tokens for two blocks
    assert r.stats.errors == {"bad_block_stored": 1}
    with pytest.raises(RouterInputError, match="block_size 16 and 16 token ids"):
        r.apply("a", batch(gpu([b"k3", b"k4"], None, toks(0))), strict=True)
    with pytest.raises(TypeError):
        r.apply("a", [1, 2])
    r.apply("a", batch(rm([b"never"], "GPU")))
    assert r.stats.remove_unknown == 1
    with pytest.raises(RouterInputError, match="no model"):
        KVRouter().apply("a", batch())


def test_int_and_bytes_hashes_and_numpy_prompt():
    np = pytest.importorskip("numpy")
    r = router()
    r.apply("a", batch(gpu([2**64 - 1, -5], None, toks(0, 2))))
    r.apply("b", batch(gpu([b"\x00" * 32, b"\x01" * 32], None, toks(0, 2))))
    s = r.score(np.array(toks(0, 2), dtype=np.int64))
    assert s["a"].matched_tokens == 32 and s["b"].matched_tokens == 32


def test_more_pods_than_one_lane():
    r = router()
    for p in range(70):
        hs = [p, 1000 + p] if p % 2 else [p]
        r.apply(f"p{p}", batch(gpu(hs, None, toks(0, len(hs)))))
    r.apply("p3", batch(off([3, 1003], "CPU"), rm([1003], "GPU")))
    s = r.score(toks(0, 2))
    assert len(s) == 70
    assert all(s[f"p{p}"].matched_tokens == (32 if p % 2 else 16) for p in range(70))
    assert s["p3"].tokens_by_tier == {"GPU": 16, "CPU": 16}


def test_config_validation():
    from kvevents import ConfigError

    with pytest.raises(ConfigError):
        RouterConfig(block_size=0)
    with pytest.raises(ConfigError):
        RouterConfig(offload_chunk_blocks={"CPU": 0})
    with pytest.raises(TypeError):
        KVRouter(RouterConfig(), model="x")


def test_an_empty_router_scores_nothing() -> None:
    from consumers import KVRouter

    router = KVRouter()
    assert router.score(list(range(64))) == {}
    assert router.pick(list(range(64))) is None
