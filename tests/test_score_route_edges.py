"""The fast /v1/score route (``Api.fast_answer``: the C body reader, C scoring, C answer) on
hostile and long bodies, and against the pure-Python route.

* The body reader (``json_request``) on prompt-sized arrays with every separator spacing and
  one defect planted anywhere (a number of 2**32 or more, a sign, a fraction, an exponent, a
  leading zero, a string, null, a nested array, a missing or extra comma, a cut-off body):
  where it answers, what msgspec reads; where msgspec refuses, it refuses.
* Hostile bodies through ``Api.fast_answer`` give the API's 4xx naming the field, never
  anything else (the fast HTTP path hands an exception to aiohttp, which answers it).
* The same fleet and bodies in a process with ``KVEVENTS_PURE_PYTHON=1`` (no C extension:
  msgspec reads the body, the Python index and scorer score it, msgspec writes the answer):
  the same answer bytes, so the C route cannot drift from the Python one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumers.keys import _FAST, json_request
from .test_score_json import _msgspec_reads

ROOT = Path(__file__).resolve().parents[1]
needs_c = pytest.mark.skipif(_FAST is None, reason="the C extension is not in use")

# builds a fleet (not started: events applied to its router directly) and answers bodies with
# Api.fast_answer; run here and in a KVEVENTS_PURE_PYTHON=1 child on the same input
_CHILD = r'''
import asyncio, json, shutil, sys, tempfile
from kvevents import BlockRemoved, BlockStored, KVEventBatch
from kvservice.api import Api
from kvservice.config import from_dict
from kvservice.ingest import Fleet
from kvservice.schema import ApiError, ScoreRequest, decode, token_ids_of

def answers(spec):
    d = tempfile.mkdtemp(prefix="kv-edges-")  # the fleet's subscriber connects; nothing publishes
    cfg = from_dict({"router": {"model": "m", "block_size": spec["bs"], "tier_weights": spec["weights"]},
                     "api": {"port": 0},
                     "pods": [{"name": n, "endpoint": f"ipc://{d}/p{i}.pub"} for i, n in enumerate(spec["pods"])]})
    fleet = Fleet(cfg.validate())
    try:
        return _answers(spec, fleet)
    finally:
        fleet.stop()
        shutil.rmtree(d, ignore_errors=True)

def _answers(spec, fleet):
    r = fleet.router
    for pod, kind, hashes, toks in spec["events"]:
        ev = (BlockStored(hashes, None, toks, spec["bs"], None, "GPU", None) if kind == "gpu" else
              BlockStored(hashes, None, [], 0, None, "CPU", None) if kind == "cpu" else BlockRemoved(hashes, kind))
        r.apply(pod, KVEventBatch(0.0, [ev], 0))
    api = Api(fleet)
    out = []
    for body in spec["bodies"]:
        try:
            ans = api.fast_answer("/v1/score", body.encode())
            if ans is None:  # handed to aiohttp's route: what it does before scoring
                req = decode(body.encode(), ScoreRequest)
                tids = token_ids_of(req)
                asyncio.run(api.tokens_of(req, api.model_of(req), tids))
            out.append(ans.decode())
        except Exception as exc:  # the error the API answers (ApiError, BadRequest among them: status and field)
            out.append(["ApiError" if isinstance(exc, ApiError) else type(exc).__name__, getattr(exc, "status", None), getattr(exc, "field", None)])
    return out

if __name__ == "__main__":
    from consumers.keys import _FAST
    print(json.dumps({"c_extension": _FAST is not None, "answers": answers(json.load(sys.stdin))}))
'''


def _local_answers(spec: dict) -> list:
    ns: dict = {"__name__": "edges_child"}
    exec(compile(_CHILD, "edges_child", "exec"), ns)
    return ns["answers"](spec)


DEFECTS = ["4294967296", "99999999999", "-1", "-0", "1.5", "1e3", "7E0", "01", "00", '"7"', "null", "[1]", "{}",
           "", " ", "true", "0x1", "1 2", "+1", "\u0661"]


@needs_c
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(toks=st.lists(st.one_of(st.integers(0, 150_000), st.integers(0, 2**32 - 1), st.integers(0, 99)),
                     min_size=1, max_size=400),
       sep=st.sampled_from([",", ", ", " ,", ",\n  ", ",\t", ",  "]),
       defect=st.one_of(st.none(), st.tuples(st.sampled_from(DEFECTS), st.integers(0, 399))),
       cut=st.one_of(st.none(), st.integers(1, 4000)), pad=st.sampled_from(["", " ", "\n"]))
def test_the_reader_on_prompt_sized_arrays_reads_what_msgspec_reads(toks, sep, defect, cut, pad):
    items = [str(t) for t in toks]
    if defect is not None:
        items[defect[1] % len(items)] = defect[0]
    body = (pad + '{"model": "m", "token_ids": [' + sep.join(items) + "]}" + pad).encode()
    if cut is not None:
        body = body[: max(0, len(body) - cut)]
    got = json_request(body)
    want = _msgspec_reads(body)
    if got is None:  # refused: msgspec refuses it too, or it is a shape left to msgspec ("-0")
        assert want is None or (defect is not None and defect[0] == "-0"), body[:200]
    else:
        assert want is not None, body[:200]
        assert (got[0], got[1], list(got[2])) == want
        assert got[2].format == "I" and len(got[2]) == len(want[2])


@needs_c
@pytest.mark.parametrize("width", range(1, 11))
@pytest.mark.parametrize("sep", [",", ", "])
def test_the_reader_at_every_width_in_a_long_array(width, sep):
    """Numbers of 1 to 10 digits mixed into 300 (the 8-bytes-at-a-time path, and the byte loop
    it hands long numbers, zeros and the end to)."""
    big = min(10**width - 1, 2**32 - 1)
    toks = [(i * 7919) % 150_000 for i in range(300)]
    toks[::7] = [big] * len(toks[::7])
    toks[3::11] = [0] * len(toks[3::11])
    body = ('{"token_ids": [' + sep.join(map(str, toks)) + "]}").encode()
    assert list(json_request(body)[2]) == toks


@pytest.fixture(scope="module")
def spec() -> dict:
    rnd = __import__("random").Random(7)
    bs = 4
    docs = [[rnd.randrange(150_000) for _ in range(64)] for _ in range(4)]
    pods = ["pod0", "pod1", "b", 'q"x', "p\nod", "é"]
    events = []
    for d, doc in enumerate(docs):
        hashes = [(d + 1) * 10_000 + i for i in range(len(doc) // bs)]
        for pod in rnd.sample(pods, 3):
            n = rnd.randrange(1, len(hashes) + 1)
            events.append([pod, "gpu", hashes[:n], doc[: n * bs]])
            if rnd.random() < 0.5:
                events.append([pod, "cpu", hashes[:n], []])
                events.append([pod, "GPU", hashes[: n // 2], []])
    return {"bs": bs, "weights": {"GPU": 1.0, "CPU": 0.3}, "pods": pods, "events": events, "docs": docs}


HOSTILE = [  # (body, status, field)
    ('{"model": "m", "token_ids": [1, 2, 4294967296, 3]}', 400, "token_ids[2]"),
    ('{"model": "m", "token_ids": [1, 2, 3, 123456789012345678901234567890]}', 400, "token_ids[3]"),
    ('{"model": "m", "token_ids": [1, -2, 3]}', 400, "token_ids[1]"),
    ('{"model": "m", "token_ids": [1, 2.5, 3]}', 400, "token_ids[1]"),
    ('{"model": "m", "token_ids": [1, 2, [3]]}', 400, "token_ids[2]"),
    ('{"model": "m", "token_ids": [1, {"a": [2]}]}', 400, "token_ids[1]"),
    ('{"model": "m", "token_ids": [1, "2"]}', 400, "token_ids[1]"),
    ('{"model": "m", "token_ids": []}', 400, "token_ids"),
    ('{"model": "m", "token_ids": [ ]}', 400, "token_ids"),
    ('{"model": "m", "token_ids": 5}', 400, "token_ids"),
    ('{"model": "m", "token_ids": [1, 2, 3', 400, None),
    ('{"model": "m", "token_ids": [1, 2,, 3]}', 400, None),
    ('{"model": "m", "token_ids": [01, 2]}', 400, None),
    ('{"model": "m", "token_ids": [1 2]}', 400, None),
    ('{"model": "zz", "token_ids": [1, 2]}', 404, "model"),
    ('{"model": "m", "token_ids": [1], "x": [1]}', 400, "x"),
    ('', 400, None),
    ('[1, 2, 3]', 400, None),
]


def _long(body: str, n: int = 600) -> str:
    """The same defect after n good tokens (past where the 8-bytes-at-a-time path starts)."""
    return body.replace('"token_ids": [', '"token_ids": [' + ", ".join(["123456"] * n) + ", ", 1)


def _shifted(field: str | None, n: int = 600) -> str | None:
    return f"token_ids[{int(field[10:-1]) + n}]" if field and field.startswith("token_ids[") else field


LONG = [(_long(b), s, _shifted(f)) for b, s, f in HOSTILE if '"token_ids": [' in b and "[]" not in b and "[ ]" not in b]


@pytest.mark.parametrize("body, status, field", HOSTILE + LONG)
def test_hostile_bodies_get_the_apis_4xx_naming_the_field(spec, body, status, field):
    (got,) = _local_answers(dict(spec, bodies=[body]))
    assert got == ["ApiError", status, field], (body[:120], got)


def _bodies(spec: dict, rnd) -> list[str]:
    out = []
    for doc in spec["docs"]:
        for cut in (64, 40, 17, 3):
            toks = doc[:cut] + [rnd.randrange(150_000) for _ in range(rnd.randrange(0, 9))]
            for sep in (", ", ","):
                out.append('{"model": "m", "token_ids": [' + sep.join(map(str, toks)) + "]}")
    out.append('{"token_ids": [' + ", ".join(map(str, spec["docs"][0])) + '], "lora_name": null}')
    out.append('{"model": "m", "lora_name": "a", "token_ids": [1, 2, 3, 4, 5]}')
    return out


@needs_c
@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1))
def test_the_c_route_answers_what_the_pure_python_route_answers(spec, seed):
    rnd = __import__("random").Random(seed)
    case = dict(spec, bodies=_bodies(spec, rnd))
    local = _local_answers(case)
    env = dict(os.environ, KVEVENTS_PURE_PYTHON="1", PYTHONPATH=str(ROOT))
    child = subprocess.run([sys.executable, "-c", _CHILD], input=json.dumps(case), capture_output=True, text=True,
                           env=env, cwd=ROOT, timeout=120)
    assert child.returncode == 0, child.stderr[-2000:]
    got = json.loads(child.stdout)
    assert got["c_extension"] is False  # the child ran the pure-Python route
    pure = got["answers"]
    assert len(pure) == len(local)
    for body, a, b in zip(case["bodies"], local, pure):
        assert a == b, body[:120]
    assert any(json.loads(a)["pods"][0]["total"] > 0 for a in local)  # some prefixes matched
    assert msgspec.json.decode(local[0])["model"] == "m"


@needs_c
def test_the_windows_and_the_8_byte_loop_read_what_msgspec_reads():
    """Long bodies of every separator, defects included (the SSSE3 windows where the CPU has
    them, the 8-byte loop for what the windows hand over and on other CPUs), read to the
    reference's ints; refused only where a defect was planted. (On a CPU without SSSE3 the same
    test checks the 8-byte loop alone.)"""
    rnd = __import__("random").Random(11)
    read = 0
    for i in range(300):
        toks = [str(rnd.choice([rnd.randrange(150_000), rnd.randrange(10), rnd.randrange(2**32)]))
                for _ in range(rnd.randrange(1, 300))]
        if i % 3 == 0:
            toks[rnd.randrange(len(toks))] = rnd.choice(DEFECTS)
        sep = rnd.choice([",", ", ", ",\n ", " , "])
        body = ('{"model": "m", "token_ids": [' + sep.join(toks) + "]}").encode()
        got = json_request(body)
        if got is not None:
            assert (got[0], got[1], list(got[2])) == _msgspec_reads(body), body[:120]
            read += 1
        else:
            assert i % 3 == 0, body[:120]  # only a body with a defect planted is refused
    assert read > 150  # most bodies were read, not refused
