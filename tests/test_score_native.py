"""The score's C path (consumers/_fp_score_*.h) gives the Python reference's answers, bit for bit.

* ``KVRouter.score`` over the ``"native"`` index (``score_pods``: hash the token blocks, the
  staged walk over the MaskTable, every pod's Score and the pick, one C call) against one with
  the ``"python"`` index and against ``Scorer.score_py`` (the Python reference) on the same
  router, fed the same events: the same scores (tiers, totals, matched tokens, ranks), for
  token lists, tuples and int buffers of every accepted width;
* the layouts past the walk's stack buffers: over 1,024 endpoint slots and the most tiers;
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
from consumers.keys import _FAST, json_tokens
from consumers.router_config import MAX_TIERS
from kvevents import BlockRemoved, BlockStored, KVEventBatch
from kvevents.errors import ConfigError

pytestmark = pytest.mark.skipif(_FAST is None, reason="the C extension is not in use")

TOKEN = st.integers(0, 2**32 - 1)


@given(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=40), st.integers(0, 40), st.sampled_from([1, 4, 16]))
@settings(max_examples=100, deadline=None)
def test_score_hashes_every_buffer_width_like_python_ints(tokens, cut, bs):
    """The prompt's keys from a list, a tuple or a buffer of 4/8-byte ints (signed or not)
    are the keys the ingest learned from the same token ids: the same match as score_py's."""
    r = KVRouter(RouterConfig(model="m", index="native", block_size=bs))
    r.apply("a", KVEventBatch(0.0, [BlockStored(list(range(1, len(tokens) // bs + 1)), None, tokens[: len(tokens) // bs * bs],
                                                bs, None, "GPU", None)], 0))
    prompt = tokens[:cut]
    want = r.scorer.score_py(prompt)
    assert want["a"].matched_tokens == len(prompt) // bs * bs
    kinds = [tuple, lambda t: array("q", t)]
    if all(t >= 0 for t in prompt):
        kinds.append(lambda t: array("Q", t))
        if all(t < 2**32 for t in prompt):
            kinds += [lambda t: array("I", t), lambda t: memoryview(array("I", t).tobytes()).cast("I")]
    if all(-(2**31) <= t < 2**31 for t in prompt):
        kinds.append(lambda t: array("i", t))
    for kind in [list] + kinds:
        assert r.score(kind(prompt)) == want, kind


def test_score_refuses_what_it_cannot_read():
    r = KVRouter(RouterConfig(model="m", index="native", block_size=1))
    r.apply("a", KVEventBatch(0.0, [BlockStored([1], None, [1], 1, None, "GPU", None)], 0))
    with pytest.raises(TypeError, match="tokens"):
        r.score(array("d", [1.0]))
    with pytest.raises(TypeError):
        r.score([1, []])  # unhashable, as in chain_keys
    with pytest.raises(TypeError):
        r.scorer.score_py([1, []])


def test_the_walk_takes_every_tier_the_config_allows():
    """MAX_TIERS (RouterConfig.max_tiers' bound, validated at start-up) is the C walk's stage
    count: no configuration reaches a walk the C path cannot take."""
    assert _FAST.MAX_STAGES == MAX_TIERS
    with pytest.raises(ConfigError, match="max_tiers"):
        RouterConfig(max_tiers=MAX_TIERS + 1)


class _NoMatch:
    """The Index role, with match (the Python walk's) refused."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def match(self, *args):
        raise AssertionError("the score took the Python walk")

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_score_past_the_walks_stack_layout():
    """Over 1,024 endpoint slots (the slot sets' words on the heap) and MAX_TIERS tiers (masks
    of 2,048 x 16 bits, far past 64 words): the C path answers every such layout, as the Python
    reference does."""
    kw = {"model": "m", "block_size": 2, "max_tiers": MAX_TIERS, "max_pods": 700,
          "tier_weights": {"GPU": 1.0, "CPU": 0.5, "DISK": 0.25, "T15": 0.1}}
    routers = [KVRouter(RouterConfig(index="native", **kw)), KVRouter(RouterConfig(index="python", **kw))]
    doc = list(range(40))
    hashes = list(range(1, 21))
    media = ["GPU", "CPU", "DISK"] + [f"T{i}" for i in range(3, MAX_TIERS)]
    for p in range(600):
        for rank in (0, 1):
            n = 1 + (p * 7 + rank) % 20
            medium = media[(p + rank) % len(media)]
            evs = [BlockStored(hashes[:n], None, doc[: 2 * n], 2, None, "GPU", None)]
            if medium != "GPU":
                evs.append(BlockStored(hashes[: max(1, n // 2)], None, [], 0, None, medium, None))
                evs.append(BlockRemoved(hashes[: max(1, n // 3)], "GPU"))
            for r in routers:
                r.apply(f"pod{p}", KVEventBatch(0.0, evs, rank))
    native = routers[0]
    assert native.scorer._accel.cap > 1024
    role = native.scorer.index
    for prompt in (doc, doc[:17], doc[:6] + [99] * 10, [5, 6]):
        want = routers[1].score(prompt)
        assert native.scorer.score_py(prompt) == want
        native.scorer.index = _NoMatch(role)  # the C path walks the table, never the role
        try:
            assert native.score(prompt) == want
        finally:
            native.scorer.index = role
        assert native.pick(prompt) == routers[1].pick(prompt)
        got = json.loads(native.scorer.score_json(prompt))
        assert got["pick"] == routers[1].pick(prompt) and len(got["pods"]) == len(want)


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
    assert routers[0].scorer.score_py(prompt, load=load) == python  # the reference, on the native router
    if load:  # any Mapping (not only a dict) takes the same C call
        from types import MappingProxyType

        assert routers[0].score(prompt, load=MappingProxyType(load)) == python
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
