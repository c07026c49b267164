"""Instructions per /v1/score request outside HTTP (callgrind): decode the body, score, encode the answer.

    python benchmarks/service_instr.py                 # this checkout
    python benchmarks/service_instr.py --root OTHER    # another checkout (before/after), C extension built in place

A child process under ``valgrind --tool=callgrind`` pre-fills a router (64 pods x 2 tiers,
``--blocks`` indexed blocks, the shape of ``benchmarks/service.py``) and counts the
instructions of each stage of the API's score route over the same 32 bodies of 4,096 token
ids (half with a cached prefix): ``decode`` (the body into a ScoreRequest and its token ids),
``score`` (``KVRouter.score``), ``answer`` (sort + JSON encode) and the three together; where
the checkout has them, the C route too: ``json_request`` (decode), ``Scorer.score_json``
(score + answer), both, and ``Api.fast_answer`` (what the fast HTTP path calls per request).
Instruction counts are steady where wall clock on a shared machine is not; cache misses in a
large index are not in them (see the wall-clock table of ``benchmarks/service.py``), nor is how
well they overlap: a second, plain child times the same stages (min over rounds), and the two
can disagree (a chain of dependent loads runs fewer instructions more slowly).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
N = 32
ROUNDS = 30


def child(root: str, blocks: int, wall: bool = False) -> None:
    sys.path.insert(0, root)
    sys.path.insert(1, str(HERE.parent))
    import msgspec

    from benchmarks._callgrind import Region
    from benchmarks.service import MODEL, build_fleet, prompts
    from kvservice import schema

    reg = None if wall else Region(os.environ["KV_CALLGRIND_LIB"])
    rnd = random.Random(0)
    _cfg, fleet, docs = build_fleet(Path(tempfile.mkdtemp()), 64, blocks, rnd)
    r = fleet.router
    bodies = [json.dumps(json.loads(b.decode().replace('\\"', '"'))).encode() for b in prompts(docs, rnd, N)]
    reader = getattr(schema, "token_ids_of", None)

    def decode(body):
        req = schema.decode(body, schema.ScoreRequest)
        return req, (req.token_ids if reader is None else reader(req))

    def answer(scores, n):
        pods = sorted(scores.values(), key=lambda s: (-s.total, s.load, s.pod))
        return msgspec.json.encode({"model": MODEL, "prompt_tokens": n, "pick": pods[0].pod if pods else None,
                                    "pods": pods})

    reqs = [decode(b) for b in bodies]
    scores = [r.score(t, req.lora_name, model=MODEL, load=req.load) for req, t in reqs]
    for _ in range(2):  # warm
        for b in bodies:
            req, toks = decode(b)
            answer(r.score(toks, req.lora_name, model=MODEL, load=req.load), len(toks))
    stages = [("decode", lambda i: decode(bodies[i])),
              ("score", lambda i: r.score(reqs[i][1], None, model=MODEL, load=None)),
              ("answer", lambda i: answer(scores[i], len(reqs[i][1]))),
              ("all", lambda i: answer(r.score(decode(bodies[i])[1], None, model=MODEL), 4096))]
    # the C route (checkouts that have it): json_request reads the body, score_json writes the answer
    json_request = getattr(importlib.import_module("consumers.keys"), "json_request", None)
    score_json = getattr(r.scorer, "score_json", None)
    if json_request is not None and score_json is not None:
        from kvservice.api import Api

        api = Api(fleet)
        fast = getattr(api, "fast_answer", None)
        got = [json_request(b) for b in bodies]
        for i in range(2):  # warm
            score_json(got[i][2], None, model=MODEL)
            if fast is not None:
                fast("/v1/score", bodies[i])
        stages += [("c_decode", lambda i: json_request(bodies[i])),
                   ("c_score_answer", lambda i: score_json(got[i][2], None, model=MODEL)),
                   ("c_all", lambda i: score_json(json_request(bodies[i])[2], None, model=MODEL))]
        if fast is not None:
            stages.append(("route", lambda i: fast("/v1/score", bodies[i])))
            front = _http_front(api, bodies)
            if front is not None:
                stages.append(("http", front))
    if wall:  # the same stages at full speed: min over rounds of the mean per request, microseconds
        out = {}
        for label, fn in stages:
            best = float("inf")
            for _ in range(ROUNDS):
                t0 = time.perf_counter()
                for i in range(N):
                    fn(i)
                best = min(best, (time.perf_counter() - t0) / N)
            out[label] = best * 1e6
        print(json.dumps(out))
        return
    reg.instrument()
    for label, fn in stages:
        reg.label = label
        reg.start()
        for i in range(N):
            fn(i)
        reg.stop()


class _StubTransport:
    def write(self, data) -> None:
        pass

    def close(self) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _http_front(api, bodies):
    """``FastHttp.data_received`` over whole requests (a wrk-like head + the body) on one
    keep-alive connection, answers written to a stub transport: the fast path's HTTP reading and
    framing plus its route (None where the checkout has no kvservice.fasthttp)."""
    try:
        from kvservice.fasthttp import FastHttp, FastSite
    except ImportError:
        return None
    import asyncio

    from aiohttp import web

    async def make():
        runner = web.AppRunner(web.Application())
        await runner.setup()
        return FastSite(runner, api, "127.0.0.1", 0)

    site = asyncio.new_event_loop().run_until_complete(make())
    conn = FastHttp(site)
    conn.connection_made(_StubTransport())
    reqs = [b"POST /v1/score HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(b), b) for b in bodies]
    for i in range(2):  # warm
        conn.data_received(reqs[i])
    return lambda i: conn.data_received(reqs[i])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", default=str(HERE.parent), help="the checkout to measure")
    ap.add_argument("--blocks", type=int, default=1 << 16)
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--wall", action="store_true", help="(child) time the stages instead of counting")
    args = ap.parse_args()
    if args.child:
        return child(args.root, args.blocks, args.wall)
    sys.path.insert(0, str(HERE.parent))
    from benchmarks._callgrind import require_tools, new_out_dir, read_dumps, run_child
    from benchmarks._table import print_table

    require_tools()
    out = new_out_dir("kvbench-svc-instr-")
    env = dict(os.environ, PYTHONPATH=args.root)
    rc, tail = run_child(["--instr-atstart=no", sys.executable, __file__, "--child", "--root", args.root, "--blocks", str(args.blocks),
                          ], out, env, timeout=1800)
    if rc != 0:
        sys.exit(f"the callgrind child failed (rc {rc}): {tail}")
    res = read_dumps(out)
    # instructions are not time: the same stages at full speed in a plain child
    import subprocess

    p = subprocess.run([sys.executable, __file__, "--child", "--wall", "--root", args.root, "--blocks", str(args.blocks)],
                       env=env, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        sys.exit(f"the timing child failed (rc {p.returncode}): {p.stderr[-2000:]}")
    us = json.loads(p.stdout.strip().splitlines()[-1])
    names = {"decode": "decode: msgspec ScoreRequest + token_ids_of", "score": "KVRouter.score",
             "answer": "answer: sort + msgspec encode", "all": "all three (the aiohttp route's work)",
             "c_decode": "decode: json_request (C)", "c_score_answer": "score + answer: Scorer.score_json (C)",
             "c_all": "both (C)", "route": "Api.fast_answer (the fast path's whole route, lock included)",
             "http": "FastHttp.data_received: HTTP head + route + answer framing (kvservice.fasthttp)"}
    print_table(f"/v1/score outside HTTP, per request: instructions (callgrind, mean of {N} bodies of 4,096 token ids) "
                f"and wall clock (no valgrind, min over {ROUNDS} rounds of the {N}); {args.root}",
                ["stage", "instructions", "wall us"],
                [(names[k], res[k] // N, f"{us[k]:.1f}" if k in us else "-") for k in names if k in res])


if __name__ == "__main__":
    main()
