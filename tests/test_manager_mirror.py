"""Property: replaying the emitted events into a mirror gives exactly the cached keys per
medium, whatever the operation sequence (and however often events are drained)."""

from __future__ import annotations

import tempfile
from collections import defaultdict

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from manager import CPUOffloadingManager, LookupResult, NumpyBlockIO, OffloadingEvent, ReqContext, make_offload_key
from manager.tiering import SecondaryTierFactory, TieringOffloadingManager

KEYS = [make_offload_key(i.to_bytes(4, "big"), i % 2) for i in range(12)]

key_lists = st.lists(st.sampled_from(KEYS), min_size=1, max_size=5)
# Stores, completions, settles and drains are listed twice: sequences that fill, evict and
# reset the cache are then common in few examples.
_store = st.tuples(st.just("store"), st.integers(0, 3), key_lists)
_complete = st.tuples(st.just("complete"), st.integers(0, 10), st.booleans())
_settle = st.tuples(st.just("settle"), st.none(), st.none())
_drain = st.tuples(st.just("drain"), st.none(), st.none())
ops = st.lists(
    st.one_of(
        _store,
        _complete,
        _settle,
        _drain,
        st.tuples(st.just("lookup"), st.integers(0, 3), st.sampled_from(KEYS)),
        st.tuples(st.just("store"), st.integers(0, 3), key_lists),
        st.tuples(st.just("complete"), st.integers(0, 10), st.booleans()),
        st.tuples(st.just("load"), st.integers(0, 3), key_lists),
        st.tuples(st.just("touch"), st.integers(0, 3), key_lists),
        st.tuples(st.just("finish"), st.integers(0, 3), st.none()),
        st.tuples(st.just("step"), st.none(), st.none()),
        st.tuples(st.just("settle"), st.none(), st.none()),
        st.tuples(st.just("drain"), st.none(), st.none()),
        st.tuples(st.just("reset"), st.none(), st.none()),
        st.tuples(st.just("ex_remove"), st.none(), key_lists),
    ),
    min_size=15,
    max_size=40,
)


class Mirror:
    def __init__(self) -> None:
        self.media: dict[str, set[bytes]] = defaultdict(set)

    def apply(self, events: list[OffloadingEvent]) -> None:
        for e in events:
            have = self.media[e.medium]
            for k in e.keys:
                if e.never_stored:  # a failed store's keys: never announced, nothing to take back
                    assert e.removed and k not in have, f"never_stored removal of a key announced in {e.medium}"
                elif e.removed:
                    assert k in have, f"removal of a key never announced in {e.medium}"
                    have.discard(k)
                else:
                    assert k not in have, f"key announced twice in {e.medium}"
                    have.add(k)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, policy=st.sampled_from(["lru", "arc"]), rl=st.booleans(), cap=st.integers(1, 6))
def test_mirror_matches_cached_keys(ops, policy, rl, cap) -> None:  # type: ignore[no-untyped-def]
    with tempfile.TemporaryDirectory() as root:
        io = NumpyBlockIO.allocate(4, 8)
        primary = CPUOffloadingManager(4, policy, enable_events=True)
        ex = SecondaryTierFactory.create_secondary_tier({"type": "example", "medium": "EX", "request_level": rl})
        fs = SecondaryTierFactory.create_secondary_tier(
            {"type": "fs", "root": root, "capacity_blocks": cap, "num_threads": 1}
        )
        m = TieringOffloadingManager(primary, [ex, fs], block_io=io)
        mirror = Mirror()
        ctxs: dict[int, ReqContext] = {}
        pending: list[tuple[ReqContext, list[bytes]]] = []
        loads: list[tuple[ReqContext, list[bytes]]] = []

        def ctx(i: int) -> ReqContext:
            if i not in ctxs:
                ctxs[i] = ReqContext(f"r{i}-{len(ctxs)}")
                m.on_new_request(ctxs[i])
            return ctxs[i]

        try:
            for op, a, b in ops:
                if op == "lookup":
                    m.lookup(b, ctx(a))
                elif op == "store":
                    out = m.prepare_store(b, ctx(a))
                    if out is not None and out.keys_to_store:
                        pending.append((ctx(a), out.keys_to_store))
                elif op == "complete" and pending:
                    c, keys = pending.pop(a % len(pending))
                    m.complete_store(keys, c, success=b)
                elif op == "load":
                    c = ctx(a)
                    hits = [k for k in dict.fromkeys(b) if primary.lookup(k, c) is LookupResult.HIT]
                    if hits:
                        m.prepare_load(hits, c)
                        m.touch(hits, c)
                        loads.append((c, hits))
                    if len(loads) > 2:
                        c0, k0 = loads.pop(0)
                        m.complete_load(k0, c0)
                elif op == "touch":
                    m.touch(b, ctx(a))
                elif op == "finish" and a in ctxs:
                    m.on_request_finished(ctxs.pop(a))
                elif op == "step":
                    m.on_schedule_end()
                elif op == "settle":  # every job finished and processed
                    assert m.drain_jobs(timeout=10)
                    m.on_schedule_end()
                    m.on_schedule_end()
                elif op == "drain":
                    mirror.apply(m.take_events())
                    assert mirror.media["CPU"] == primary.cached_keys()
                    assert mirror.media["EX"] == ex.cached_keys()  # synchronous tier
                elif op == "reset":
                    m.reset_cache()
                elif op == "ex_remove":
                    ex.remove(b)
            # Quiesce: finish loads and stores, let every job finish and be processed.
            for c, keys in loads:
                m.complete_load(keys, c)
            for c, keys in pending:
                m.complete_store(keys, c)
            for _ in range(6):
                assert m.drain_jobs(timeout=10)
                m.on_schedule_end()
            assert m.drain_jobs(timeout=10)
            mirror.apply(m.take_events())
            assert mirror.media["CPU"] == primary.cached_keys()
            assert mirror.media["EX"] == ex.cached_keys()
            assert mirror.media["STORAGE"] == fs.cached_keys()
        finally:
            m.shutdown()
