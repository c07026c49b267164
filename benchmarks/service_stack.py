"""Which HTTP stack for the router service: aiohttp vs starlette on uvicorn, same handler.

    python benchmarks/service_stack.py      # needs wrk; starlette + uvicorn pip-installed

Each stack serves, in a process of its own, ``GET /healthz`` (framework overhead alone) and
``POST /v1/score`` (msgspec decode of a 4,096-token body, ``KVRouter.score`` over 64 pods with
65,536 indexed blocks, msgspec encode); ``wrk -t1 -c16`` drives each for ``--seconds``,
stacks interleaved for ``--rounds`` rounds; the table shows the median.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._table import print_table  # noqa: E402
from benchmarks.service import build_fleet, lua_script, prompts, run_wrk  # noqa: E402


def serve(stack: str, port: int) -> None:
    import msgspec

    from kvservice.schema import ScoreRequest

    d = Path(tempfile.mkdtemp())
    rnd = random.Random(0)
    _cfg, fleet, docs = build_fleet(d, 64, 65_536, rnd)
    router, lock = fleet.router, threading.Lock()
    dec = msgspec.json.Decoder(ScoreRequest)
    (d / "bodies.json").write_text(json.dumps([b.decode() for b in prompts(docs, rnd, 16)]))

    def answer(body: bytes) -> bytes:
        req = dec.decode(body)
        with lock:
            scores = router.score(req.token_ids, req.lora_name, model=req.model)
        pods = sorted(scores.values(), key=lambda s: (-s.total, s.pod))
        return msgspec.json.encode({"pick": pods[0].pod if pods else None,
                                    "pods": [{"pod": s.pod, "total": s.total, "tokens_by_tier": s.tokens_by_tier}
                                             for s in pods]})

    if stack == "aiohttp":
        from aiohttp import web

        async def score(request):
            return web.Response(body=answer(await request.read()), content_type="application/json")

        async def healthz(request):
            return web.Response(body=b'{"status":"alive"}', content_type="application/json")

        app = web.Application(client_max_size=1 << 20)
        app.router.add_post("/v1/score", score)
        app.router.add_get("/healthz", healthz)
        print(d, flush=True)
        web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)
    else:
        import uvicorn
        from starlette.applications import Starlette
        from starlette.responses import Response
        from starlette.routing import Route

        async def score(request):
            return Response(answer(await request.body()), media_type="application/json")

        async def healthz(request):
            return Response(b'{"status":"alive"}', media_type="application/json")

        app = Starlette(routes=[Route("/v1/score", score, methods=["POST"]), Route("/healthz", healthz)])
        print(d, flush=True)
        uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def measure(p, port: int, stack: str, res: dict, seconds: float) -> None:
    d = Path(p.stdout.readline().strip())
    url = f"http://127.0.0.1:{port}"
    for _t in range(1200):  # wait until it accepts (60 s)
        if subprocess.run(["curl", "-sf", url + "/healthz"], capture_output=True).returncode == 0:
            break
        threading.Event().wait(0.05)
    bodies = [b.encode() for b in json.loads((d / "bodies.json").read_text())]
    health = d / "health.lua"
    health.write_text('wrk.method = "GET"\nrequest = function() return wrk.format(nil, "/healthz") end\n')
    res.setdefault((stack, "GET /healthz"), []).append(run_wrk(url, health, 16, seconds))
    res.setdefault((stack, "POST /v1/score"), []).append(run_wrk(url, lua_script(d, bodies), 16, seconds))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--serve")
    ap.add_argument("--port", type=int)
    ap.add_argument("--seconds", type=float, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    if args.serve:
        return serve(args.serve, args.port)
    from kvdemo.serve import free_tcp_ports

    stacks = ["aiohttp", "starlette+uvicorn"]
    res: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.rounds):
        for stack in stacks:
            port = free_tcp_ports(1)[0]
            p = subprocess.Popen([sys.executable, __file__, "--serve", stack.split("+")[0], "--port", str(port)],
                                 stdout=subprocess.PIPE, text=True)
            try:
                measure(p, port, stack, res, args.seconds)
            finally:
                p.terminate()
                p.wait(10)
    rows = []
    for (stack, route), rs in sorted(res.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        rows.append((route, stack, statistics.median(r["rps"] for r in rs), statistics.median(r["p50"] for r in rs),
                     statistics.median(r["p99"] for r in rs)))
    print_table(f"HTTP stacks, wrk -t1 -c16, {args.seconds:g}s x {args.rounds} interleaved rounds (median)",
                ["route", "stack", "req/s", "p50 ms", "p99 ms"], rows)



if __name__ == "__main__":
    main()
