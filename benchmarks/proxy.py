"""The proxy benchmark: ``kvevents router --proxy`` against vllm-router 0.1.17 (``kv_aware`` and
``round_robin``) and the direct-to-backend baseline.

Set-up, the same for every target: two pods, each a trivial OpenAI backend (a canned
``text_completion`` answer from a raw asyncio protocol on uvloop, so the backend is never the
limit) and a ZeroMQ KV-event publisher (tcp://, with a replay endpoint) that has published the
benchmark prompt's blocks as stored on pod 0. Both routers subscribe to the same publishers.
The body: ``POST /v1/completions`` with a 4,000-token-id prompt (``max_tokens`` 1), the same
bytes for every request. Load: ``wrk`` (one thread, closed loop) at 1 and 16 connections.
Rounds are interleaved (each round measures every target in turn) and the median round is
reported. CPU per request: the router process's user+system CPU time over the run
(``/proc/PID/stat``) divided by the requests answered. "added p50" is the target's median
latency minus the direct baseline's in the same round.

Targets: ours >= 1.5x kv_aware's req/s at 1 and 16 clients and an added p50 no higher than
its; stretch: >= round_robin's req/s.

Run: ``python -m benchmarks.proxy [--rounds 3] [--seconds 4] [--peers /work/peers]``
(vllm-router from ``../shared/peers/setup-routers.sh DIR``; skipped, saying so, if absent).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks._table import print_table

MODEL = "bench-model"
PROMPT_TOKENS = 4000
PODS = 2


# ---- the trivial backend and publishers (run as: python -m benchmarks.proxy --backend PORTS...) ----
def backend(ports: list[int], pub_ports: list[int], replay_ports: list[int], prompt: list[int]) -> None:
    import asyncio

    from kvevents import BlockStored, KVEventBatch
    from kvevents.publisher import ZmqEventPublisher

    answer = json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": MODEL,
                         "choices": [{"index": 0, "text": "x", "finish_reason": "length", "logprobs": None}],
                         "usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": 1,
                                   "total_tokens": PROMPT_TOKENS + 1}}).encode()
    ok = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(answer), answer)
    models = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()
    get_ok = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(models), models)

    class Trivial(asyncio.Protocol):
        def connection_made(self, t):
            self.t = t
            self.buf = b""

        def data_received(self, data):
            buf = self.buf + data if self.buf else data
            while True:
                he = buf.find(b"\r\n\r\n")
                if he < 0:
                    break
                head = buf[:he].lower()
                i = head.find(b"content-length:")
                n = int(head[i + 15:head.find(b"\r\n", i) if head.find(b"\r\n", i) > 0 else len(head)]) if i >= 0 else 0
                if len(buf) < he + 4 + n:
                    break
                self.t.write(get_ok if head.startswith(b"get") else ok)
                buf = buf[he + 4 + n:]
            self.buf = buf

    pubs = []
    for pp, rp in zip(pub_ports, replay_ports):
        pub = ZmqEventPublisher(f"tcp://127.0.0.1:{pp}", f"tcp://127.0.0.1:{rp}", topic="")
        pubs.append(pub)
    time.sleep(0.5)  # subscribers connect
    blocks = len(prompt) // 16
    batch = KVEventBatch(ts=time.time(), events=[BlockStored(
        block_hashes=list(range(1, blocks + 1)), parent_block_hash=None, token_ids=prompt[:blocks * 16],
        block_size=16, lora_id=None, medium="GPU", lora_name=None)])
    pubs[0].publish(batch)  # pod 0 holds the prompt; replayed to late joiners

    async def main():
        loop = asyncio.get_running_loop()
        for p in ports:
            await loop.create_server(Trivial, "127.0.0.1", p, backlog=1024)
        print("ready", flush=True)
        await asyncio.Event().wait()

    import uvloop

    uvloop.run(main())


# ---- measuring ------------------------------------------------------------------------------
def free_ports(n: int) -> list[int]:
    from kvdemo.serve import free_tcp_ports

    return list(free_tcp_ports(n))


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _ms(text: str) -> float:
    v = float(re.match(r"[\d.]+", text).group(0))
    return v / 1000 if text.endswith("us") else v * 1000 if text.endswith("s") and not text.endswith("ms") else v


def run_wrk(url: str, script: Path, conns: int, seconds: float) -> dict:
    out = subprocess.run(["wrk", "-t1", f"-c{conns}", f"-d{seconds}s", "--latency", "-s", str(script), url],
                         capture_output=True, text=True, timeout=seconds + 60).stdout
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    n = re.search(r"(\d+) requests in", out)
    if m is None or n is None:
        raise RuntimeError(f"wrk gave no result: {out!r}")
    res = {"rps": float(m.group(1)), "n": int(n.group(1))}
    for q in ("50", "99"):
        res[f"p{q}"] = _ms(re.search(rf"^\s+{q}%\s+(\S+)", out, re.M).group(1))
    bad = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    errs = re.search(r"Socket errors:.*", out)
    res["errors"] = (int(bad.group(1)) if bad else 0) + (sum(map(int, re.findall(r"\d+", errs.group(0)))) if errs else 0)
    return res


def wait_http(url: str, timeout: float = 60.0, body: bytes | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            req = urllib.request.Request(url, data=body, headers={"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer")
        time.sleep(0.2)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=4)
    ap.add_argument("--peers", default=os.environ.get("KVEVENTS_PEERS", "/work/peers"))
    ap.add_argument("--backend", nargs="*", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    rnd = random.Random(7)
    prompt = [rnd.randrange(150_000) for _ in range(PROMPT_TOKENS)]
    if args.backend is not None:
        return backend(args.backend[:PODS], args.backend[PODS:2 * PODS], args.backend[2 * PODS:], prompt)
    if shutil.which("wrk") is None:
        sys.exit("wrk is needed (apt-get install wrk, or ../shared/peers/setup-routers.sh)")
    d = Path(tempfile.mkdtemp(prefix="kvproxy-bench-"))
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}).encode()
    (d / "body.json").write_bytes(body)
    script = d / "post.lua"
    script.write_text('wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
                      f'local f = io.open("{d / "body.json"}", "rb")\nwrk.body = f:read("*a")\nf:close()\n')
    ports = free_ports(PODS * 3 + 6)
    http_ports, pub_ports, replay_ports = ports[:PODS], ports[PODS:2 * PODS], ports[2 * PODS:3 * PODS]
    ours_port, kv_port, rr_port, kv_prom, rr_prom = ports[-5:]
    procs: list[subprocess.Popen] = []
    targets: dict[str, tuple[str, int | None]] = {}
    try:
        be = subprocess.Popen([sys.executable, "-m", "benchmarks.proxy", "--backend", *map(str, http_ports),
                               *map(str, pub_ports), *map(str, replay_ports)], stdout=subprocess.PIPE, text=True)
        procs.append(be)
        assert be.stdout.readline().strip() == "ready"
        urls = [f"http://127.0.0.1:{p}" for p in http_ports]
        targets["direct to the backend"] = (urls[0], None)
        pods = [f"--pod=pod{i}=tcp://127.0.0.1:{pp},replay=tcp://127.0.0.1:{rp},http={u}"
                for i, (pp, rp, u) in enumerate(zip(pub_ports, replay_ports, urls))]
        ours = subprocess.Popen([sys.executable, "-m", "kvservice", "--port", str(ours_port), "--proxy", "--model",
                                 MODEL, *pods], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        procs.append(ours)
        ours.stdout.readline()
        targets["kvevents router --proxy"] = (f"http://127.0.0.1:{ours_port}", ours.pid)
        vr = Path(args.peers) / "vllm-router" / "bin" / "vllm-router"
        if vr.exists():
            for name, port, prom, policy in (("vllm-router kv_aware", kv_port, kv_prom, "kv_aware"),
                                             ("vllm-router round_robin", rr_port, rr_prom, "round_robin")):
                extra = []
                if policy == "kv_aware":
                    for u, pp, rp in zip(urls, pub_ports, replay_ports):
                        extra += ["--kv-event-source", f"{u}=tcp://127.0.0.1:{pp}",
                                  "--kv-event-replay-source", f"{u}=tcp://127.0.0.1:{rp}"]
                    extra += ["--kv-event-block-size", "16", "--kv-event-model", MODEL]
                p = subprocess.Popen([str(vr), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
                                      "--policy", policy, "--prometheus-port", str(prom), "--log-level", "warning",
                                      *extra], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
                procs.append(p)
                targets[name] = (f"http://127.0.0.1:{port}", p.pid)
        else:
            print(f"vllm-router not found at {vr}: its rows are skipped (../shared/peers/setup-routers.sh DIR)")
        for url, _pid in targets.values():
            wait_http(url + "/v1/completions", body=body)
        for url, _pid in targets.values():  # warm: connections, caches, the KV events arrived
            run_wrk(url + "/v1/completions", script, 4, 1)
        res: dict[tuple[str, int], list[dict]] = {}
        for r in range(args.rounds):
            for conns in (1, 16):
                names = list(targets)
                if r % 2:
                    names.reverse()
                for name in names:
                    url, pid = targets[name]
                    c0 = cpu_seconds(pid) if pid else 0.0
                    out = run_wrk(url + "/v1/completions", script, conns, args.seconds)
                    out["cpu_us"] = (cpu_seconds(pid) - c0) / max(1, out["n"]) * 1e6 if pid else None
                    res.setdefault((name, conns), []).append(out)
        load = os.getloadavg()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        shutil.rmtree(d, ignore_errors=True)
    med = statistics.median
    for conns in (1, 16):
        base = med(x["p50"] for x in res[("direct to the backend", conns)])
        kv = res.get(("vllm-router kv_aware", conns))
        kv_rps = med(x["rps"] for x in kv) if kv else None
        rows = []
        for name in targets:
            xs = res[(name, conns)]
            rps = med(x["rps"] for x in xs)
            cpu = [x["cpu_us"] for x in xs if x["cpu_us"] is not None]
            rows.append((name, rps, f"{rps / kv_rps:.2f}x" if kv_rps else "-", med(x["p50"] for x in xs),
                         med(x["p99"] for x in xs),
                         "-" if name.startswith("direct") else f"{med(x['p50'] for x in xs) - base:+.3f}",
                         med(cpu) if cpu else "-", sum(x["errors"] for x in xs)))
        print_table(f"POST /v1/completions, {PROMPT_TOKENS}-token-id prompt, {conns} client(s), wrk closed loop, "
                    f"median of {args.rounds} interleaved {args.seconds} s rounds",
                    ("target", "req/s", "vs kv_aware", "p50 ms", "p99 ms", "added p50 ms", "CPU us/req", "errors"),
                    rows)
    print(f"load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} ({os.cpu_count()} CPUs); "
          f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")


if __name__ == "__main__":
    main()
