"""The chaos suite's ``http`` set: hostile HTTP clients against a live router service (issue 24).

    python benchmarks/chaos_http.py            # the full run (about two minutes)
    python benchmarks/chaos_http.py --quick    # the short form (tests/chaos/test_http_attacks.py runs it)
    python benchmarks/chaos.py --set http      # the same, from the chaos suite

The service runs as a process of its own (``python -m kvservice --config``) with its descriptor
limit lowered (so the connection cap is reached without exhausting this machine), and an attacker
process (plain sockets) runs one attack at a time while a well-behaved client in this process
keeps scoring on its keep-alive connection and probes ``/healthz`` on a fresh connection every
0.2 s. Per attack: the service's RSS before / peak / after (``/proc``), the well-behaved client's
answers and p99, the probes answered, the connections the service closed at a timeout and the
other limits hit (``kvservice_http_limit_hits_total``), the requests answered 4xx / 5xx.

Attacks: ``idle`` (more idle connections than the descriptor limit allows), ``slow-head``
(heads trickled a line a second), ``slow-body`` (bodies declared at ``api.max_body_bytes`` and
sent but for 16 bytes: the issue's 1,500 x 1 MiB), ``unread`` (requests pipelined, answers never
read), ``malformed`` (heads aiohttp's parser refuses, on new connections, flat out) and
``bad-bodies`` (JSON nested 500,000 deep, invalid UTF-8).
"""

from __future__ import annotations

import argparse
import errno
import json
import multiprocessing as mp
import os
import re
import resource
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ATTACKS = ("idle", "slow-head", "slow-body", "unread", "malformed", "bad-bodies")
RSS_SLACK = 64 << 20  #: target: RSS peak - before <= http.max_buffered_bytes + this
GOOD = json.dumps({"model": "m", "token_ids": list(range(1, 257))}).encode()
MALFORMED = (b"POST /v1/score HTTP/1.1\nHost: x\nContent-Length: 2\n\n{}",
             b"POST /v1/score HTTP/1.1\r\nHost: x\r\nX: a\x00b\r\nContent-Length: 2\r\n\r\n{}",
             b"POST /v1/score HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}",
             b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n{}",
             b"GARBAGE\r\n\r\n")


def scale_of(quick: bool) -> dict:
    """The run's sizes: the short form for CI, the full one for the benchmark."""
    if quick:
        return dict(duration=2.0, nofile=256, conns=400, slow=24, unread=4, body=64 << 10, buffered=1 << 20,
                    header=1.0, body_t=1.0, idle=1.0, reserve=4)
    return dict(duration=15.0, nofile=2048, conns=4000, slow=1500, unread=16, body=1 << 20, buffered=64 << 20,
                header=10.0, body_t=5.0, idle=5.0, reserve=8)


def rss_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def post(path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            .encode() + body)


# ---- the service -------------------------------------------------------------------------------


def start_service(sc: dict, tmp: Path) -> tuple[subprocess.Popen, int]:
    cfg = tmp / "router.toml"
    cfg.write_text(f"""[router]
model = "m"
[api]
host = "127.0.0.1"
port = 0
max_body_bytes = {sc['body']}
[http]
header_timeout = {sc['header']}
body_timeout = {sc['body_t']}
idle_timeout = {sc['idle']}
max_buffered_bytes = {sc['buffered']}
reserved_connections = {sc['reserve']}
[subscriber]
replay_timeout = 0.2
[[pods]]
name = "a"
endpoint = "ipc://{tmp}/a.pub"
""")
    nofile = sc["nofile"]

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    log = open(tmp / "service.log", "wb")  # a file, not a pipe: a full pipe would stall the service
    p = subprocess.Popen([sys.executable, "-m", "kvservice", "--config", str(cfg), "--log-level", "info"],
                         stdout=subprocess.PIPE, stderr=log, preexec_fn=limit, cwd=ROOT)
    log.close()
    line = p.stdout.readline().decode()
    if "listening on" not in line:
        p.kill()
        raise RuntimeError(f"service did not start: {line!r} {(tmp / 'service.log').read_text()[-2000:]!r}")
    return p, int(line.split()[4].rsplit(":", 1)[1])


def exchange(port: int, raw: bytes, timeout: float = 5.0) -> tuple[int | None, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(raw)
        return read_answer(s, b"")[:2]


def read_answer(s: socket.socket, buf: bytes) -> tuple[int | None, bytes, bytes]:
    """One Content-Length-framed answer: (status, body, what followed); None when closed first."""
    while True:
        if b"\r\n\r\n" in buf:
            head, rest = buf.split(b"\r\n\r\n", 1)
            m = re.search(rb"(?i)content-length: *(\d+)", head)
            n = int(m.group(1)) if m else 0
            if len(rest) >= n:
                return int(head.split(b" ", 2)[1]), rest[:n], rest[n:]
        try:
            chunk = s.recv(65536)
        except (ConnectionResetError, TimeoutError, socket.timeout):
            chunk = b""
        if not chunk:
            return None, buf, b""
        buf += chunk


def metrics(port: int) -> dict:
    """The service's counters that matter here (over a fresh connection, between attacks)."""
    _s, text = exchange(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    out: dict = {"limits": {}, "status": {}}
    for m in re.finditer(rb'kvservice_http_limit_hits_total\{limit="([a-z_]+)"\} (\d+)', text):
        out["limits"][m.group(1).decode()] = int(m.group(2))
    for m in re.finditer(rb'kvservice_http_requests_total\{route="[^"]*",method="[^"]*",status="(\d+)"\} (\d+)', text):
        k = int(m.group(1)) // 100 * 100
        out["status"][k] = out["status"].get(k, 0) + int(m.group(2))
    m = re.search(rb"kvservice_internal_errors_total (\d+)", text)
    out["internal"] = int(m.group(1)) if m else -1
    return out


# ---- the well-behaved client ----------------------------------------------------------------------


class Client(threading.Thread):
    """Scores on one keep-alive connection (reconnecting if it is lost), 50 requests a second, and
    probes /healthz on a fresh connection every 0.2 s; counts answers and failures."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port = port
        self.stop = threading.Event()
        self.lat: list[float] = []
        self.failed = 0
        self.probes = [0, 0]  # answered, failed
        self.sock: socket.socket | None = None

    def reset(self) -> None:
        self.lat, self.failed, self.probes = [], 0, [0, 0]

    def _score(self) -> None:
        if self.sock is None:
            self.sock = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        t0 = time.perf_counter()
        self.sock.sendall(post("/v1/score", GOOD))
        status, _body, rest = read_answer(self.sock, b"")
        if status != 200 or rest:
            self.failed += 1
            self.sock.close()
            self.sock = None
        else:
            self.lat.append(time.perf_counter() - t0)

    def run(self) -> None:
        next_probe = 0.0
        while not self.stop.is_set():
            try:
                self._score()
            except OSError:
                self.failed += 1
                self.sock = None
            if time.monotonic() >= next_probe:
                next_probe = time.monotonic() + 0.2
                try:
                    ok = exchange(self.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")[0] == 200
                except OSError:
                    ok = False
                self.probes[0 if ok else 1] += 1
            self.stop.wait(0.02)

    def p99_ms(self) -> float:
        lat = sorted(self.lat)
        return lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e3 if lat else float("nan")


# ---- the attacker (a process of its own) --------------------------------------------------------


def _open(port: int, n: int) -> list[socket.socket]:
    """``n`` connections, in one burst: non-blocking connects, not waited for (the kernel's
    backlog and SYN retries pace them as the service accepts)."""
    out = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        if s.connect_ex(("127.0.0.1", port)) not in (0, errno.EINPROGRESS):
            s.close()
            break
        out.append(s)
    return out


def _send(s: socket.socket, data: bytes) -> bool:
    try:
        return s.send(data) > 0
    except OSError:  # not connected yet, refused, or closed by the service
        return False


def _closed(socks: list[socket.socket]) -> int:
    """How many of ``socks`` the server has closed (EOF or reset readable now)."""
    n = 0
    for s in socks:
        try:
            poll = select.poll()
            poll.register(s, select.POLLIN)
            if poll.poll(0):
                s.setblocking(False)
                while True:
                    chunk = s.recv(65536)
                    if not chunk:
                        n += 1
                        break
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            n += 1
    return n


def attacker(kind: str, port: int, sc: dict, ready, done, out) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    stats = {"opened": 0, "closed_by_server": 0, "requests": 0}
    socks: list[socket.socket] = []
    ready.set()
    t_end = time.monotonic() + sc["duration"]
    try:
        if kind == "idle":
            socks = _open(port, sc["conns"])
            done.wait(sc["duration"])
        elif kind == "slow-head":  # a head line a second, never the blank line that ends it
            socks = _open(port, sc["conns"] // 4)
            started = [False] * len(socks)
            while not done.wait(1.0 if sc["duration"] > 3 else 0.1):
                for i, s in enumerate(socks):
                    if started[i]:
                        _send(s, b"X-Slow: a\r\n")
                    else:
                        started[i] = _send(s, b"POST /v1/score HTTP/1.1\r\nHost: x\r\n")
        elif kind == "slow-body":
            head = (f"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Length: {sc['body']}\r\n\r\n").encode()
            part = b"[" * (sc["body"] - 16)
            for _ in range(sc["slow"]):  # one after the other: each body sent but for 16 bytes
                try:
                    s = socket.create_connection(("127.0.0.1", port), timeout=5)
                except OSError:
                    continue
                socks.append(s)
                try:
                    s.sendall(head + part)
                except OSError:
                    pass
            done.wait(max(0.0, t_end - time.monotonic()))
        elif kind == "unread":  # each connection pipelines 1,000 requests and reads nothing
            socks = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(sc["unread"])]
            reqs = post("/v1/score", GOOD) * 1000
            for s in socks:
                s.setblocking(False)
                try:
                    stats["requests"] += s.send(reqs) // len(post("/v1/score", GOOD))
                except OSError:
                    pass
            done.wait(sc["duration"])
        elif kind in ("malformed", "bad-bodies"):
            depth = min(500_000, (sc["body"] - 64) // 2)  # within api.max_body_bytes: the decoder, not a 413
            deep = post("/v1/score", b'{"model": "m", "token_ids": ' + b"[" * depth + b"]" * depth + b"}")
            bad = (deep, post("/v1/score", b'{"model": "m\xff", "token_ids": [1]}'),
                   post("/v1/explain", b'{"model": "m", "prompt": "\xc3"}'))
            corpus = MALFORMED if kind == "malformed" else bad
            while not done.is_set() and time.monotonic() < t_end:
                try:
                    exchange(port, corpus[stats["requests"] % len(corpus)])
                except OSError:
                    pass
                stats["requests"] += 1
        stats["opened"] = len(socks)
        stats["closed_by_server"] = _closed(socks)
    finally:
        for s in socks:
            s.close()
        out.put(stats)


# ---- one attack, all of them ----------------------------------------------------------------------


def run_attack(kind: str, port: int, pid: int, client: Client, sc: dict) -> dict:
    ctx = mp.get_context("spawn")
    ready, done, q = ctx.Event(), ctx.Event(), ctx.Queue()
    before_m = metrics(port)
    time.sleep(0.3)  # the service settles (measurement pacing, not synchronisation)
    rss0 = peak = rss_of(pid)
    client.reset()
    proc = ctx.Process(target=attacker, args=(kind, port, sc, ready, done, q), daemon=True)
    proc.start()
    ready.wait(30)
    t_end = time.monotonic() + sc["duration"]
    while time.monotonic() < t_end and proc.is_alive():
        peak = max(peak, rss_of(pid))
        time.sleep(0.05)
    done.set()
    stats = q.get(timeout=120)
    proc.join(30)
    lat, failed, probes, p99 = list(client.lat), client.failed, list(client.probes), client.p99_ms()
    settle = time.monotonic() + max(1.0, sc["idle"] * 2)
    while time.monotonic() < settle:  # the service lets go of what the attack made it hold
        peak = max(peak, rss_of(pid))
        time.sleep(0.1)
    after_m = metrics(port)
    lim = {k: after_m["limits"].get(k, 0) - before_m["limits"].get(k, 0) for k in after_m["limits"]}
    st = {k: after_m["status"].get(k, 0) - before_m["status"].get(k, 0) for k in (400, 500)}
    return {"attack": kind, "stats": stats, "rss": (rss0, peak, rss_of(pid)), "ok": len(lat), "failed": failed,
            "p99_ms": p99, "probes": probes, "limits": lim, "status": st,
            "internal": after_m["internal"] - before_m["internal"], "budget": sc["buffered"] + RSS_SLACK}


def run_all(quick: bool, only: list[str] | None = None) -> list[dict]:
    sc = scale_of(quick)
    tmp = Path(tempfile.mkdtemp(prefix="kvchaos-http-"))
    proc, port = start_service(sc, tmp)
    client = Client(port)
    results = []
    try:
        client.start()
        for kind in ATTACKS:
            if only and not any(w in kind for w in only):
                continue
            results.append(run_attack(kind, port, proc.pid, client, sc))
            print(f"  http {kind} done", file=sys.stderr, flush=True)
    finally:
        client.stop.set()
        client.join(10)
        proc.terminate()
        try:
            proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
    log = (tmp / "service.log").read_bytes()
    tracebacks = log.count(b"Traceback")
    for r in results:
        r["tracebacks"] = tracebacks
        r["log_bytes"] = len(log)
    return results


def bounded(r: dict) -> bool:
    rss0, peak, _after = r["rss"]
    return peak - rss0 <= r["budget"]


TIMEOUTS = ("header_timeout", "body_timeout", "idle_timeout")


def rows(results: list[dict]) -> list[list]:
    out = []
    for r in results:
        rss0, peak, after = (x / 2**20 for x in r["rss"])
        s = r["stats"]
        lim = r["limits"]
        other = ", ".join(f"{k} {v}" for k, v in lim.items() if v and k not in TIMEOUTS) or "-"
        out.append([r["attack"], s["opened"] or s["requests"], f"{rss0:.0f}", f"{peak:.0f}", f"{after:.0f}",
                    f"{r['ok']} / {r['failed']}", f"{r['p99_ms']:.1f}", f"{r['probes'][0]} / {r['probes'][1]}",
                    sum(lim.get(k, 0) for k in TIMEOUTS), s["closed_by_server"], other,
                    f"{r['status'][400]} / {r['status'][500]}", r["internal"],
                    "met" if bounded(r) and not r["failed"] and not r["probes"][1] else "NOT MET"])
    return out


HEADERS = ["attack", "conns / requests", "RSS before MiB", "peak", "after", "client ok / failed", "client p99 ms",
           "probes ok / failed", "closed by timeout", "attacker saw closed", "other limits hit", "4xx / 5xx",
           "internal errors", "target"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--attack", action="append", default=[], metavar="WORD",
                    help="run only the attacks whose name contains WORD (repeatable; default: all)")
    args = ap.parse_args(argv)
    from benchmarks._table import print_table

    sc = scale_of(args.quick)
    results = run_all(args.quick, args.attack)
    print_table(f"HTTP attacks ({'quick' if args.quick else 'full'} run; service nofile {sc['nofile']}, "
                f"timeouts head {sc['header']} s / body {sc['body_t']} s / idle {sc['idle']} s, "
                f"max_buffered_bytes {sc['buffered'] >> 20} MiB, {sc['duration']:.0f} s per attack; "
                f"tracebacks in the service's log: {results[0]['tracebacks'] if results else 0})", HEADERS,
                rows(results))
    print("targets: RSS peak - before <= http.max_buffered_bytes + 64 MiB under every attack; the well-behaved "
          "client (keep-alive, 50 req/s) and the /healthz probes on fresh connections (every 0.2 s) answered "
          "throughout (0 failed); malformed input answered 4xx, 0 internal errors, no tracebacks logged")


if __name__ == "__main__":
    main()
