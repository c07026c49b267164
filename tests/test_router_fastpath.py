"""The router's C fast path: ``apply_payload`` must leave exactly the state ``apply`` leaves.

Property: random multi-event batches (GPU stores of canonical and double-size engine blocks,
offloads joined or held, removals, clears, LoRA chain starts, non-indexed groups, two
data-parallel ranks, budgets small enough to evict, compaction made frequent) fed to one
router decoded and to another as payloads give the same index (keys in the same LRU order),
learned hashes, pending holds, endpoints and counters after every batch. Plus: malformed
payloads change nothing and raise DecodeError, the legacy encoding, the pure-Python
fallback, and how the extension is loaded and refused.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import consumers.keys as keys_mod
from consumers import KVRouter, RouterConfig, _accel
from consumers.nativeingest import NativeIngestor
from consumers.keys import chain_keys_py
from kvevents import AllBlocksCleared, BlockRemoved, BlockStored, DecodeError, KVEventBatch, encode_batch

pytestmark = pytest.mark.skipif(keys_mod._FAST is None, reason=f"C fast path not in use: {_accel.status()}")

C = 2
PODS = {"a": 2, "b": 2, "w": 4}  # pod -> engine block size
SEQ_BLOCKS = 6


def ehash(E, prefix):
    return hash(("E", E) + tuple(prefix)) & (2**64 - 1)


def _records(image):
    w = image.width
    return [(k, sorted((b % w, b // w) for b in range(m.bit_length()) if m >> b & 1), p) for k, m, p in image.records]


def state(r: KVRouter):
    stats = r.stats.as_dict()  # (first: the C path's tally folded in)
    idx = r.index
    eps = sorted(
        ((ep.pod, ep.rank), ep.slot, ep.block_size, sorted(ep.token_tiers), dict(ep.chunk_keys),
         {t: dict(d) for t, d in ep.odd_chunks.items()}, ep.unreliable)
        for ep in r.endpoints
    )
    learned = r.learned
    return {
        "index": _records(idx.snapshot()),  # holders and links, the LRU order too (through the Index role)
        "counts": [idx.stats()[k] for k in ("entries", "keys", "evicted_keys", "evicted_entries")],
        "learned": {m: list(d.items()) for m, d in learned.maps.items()},
        "learned_size": (learned.size, learned.evicted),
        "odd": {m: o[0] for m, o in learned.odd.items()},
        "stats": stats,
        "endpoints": eps,
        "pending": list(r.ingestor.pending.items()),
        "tiers": list(r.endpoints.tier_names),
    }


@st.composite
def event(draw, seqs):
    pod = draw(st.sampled_from(["a", "a", "b", "b", "w"]))
    E = PODS[pod]
    seq = draw(st.sampled_from(seqs))
    nblocks = len(seq) // E
    hashes = [ehash(E, seq[: (i + 1) * E]) for i in range(nblocks)]
    kind = draw(st.sampled_from(["store"] * 6 + ["offload"] * 4 + ["remove"] * 3 + ["clear", "odd"]))
    if kind == "store":
        start = draw(st.sampled_from([0, 0, draw(st.integers(0, nblocks - 1))]))
        n = draw(st.integers(1, nblocks - start))
        parent = None if start == 0 else hashes[start - 1]
        lora = draw(st.sampled_from([None] * 7 + ["ad1"]))
        return pod, BlockStored(hashes[start:start + n], parent, list(seq[start * E:(start + n) * E]), E, None,
                                draw(st.sampled_from(["GPU", "GPU", None])), lora)
    if kind in ("offload", "remove"):
        tier = draw(st.sampled_from(["CPU", "STORAGE"] if kind == "offload" else ["GPU", "CPU", "STORAGE"]))
        idx = draw(st.lists(st.integers(0, nblocks - 1), min_size=1, max_size=4))
        hs = [hashes[i] for i in idx]
        if draw(st.integers(0, 9)) == 0:
            hs.append(draw(st.integers(0, 2**64 - 1)))  # a hash nobody stored
        if kind == "offload":
            return pod, BlockStored(hs, None, [], 0, None, tier, None)
        return pod, BlockRemoved(hs, tier)
    if kind == "clear":
        return pod, AllBlocksCleared()
    odd = draw(st.sampled_from(["group", "tier", "size"]))
    if odd == "group":  # a kv-cache group the router does not index
        return pod, BlockStored(hashes[:1], None, list(seq[:E]), E, None, "GPU", None, group_idx=1)
    if odd == "tier":  # a medium not seen before: a new tier
        return pod, BlockStored(hashes[:1], None, [], 0, None, "DISK", None)
    return pod, BlockStored(hashes[:1], None, list(seq[:E]), E, None, "GPU", None, group_idx=0)


@st.composite
def scenario(draw):
    seqs = draw(st.lists(st.lists(st.integers(1, 3), min_size=SEQ_BLOCKS * 4, max_size=SEQ_BLOCKS * 4),
                         min_size=1, max_size=3))
    if len(seqs) > 1 and draw(st.booleans()):
        cut = draw(st.integers(1, len(seqs[0]) - 1))
        seqs[1] = seqs[0][:cut] + seqs[1][cut:]
    evs = draw(st.lists(event(seqs), min_size=1, max_size=30))
    batches = []  # consecutive events of one pod, 1..4 per batch, rank 0 or 1
    i = 0
    while i < len(evs):
        pod = evs[i][0]
        n = draw(st.integers(1, 4))
        group = [e for p, e in evs[i:i + n] if p == pod] or [evs[i][1]]
        i += max(1, len([1 for p, _ in evs[i:i + n] if p == pod]))
        action = draw(st.sampled_from(["batch"] * 8 + ["reset", "remove_pod"]))
        batches.append((pod, action, KVEventBatch(0.0, group, draw(st.sampled_from([None, 0, 1])))))
    config = dict(
        block_size=C, model="m",
        offload_chunk_blocks=draw(st.sampled_from([{}, {"CPU": 1}, {"CPU": 2, "STORAGE": 1}])),
        max_entries=draw(st.sampled_from([1 << 20, 40, 12])),
        max_tiers=draw(st.sampled_from([3, 4])),
    )
    return batches, config


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenario())
def test_apply_payload_leaves_exactly_the_state_apply_leaves(sc):
    batches, config = sc
    slow, fast = KVRouter(RouterConfig(**config)), KVRouter(RouterConfig(**config))
    for pod, action, batch in batches:
        if action == "reset":
            slow.reset_pod(pod)
            fast.reset_pod(pod)
        elif action == "remove_pod":
            slow.remove_pod(pod)
            fast.remove_pod(pod)
        slow.apply(pod, batch)
        fast.apply_payload(pod, encode_batch(batch))
        assert state(fast) == state(slow), batch
    prompt = [t for _, _, b in batches[:1] for ev in b.events for t in getattr(ev, "token_ids", [])]
    assert {p: s.tokens_by_tier for p, s in fast.score(prompt).items()} == \
        {p: s.tokens_by_tier for p, s in slow.score(prompt).items()}


def _stream():
    toks = list(range(100, 164))
    hs = [ehash(2, toks[: (i + 1) * 2]) for i in range(32)]
    return [
        KVEventBatch(1.0, [BlockStored(hs[:16], None, toks[:32], 2, None, "GPU", None),
                           BlockStored(hs[16:], hs[15], toks[32:], 2, None, "GPU", None)], 0),
        KVEventBatch(2.0, [BlockStored(hs[:8], None, [], 0, None, "CPU", None)], 0),
        KVEventBatch(3.0, [BlockStored(hs[8:12], None, [], 0, None, "CPU", None),
                           BlockRemoved(hs[20:], "GPU")], 0),
    ]


def test_payloads_take_the_fast_path_and_answer_as_apply(monkeypatch):
    import consumers.nativeingest as ni

    slow, fast = KVRouter(model="m", block_size=2), KVRouter(model="m", block_size=2)
    left = []  # what C left to Python, per batch (None: nothing)
    ing = fast.ingestor
    assert isinstance(ing, NativeIngestor)
    real = ing._finish

    def spy(pod, payload, model, strict, ctxs, out):
        left.append(out[0])
        return real(pod, payload, model, strict, ctxs, out)

    def whole(payload):
        raise AssertionError("the whole batch decoded again")

    ing._finish = spy
    rests = []  # (events left, bytes decoded) of each batch C stopped in
    real_rest = ni._rest_events
    monkeypatch.setattr(ni, "_rest_events", lambda p, n, a, b: rests.append((n, b - a)) or real_rest(p, n, a, b))
    monkeypatch.setattr(ni, "decode_batch", whole)
    for b in _stream():
        n = len(left)
        slow.apply("p", b)
        fast.apply_payload("p", encode_batch(b))
        if len(left) == n:
            left.append(None)
    assert state(fast) == state(slow)
    # the GPU batch runs in C entirely (status 0: all applied; Python only records the block size
    # it taught; its endpoint's context, stale at first, is built from C without a second parse:
    # no status 4); the first offload batch's chunk length is inferred in Python (status 1: the
    # rest of the batch, only its own bytes decoded), after which offload joins and removals run
    # in C with nothing left over
    assert left == [0, 1, None]
    # (its one event: the payload less the array header, the float ts, the events' array header
    # and the rank)
    assert rests == [(1, len(encode_batch(_stream()[1])) - 1 - 9 - 1 - 1)]
    assert fast.stats.blocks_stored == 32 and fast.stats.offload_blocks == 12 and fast.stats.blocks_removed == 12
    assert isinstance(fast.apply_payload, functools.partial)  # the C front half: no Python frame per batch


@pytest.mark.parametrize("cut", [1, 5, 17, -3, -1])
def test_a_malformed_payload_raises_decode_error_and_changes_nothing(cut):
    r = KVRouter(model="m", block_size=2)
    b0, b1, _ = _stream()
    r.apply_payload("p", encode_batch(b0))
    before = state(r)
    with pytest.raises(DecodeError):
        r.apply_payload("p", encode_batch(b1)[:cut])
    assert state(r) == before
    with pytest.raises(DecodeError):
        r.apply_payload("p", encode_batch(b1) + b"\x00")  # trailing bytes
    assert state(r) == before


def test_legacy_encoding_and_bytes_hashes_go_through_python_with_the_same_result():
    slow, fast = KVRouter(model="m", block_size=2), KVRouter(model="m", block_size=2)
    for b in _stream():
        slow.apply("p", b)
        fast.apply_payload("p", encode_batch(b, legacy=True))
    assert state(fast) == state(slow)
    b = KVEventBatch(0.0, [BlockStored([b"\x01" * 32], None, [1, 2], 2, None, "GPU", None)], 0)
    slow.apply("q", b)
    fast.apply_payload("q", encode_batch(b))
    assert state(fast) == state(slow)


def test_pure_python_fallback_gives_the_same_state(monkeypatch):
    slow = KVRouter(model="m", block_size=2, index="python")
    fast = KVRouter(model="m", block_size=2, index="python")
    assert not isinstance(fast.ingestor, NativeIngestor)
    for b in _stream():
        slow.apply("p", b)
        fast.apply_payload("p", encode_batch(b))
    assert state(fast) == state(slow)


def test_c_chain_keys_equal_the_python_chain_on_every_int_hash_case():
    from consumers import _fastpath

    probe = _accel._PROBE * 3
    for bs in (1, 2, 5, 16):
        for parent in (0, 1, 2**60 - 1, 2**61 + 3, -5):
            assert _fastpath.chain_keys(probe, parent, bs) == chain_keys_py(probe, parent, bs)
    assert _fastpath.chain_keys((1, 2, 3, 4), 7, 2) == chain_keys_py([1, 2, 3, 4], 7, 2)
    # past 64 blocks the keys go through a heap buffer instead of the stack one
    long = list(range(-3000, 3000, 3)) * 2
    for n in (64 * 16, 65 * 16 + 3, len(long)):
        assert _fastpath.chain_keys(long[:n], 9, 16) == chain_keys_py(long[:n], 9, 16)
    with pytest.raises(TypeError):
        _fastpath.chain_keys([1] * 2000 + [[2]], 0, 1)  # an unhashable token, heap path
    with pytest.raises(ValueError, match="block_size must be > 0"):
        _fastpath.chain_keys([1], 0, 0)
    with pytest.raises(TypeError):
        _fastpath.chain_keys(5, 0, 2)


def test_the_extension_is_refused_when_it_disagrees_with_python():
    class Wrong:
        @staticmethod
        def chain_keys(tokens, parent, bs):
            return [0] * (len(tokens) // bs)

    assert "chain_keys differs" in _accel._self_check(Wrong, chain_keys_py)


def test_pure_python_can_be_forced_and_status_says_so():
    code = "from consumers import _accel, keys; print(keys._FAST is None, '|', _accel.status())"
    env = dict(os.environ, KVEVENTS_PURE_PYTHON="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("True |") and "disabled by KVEVENTS_PURE_PYTHON" in out.stdout


@st.composite
def index_ops(draw):
    keys = st.integers(0, 40)
    op = st.one_of(
        st.tuples(st.just("chain"), st.lists(keys, min_size=1, max_size=6, unique=True), st.integers(0, 5),
                  st.integers(0, 3), st.none() | keys),
        st.tuples(st.just("add"), st.lists(keys, max_size=6), st.integers(0, 5), st.integers(0, 3), st.none()),
        st.tuples(st.just("remove"), st.lists(keys, max_size=6), st.integers(0, 5), st.integers(0, 3), st.none()),
        st.tuples(st.just("clear"), st.just([]), st.integers(0, 5), st.just(0), st.none()),
        st.tuples(st.just("grow"), st.just([]), st.just(0), st.just(0), st.none()),
    )
    return draw(st.lists(op, min_size=1, max_size=40)), draw(st.sampled_from([1 << 20, 30, 9]))


@settings(max_examples=300, deadline=None)
@given(sc=index_ops())
def test_the_c_mask_table_index_behaves_as_the_dict_index(sc):
    from consumers.maskindex import BlockIndex
    from consumers.nativeindex import NativeBlockIndex

    ops, budget = sc
    a = BlockIndex(budget, cap=4, max_tiers=4)
    b = NativeBlockIndex(budget, cap=4, max_tiers=4, table=keys_mod._FAST.MaskTable)
    for kind, keys, slot, tier, parent in ops:
        for idx in (a, b):
            slot_ = slot % idx.cap
            if kind == "chain":
                idx.store(slot_, tier, keys, parent)
            elif kind == "add":
                idx.store(slot_, tier, keys, chain=False)
            elif kind == "remove":
                idx.remove(slot_, tier, keys)
            elif kind == "clear":
                idx.clear(slot_)
            elif idx.cap < 16:
                idx.grow(idx.cap * 2)
        assert list(b.masks.items()) == list(a.masks.items())
        assert list(b.masks) == list(a.masks) and len(b.masks) == len(a.masks)
        assert b.parents == a.parents
        assert (b.entries, b.evicted_keys, b.evicted_entries, b.cap) == (a.entries, a.evicted_keys, a.evicted_entries, a.cap)
        assert b.lane_counts(4) == a.lane_counts(4)
        assert b.entries == b.masks.bit_count()
        for k in range(0, 42, 5):
            assert b.masks.get(k, -1) == a.masks.get(k, -1) and (k in b.masks) == (k in a.masks)
        assert b.walk_back(7, 4) == a.walk_back(7, 4)


def test_mask_table_errors_are_clear():
    table = keys_mod._FAST.MaskTable(bits=8)
    with pytest.raises(ValueError, match=r"bit 64 out of range \[0, 64\)"):  # one 64-bit word per mask
        table.set_bit([1], 64)
    with pytest.raises(ValueError, match="a key must be an int"):
        table.set_bit([-1], 0)
    with pytest.raises(KeyError):
        table[5]
    assert table.get(5) is None and table.get("x", 0) == 0 and "x" not in table
    with pytest.raises(ValueError, match="bits must be in"):
        keys_mod._FAST.MaskTable(bits=0)
    assert table.set_bit([3, 4, 3], 2) == 2 and table.items() == [(4, 4), (3, 4)]  # 3 moved to the newest end
    big = keys_mod._FAST.MaskTable(bits=300)
    big.set_bit([9], 299)
    assert big[9] == 1 << 299 and big.values() == [1 << 299]


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(st.tuples(
    st.sampled_from(["set", "set", "set", "del", "update", "get"]),
    st.one_of(st.integers(0, 30), st.integers(2**64 - 3, 2**64 - 1), st.sampled_from([-1, b"k", 2**64])),
    st.one_of(st.integers(0, 2**64 - 1), st.tuples(st.integers(0, 5), st.just(()), st.integers(0, 3)), st.just(-7)),
), max_size=60))
def test_the_learned_table_behaves_as_a_dict(ops):
    t, d = keys_mod._FAST.LearnedTable(), {}
    for op, k, v in ops:
        if op == "set":
            t[k] = v
            d[k] = v
        elif op == "del":
            if k in d:
                del t[k]
                del d[k]
            else:
                with pytest.raises(KeyError):
                    del t[k]
        elif op == "update":
            t.update([(k, v), (5, 6)])
            d.update([(k, v), (5, 6)])
        assert t.get(k, "none") == d.get(k, "none") and (k in t) == (k in d)
        assert list(t.items()) == list(d.items()) and len(t) == len(d) and list(t) == list(d)
        assert t.oldest(3) == list(d)[:3]
    assert t.is_dict() == any(not (type(k) is int and 0 <= k < 2**64) for op, k, _v in ops if op in ("set", "update"))


def _valid_payloads():
    toks = list(range(100, 164))
    hs = [ehash(2, toks[: (i + 1) * 2]) for i in range(32)]
    return [encode_batch(b) for b in _stream()] + [
        encode_batch(KVEventBatch(1.5, [BlockStored(hs[:2], None, toks[:4], 2, None, "GPU", None, group_idx=0,
                                                    extra_keys=[1, "a", [2.5, None]], locality="x"),
                                        BlockRemoved(hs[:1], None), AllBlocksCleared()], None)),
    ]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.integers(0, 3), edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255),
                                                          st.sampled_from(["set", "insert", "delete"])),
                                                min_size=1, max_size=4), cut=st.none() | st.integers(0, 10_000))
def test_mutated_payloads_are_read_as_the_python_decoder_reads_them(which, edits, cut):
    """The C parser on corrupted payloads: never a crash; a DecodeError exactly where
    ``decode_batch`` raises one, and otherwise the same resulting state."""
    from kvevents import decode_batch

    p = bytearray(_valid_payloads()[which])
    for pos, byte, op in edits:
        i = pos % (len(p) + 1)
        if op == "set" and i < len(p):
            p[i] = byte
        elif op == "insert":
            p[i:i] = bytes([byte])
        elif op == "delete" and i < len(p):
            del p[i]
    if cut is not None:
        p = p[: cut % (len(p) + 1)]
    payload = bytes(p)
    slow, fast = KVRouter(model="m", block_size=2), KVRouter(model="m", block_size=2)
    try:
        batch = decode_batch(payload)
    except DecodeError:
        with pytest.raises(DecodeError):
            fast.apply_payload("p", payload)
        return
    try:
        slow.apply("p", batch)
    except Exception as exc:  # e.g. a value the router refuses: both must refuse it alike
        with pytest.raises(type(exc)):
            fast.apply_payload("p", payload)
        return
    fast.apply_payload("p", payload)
    assert state(fast) == state(slow)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenario())
def test_the_native_and_the_python_ingestor_leave_the_same_state_through_one_interface(sc):
    """The same calls on the Ingestor interface (apply_payload, reset, remove) to a
    NativeIngestor and to the pure-Python Ingestor, both over the native index."""
    import consumers.router as router_mod
    from consumers.ingest import Ingestor

    batches, config = sc
    fast = KVRouter(RouterConfig(**config))
    saved = router_mod.available
    router_mod.available = lambda *a: False  # (this router's ingestor: the pure-Python one)
    try:
        slow = KVRouter(RouterConfig(**config))
    finally:
        router_mod.available = saved
    assert type(slow.ingestor) is Ingestor and isinstance(fast.ingestor, NativeIngestor)
    assert type(slow.index) is type(fast.index)
    for pod, action, batch in batches:
        for r in (slow, fast):
            if action == "reset":
                r.reset_pod(pod)
            elif action == "remove_pod":
                r.remove_pod(pod)
            r.ingestor.apply_payload(pod, encode_batch(batch))
        assert state(fast) == state(slow), batch
