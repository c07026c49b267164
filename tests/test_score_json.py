"""The service's hot route in C (consumers/_fp_json_request.h, _fp_score_answer.h) gives the Python route's answers.

* ``Scorer.score_json`` (walk + per-pod Scores + sort + JSON in one C call) against
  ``KVRouter.score`` + the API's sort + msgspec's encoding: the same bytes (floats included),
  and the same counters;
* ``json_request`` (the body reader) against msgspec's ``ScoreRequest`` + ``token_ids_of``:
  where it answers, the same model, lora_name and token ids; where msgspec refuses a body, it
  answers None (so msgspec's error, naming the field, is what the client gets).
"""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumers import KVRouter, RouterConfig
from consumers.keys import _FAST, json_request
from kvevents import BlockRemoved, BlockStored, KVEventBatch
from kvservice.schema import ApiError, ScoreRequest, decode, token_ids_of

pytestmark = pytest.mark.skipif(_FAST is None,
                                reason="the C extension is not in use")

PODS = ["pod0", 'po"d1', "pöd2", "p\\od3", "pod4", "a"]  # quotes, backslashes, UTF-8 in names


def _answer(router: KVRouter, prompt, model: str = "m", load=None) -> bytes:
    """What the Python reference writes: score()'s Scores sorted and encoded by msgspec."""
    scores = router.score(prompt, None, model=model, load=load)
    pods = sorted(scores.values(), key=lambda s: (-s.total, s.load, s.pod))
    return msgspec.json.encode({"model": model, "prompt_tokens": len(prompt), "pick": pods[0].pod if pods else None,
                                "pods": pods})


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_score_json_writes_what_score_and_msgspec_write(data):
    kw = {"load_weight": data.draw(st.sampled_from([0.0, 0, 0.5, 2])),
          "tier_weights": {"GPU": data.draw(st.sampled_from([1.0, 1, 0.3])), "CPU": data.draw(st.sampled_from([0.5, 2]))},
          "state_factors": {"SYNCED": data.draw(st.sampled_from([1.0, 1, 0.7]))}}
    routers = [KVRouter(RouterConfig(model="m", index="native", block_size=4, **kw)) for _ in range(2)]
    docs = [data.draw(st.lists(st.integers(0, 50), min_size=4, max_size=40)) for _ in range(3)]
    hashes = [[(d * 1000 + i) * 7919 + 1 for i in range(len(doc) // 4)] for d, doc in enumerate(docs)]
    for _ in range(data.draw(st.integers(0, 12))):
        name, rank = data.draw(st.sampled_from(PODS)), data.draw(st.integers(0, 1))
        d = data.draw(st.integers(0, 2))
        n = data.draw(st.integers(1, max(1, len(hashes[d]))))
        kind = data.draw(st.sampled_from(["gpu", "cpu", "remove"]))
        if kind == "gpu":
            ev = BlockStored(hashes[d][:n], None, docs[d][: n * 4], 4, None, "GPU", None)
        elif kind == "cpu":
            ev = BlockStored(hashes[d][:n], None, [], 0, None, "CPU", None)
        else:
            ev = BlockRemoved(hashes[d][n - 1:n], data.draw(st.sampled_from(["GPU", "CPU"])))
        for r in routers:
            r.apply(name, KVEventBatch(0.0, [ev], rank))
    prompt = data.draw(st.sampled_from(docs))[: data.draw(st.integers(0, 40))] + data.draw(
        st.lists(st.integers(0, 50), max_size=8))
    load = data.draw(st.none() | st.dictionaries(st.sampled_from(PODS + ["other"]), st.one_of(
        st.floats(-4, 4, allow_nan=False), st.integers(-3, 3), st.sampled_from([0.0, -0.0, 1e-7, 2.5e20])), max_size=4))
    got = routers[0].scorer.score_json(prompt, None, model="m", load=load)
    want = _answer(routers[1], prompt, load=load)
    assert got == want
    assert json.loads(got)["pick"] == routers[1].pick(prompt, load=load)
    s0, s1 = routers[0].stats, routers[1].stats  # routers[1]: score() and pick(), one lookup each
    routers[0].score(prompt, load=load)  # now one score_json and one score(): the same counters
    assert (s0.lookups, s0.prompt_tokens, s0.matched_tokens) == (s1.lookups, s1.prompt_tokens, s1.matched_tokens)


@pytest.mark.parametrize("factor", [1, True, 0.5, 3])
def test_score_json_writes_any_configured_factor_as_msgspec_does(factor):
    """A state factor configured as an int (or a bool: RouterConfig takes any number) stays one
    in the Score: the C answer writes it as msgspec does, with the same totals."""
    routers = [KVRouter(RouterConfig(model="m", index="native", block_size=4, state_factors={"SYNCED": factor}))
               for _ in range(2)]
    for r in routers:
        r.apply("a", KVEventBatch(0.0, [BlockStored([1], None, [1, 2, 3, 4], 4, None, "GPU", None)], 0))
        r.apply("b", KVEventBatch(0.0, [BlockStored([2], None, [1, 2, 3, 5], 4, None, "GPU", None)], 0))
    for prompt in ([1, 2, 3, 4], [1, 2, 3, 4, 9, 9, 9, 9, 9]):
        assert routers[0].scorer.score_json(prompt, None, model="m") == _answer(routers[1], prompt)


def test_score_json_is_the_native_index_capability():
    """Without the native index (no C table to walk) there is no C answer: None, and the
    caller encodes score()'s Scores."""
    py = KVRouter(RouterConfig(model="m", index="python", block_size=4))
    assert py.scorer.score_json([1, 2, 3, 4], None, model="m") is None


def _msgspec_reads(body: bytes):
    """(model, lora_name, token ids) as the msgspec route reads them, or None where it refuses
    or would take another path (prompt/messages/load)."""
    try:
        req = decode(body, ScoreRequest)
        toks = token_ids_of(req)
    except ApiError:
        return None
    if req.prompt is not None or req.messages is not None or req.load is not None or not toks:
        return None
    return req.model, req.lora_name, list(toks)


NAME = st.one_of(st.none(), st.text(max_size=6), st.sampled_from(["m", "a\\b", 'q"', "é", "\x01"]))
TOKENS = st.lists(st.one_of(st.integers(0, 9), st.integers(0, 2**32 - 1), st.integers(-3, 2**33)), max_size=12)


@settings(max_examples=400, deadline=None)
@given(fields=st.dictionaries(st.sampled_from(["model", "lora_name", "token_ids", "prompt", "load", "extra"]),
                              st.one_of(NAME, TOKENS), max_size=4),
       seps=st.sampled_from([(",", ":"), (", ", ": "), (" ,\n", " :\t")]), pad=st.sampled_from(["", " ", "\n"]),
       ascii_=st.booleans())
def test_json_request_reads_what_msgspec_reads(fields, seps, pad, ascii_):
    body = (pad + json.dumps(fields, separators=seps, ensure_ascii=ascii_) + pad).encode()
    got = json_request(body)
    want = _msgspec_reads(body)
    if got is not None:
        assert want is not None and (got[0], got[1], list(got[2])) == want
    elif want is not None:  # refused: only for text it does not read itself (escapes, other keys)
        assert b"\\" in body or set(fields) - {"model", "lora_name", "token_ids"}


@pytest.mark.parametrize("body", [b'{"token_ids":[01]}', b'{"token_ids":[]}', b'{"token_ids":[1],"token_ids":[2]}',
                                  b'{"token_ids":[1]} x', b'{"token_ids":[1.0]}', b'{"token_ids":[-1]}',
                                  b'{"token_ids":[1,]}', b'{"token_ids":[4294967296]}', b'{"model":"\xff",'
                                  b'"token_ids":[1]}', b'{"model":1,"token_ids":[1]}', b'{"token_ids":null}',
                                  b'[1]', b'', b'{"token_ids":[1]', b'{"model":"a\nb","token_ids":[1]}',
                                  b'{"token_ids":[00000001, 2]}', b'{"token_ids":[0123456, 2]}',
                                  b'{"token_ids":[1234567e1, 2]}', b'{"token_ids":[4294967296, 2, 3, 4]}'])
def test_json_request_leaves_everything_else_to_msgspec(body):
    assert json_request(body) is None


@pytest.mark.parametrize("width", range(1, 11))
def test_json_request_reads_every_digit_count(width):
    """Numbers of 1 to 10 digits (read 8 bytes at a time where 8 bytes are left, else byte by
    byte), at the start, in the middle and at the end of the array, every separator spacing."""
    big = min(10**width - 1, 2**32 - 1)
    for toks in ([big], [big, 7, big], [10 ** (width - 1), big, 0], [3] * 9 + [big]):
        for sep in (",", ", ", " ,  "):
            body = ('{"token_ids": [' + sep.join(map(str, toks)) + "]}").encode()
            assert list(json_request(body)[2]) == toks, body


@pytest.mark.parametrize("weight", [1e-5, 3.3e-6, 1.5e-20, 7e-5, 1e-4, 2e17, 1e22, 12345678.9, 1e300])
def test_score_json_writes_floats_as_msgspec_does(weight):
    """msgspec writes a float's shortest digits like repr, but in fixed notation down to a
    decimal exponent of -5 (0.00001, where repr writes 1e-05) and without '+' or leading zeros
    in an exponent (1e22, 1.5e-20): the C writer's totals are msgspec's bytes at every scale."""
    routers = [KVRouter(RouterConfig(model="m", index="native", block_size=4, tier_weights={"GPU": weight, "CPU": 0.5}))
               for _ in range(2)]
    for r in routers:
        for i, name in enumerate(["a", "b\n", "c\x01"]):  # names msgspec escapes (\n, \u0001)
            r.apply(name, KVEventBatch(0.0, [BlockStored([1, 2, 3][: i + 1], None, list(range(4 * (i + 1))), 4, None,
                                                         "GPU", None)], 0))
    for prompt in (list(range(12)), list(range(12)) + [7] * 29, list(range(4)) + [9] * 400):
        got = routers[0].scorer.score_json(prompt, None, model="m")
        assert got == _answer(routers[1], prompt)
        assert json.loads(got)["pods"][0]["total"] == routers[1].score(prompt)[json.loads(got)["pick"]].total
