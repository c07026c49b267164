"""The score's C path (consumers/_fp_score.h) gives the Python path's answers, bit for bit.

* ``score_walk`` (hash the token blocks + the staged walk over the native MaskTable, one C
  call) against ``chain_keys_py`` + :func:`consumers.score.walk` over the same masks, for
  token lists, tuples and int buffers of every accepted width;
* a whole router with the ``"native"`` index against one with the ``"python"`` index, fed the
  same events: the same scores (tiers, totals, matched tokens, ranks);
* ``json_tokens`` (the API's token_ids reader) against msgspec's typed decoder: the same ints
  where it answers, None (msgspec decides, naming the error) for everything else.
"""

from __future__ import annotations

import json
from array import array

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumers import KVRouter, RouterConfig
from consumers.keys import _FAST, chain_keys_py, json_tokens
from consumers.score import walk
from kvevents import BlockRemoved, BlockStored, KVEventBatch

pytestmark = pytest.mark.skipif(_FAST is None or not hasattr(_FAST, "score_walk"),
                                reason="the C extension is not in use")

TOKEN = st.integers(0, 2**32 - 1)


def _tables(cap: int, tiers: int):
    bits = cap * tiers
    return _FAST.MaskTable(bits=max(64, -(-bits // 64) * 64)), {}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), cap=st.sampled_from([2, 8, 64, 96, 128]), tiers=st.integers(0, 4),
       bs=st.sampled_from([1, 2, 4, 16]), parent=st.integers(0, 2**60 - 1))
def test_score_walk_matches_chain_keys_and_walk(data, cap, tiers, bs, parent):
    base = data.draw(st.lists(TOKEN, min_size=0, max_size=12 * bs))
    keys = chain_keys_py(base, parent, bs)
    table, masks = _tables(cap, tiers)
    # index a random subset of the prompt's keys (and strangers) in random (tier, slot) lanes
    for k in keys + [data.draw(st.integers(0, 2**60 - 1))]:
        for _ in range(data.draw(st.integers(0, 3))):
            if tiers:
                b = data.draw(st.integers(0, tiers - 1)) * cap + data.draw(st.integers(0, cap - 1))
                table.set_bit([k], b)
                masks[k] = masks.get(k, 0) | 1 << b
    # the prompt: the indexed prefix, cut anywhere, then maybe other tokens
    cut = data.draw(st.integers(0, len(base)))
    prompt = base[:cut] + data.draw(st.lists(TOKEN, max_size=3 * bs))
    lanes = [(t * cap, (1 << cap) - 1) for t in data.draw(st.permutations(range(tiers)))]
    start = data.draw(st.integers(0, (1 << cap) - 1))
    pkeys = chain_keys_py(prompt, parent, bs)
    want = (len(pkeys), *walk(masks.get, pkeys, lanes, start))
    for toks in (prompt, tuple(prompt), array("I", prompt), array("q", prompt), array("Q", prompt)):
        assert _FAST.score_walk(table, toks, parent, bs, lanes, start) == want, type(toks)


@given(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=40), st.integers(0, 2**60 - 1))
@settings(max_examples=100, deadline=None)
def test_score_walk_signed_buffers_hash_like_python_ints(tokens, parent):
    table = _FAST.MaskTable(bits=64)
    keys = chain_keys_py(tokens, parent, 4)
    table.set_bit(keys, 0)
    want = (len(keys), *walk({k: 1 for k in keys}.get, keys, [(0, 1)], 1))
    assert _FAST.score_walk(table, array("q", tokens), parent, 4, [(0, 1)], 1) == want
    assert _FAST.score_walk(table, tokens, parent, 4, [(0, 1)], 1) == want


def test_score_walk_refuses_what_it_cannot_read():
    table = _FAST.MaskTable(bits=64)
    with pytest.raises(TypeError, match="tokens"):
        _FAST.score_walk(table, array("d", [1.0]), 0, 1, [(0, 1)], 1)
    with pytest.raises(TypeError, match="MaskTable"):
        _FAST.score_walk({}, [1], 0, 1, [(0, 1)], 1)
    with pytest.raises(ValueError, match="block_size"):
        _FAST.score_walk(table, [1], 0, 0, [(0, 1)], 1)
    with pytest.raises(TypeError):
        _FAST.score_walk(table, [1, []], 0, 1, [(0, 1)], 1)  # unhashable, as in chain_keys


def _router(index: str, **kw) -> KVRouter:
    return KVRouter(RouterConfig(model="m", index=index, block_size=4, **kw))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_native_and_python_routers_score_alike(data):
    """score_pods (walk + per-pod Scores + the pick in C) against the Python loop: the same
    Scores, float for float, ranks folded per pod, and the same pick counted."""
    kw = {"load_weight": data.draw(st.sampled_from([0.0, 0, 0.5, 2])),  # an int 0 and 0.0: never a -0.0 total
          "tier_weights": {"GPU": data.draw(st.sampled_from([1.0, 1, 0.3])), "CPU": data.draw(st.sampled_from([0.5, 2]))},
          "state_factors": {"SYNCED": data.draw(st.sampled_from([1.0, 1, 0.7]))}}
    routers = [_router("native", **kw), _router("python", **kw)]
    docs = [data.draw(st.lists(st.integers(0, 50), min_size=4, max_size=40)) for _ in range(3)]
    hashes = [[(d * 1000 + i) * 7919 + 1 for i in range(len(doc) // 4)] for d, doc in enumerate(docs)]
    for _ in range(data.draw(st.integers(1, 12))):
        pod = f"pod{data.draw(st.integers(0, 5))}@r{data.draw(st.integers(0, 1))}"
        d = data.draw(st.integers(0, 2))
        n = data.draw(st.integers(1, max(1, len(hashes[d]))))
        kind = data.draw(st.sampled_from(["gpu", "cpu", "remove"]))
        if kind == "gpu":
            ev = BlockStored(hashes[d][:n], None, docs[d][: n * 4], 4, None, "GPU", None)
        elif kind == "cpu":
            ev = BlockStored(hashes[d][:n], None, [], 0, None, "CPU", None)
        else:
            ev = BlockRemoved(hashes[d][n - 1:n], data.draw(st.sampled_from(["GPU", "CPU"])))
        name, _, rank = pod.partition("@r")
        for r in routers:
            r.apply(name, KVEventBatch(0.0, [ev], int(rank)))
    prompt = data.draw(st.sampled_from(docs))[: data.draw(st.integers(0, 40))] + data.draw(
        st.lists(st.integers(0, 50), max_size=8))
    load = data.draw(st.none() | st.dictionaries(st.sampled_from([f"pod{i}" for i in range(6)]),
                                                 st.floats(0, 4, allow_nan=False), max_size=3))
    native, python = (r.score(prompt, load=load) for r in routers)
    assert native == python
    assert [(s.pod, repr(s.total), repr(s.factor), repr(s.load)) for s in native.values()] == \
        [(s.pod, repr(s.total), repr(s.factor), repr(s.load)) for s in python.values()]  # -0.0, 1 vs 1.0
    assert routers[0].stats.matched_tokens == routers[1].stats.matched_tokens
    assert routers[0].score(array("I", prompt), load=load) == python  # the API's token_ids
    assert routers[0].pick(prompt, load=load) == routers[1].pick(prompt, load=load)


@given(st.lists(st.one_of(st.integers(0, 9), st.integers(0, 99_999_999), TOKEN), max_size=60),
       st.sampled_from([",", ", ", " ,\n "]), st.sampled_from(["", " ", "\n\t"]))
def test_json_tokens_reads_what_msgspec_reads(tokens, sep, pad):
    raw = (pad + "[" + pad + sep.join(map(str, tokens)) + pad + "]" + pad).encode()
    assert json_tokens(raw) == array("I", msgspec.json.decode(raw, type=list[int]))


@pytest.mark.parametrize("text", ["[-1]", "[1.0]", "[1e3]", "[4294967296]", "[99999999999]", '["1"]', "[null]",
                                  "[1, 2, 3, 4.5, 6, 7]", "[1, 2, 3, 4, 1234567e1, 8]", "[1, 2, 3, 12345678901]",
                                  "[1, 2, 3, 4, -5, 6, 7, 8, 9]", '[1, 2, 3, "4", 5, 6, 7, 8]',
                                  "{}", '"abc"', "null", "[[1]]", "[1,]", "[1 2]", "[1] x", ""])
def test_json_tokens_leaves_everything_else_to_msgspec(text):
    assert json_tokens(text.encode()) is None


def test_json_tokens_edges():
    assert json_tokens(b" [ ] ") == array("I")
    assert json_tokens(b"[0,4294967295]") == array("I", [0, 2**32 - 1])
    big = list(range(5000))  # past the reader's stack buffer
    assert json_tokens(json.dumps(big).encode()) == array("I", big)
