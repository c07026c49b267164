"""The event plane, measured: engine -> bridge -> JetStream -> router replica, vs direct ZeroMQ.

    python benchmarks/fleet.py [--quick] [--only-rate] [--events 16 ...] [--rounds R] [--batches N] [--pack P]
                               [--no-warmup] [--server-env NAME=VALUE] [--plain-server]

Needs nats-server (Debian's) on PATH or in /usr/sbin; starts its own on a free loopback port
with file storage in a temporary directory, in the broker environment docs/event-plane.md recommends
(``GODEBUG=madvdontneed=0``: kvevents.transport.nats.broker; ``--plain-server`` without it).

1. Throughput: an engine process publishes N batches (default 40,000, so that most of the run is
   past the replay ring's first fill) of E GPU events as fast as it can
   (ZmqEventPublisher); (a) direct: our raw Subscriber -> KVRouter.apply_payload in this
   process; (b) plane: a bridge process forwards to the stream, this process reads it through a
   JetStreamSource -> KVRouter. Rates are events applied / (last apply - first publish), same
   clock; rounds interleave direct and plane, after one untimed plane run per storage kind (a
   fresh nats-server's heap is still growing: see 1c's page faults). 1c: CPU per event per
   process, nats-server's page faults, and how the machine's 2 cores were spent during the run
   (this path / other processes / idle: a run slowed by other load says so). "Where the time
   goes" (1b): each stage alone on the same batches (bridge into the stream; stream -> source
   without a router; router apply only).
2. Lag: the engine paces itself at a target rate; lag = apply time - the batch's ts (peek_ts);
   p50/p99 for direct and plane in the same run.
3. Warm restart vs cold for an index of B blocks: cold = a replica reads the whole stream;
   warm = restore the newest snapshot (when the router has snapshot()/restore()), then read.
4. Scale-out: S simulated engines (pods) publishing into the stream; one replica's ingest rate
   and the snapshot's size and save time as S grows.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._table import print_table  # noqa: E402
from kvevents.transport.nats.broker import broker_env, find_nats_server  # noqa: E402


TARGET_RATE = 500_000  #: events/s end to end (issue 12)
TARGET_P99_MS = 50  #: p99 lag the plane may add at 100k events/s (issue 12)
PACK = 128  #: the bridge's --pack in the packed plane runs (fuller messages cost the server less per event)


def _hash(i: int) -> int:
    return (i * 0x9E3779B97F4A7C15) & 0x7FFFFFFFFFFFFFFF


def payloads(n: int, events: int, start: int = 0, ts: float | None = None) -> list[bytes]:
    from kvevents import BlockStored, KVEventBatch, encode_batch
    out = []
    for i in range(start, start + n):
        base = i * events
        evs = [BlockStored([_hash(base + k)], _hash(base + k - 1) if k else None,
                           list(range((base + k) * 16, (base + k) * 16 + 16)), 16, None, "GPU", None)
               for k in range(events)]
        out.append(encode_batch(KVEventBatch(ts if ts is not None else time.time(), evs, 0)))
    return out


# ---- helpers: a nats-server, an engine process, a bridge process ------------------------------

class Server:
    def __init__(self, env: dict[str, str] | None = None) -> None:
        exe = find_nats_server()
        if exe is None:
            sys.exit("benchmarks/fleet.py needs nats-server (apt-get install nats-server)")
        self.tmp = Path(tempfile.mkdtemp(prefix="kvfleet-"))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"nats://127.0.0.1:{self.port}"
        self.env = dict(os.environ if env is None else env)  #: the server process's environment
        self.proc = subprocess.Popen([exe, "-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd", str(self.tmp / "js")],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=self.env)
        end = time.monotonic() + 15
        while time.monotonic() < end:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("nats-server did not start")

    def reset_stream(self) -> None:
        import nats

        async def go():
            nc = await nats.connect(self.url)
            js = nc.jetstream()
            for name in ("KVEVENTS",):
                try:
                    await js.delete_stream(name)
                except Exception:
                    pass
            for b in ("kvrouter-snapshots", "kvrouter-replicas"):
                try:
                    await (js.delete_object_store(b) if "snap" in b else js.delete_key_value(b))
                except Exception:
                    pass
            await nc.close()
        asyncio.run(go())

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.tmp, ignore_errors=True)


ENGINE = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
from benchmarks.fleet import payloads
from kvevents import ZmqEventPublisher, peek_ts
from kvevents.transport.zmq.publisher import ZmqEventPublisher as _Z
n, events, rate, ep, rep = int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5], sys.argv[6]
from kvevents import decode_batch
import msgspec
pub = ZmqEventPublisher(endpoint=ep, replay_endpoint=rep, topic="kv@engine-0@m", buffer_steps=max(n, 1000))
batches = [decode_batch(p) for p in payloads(n, events)]
import gc
gc.freeze()  # the n pre-built batches are this script's, not an engine's: the collector must not rescan them
print("ready", flush=True)
sys.stdin.readline()
t0 = time.time()
for i, b in enumerate(batches):
    if rate:  # paced by sleeping, not spinning: a spin would take a core from the path measured
        wait = t0 + i * events / rate - time.time()
        if wait > 0:
            time.sleep(wait)
    b.ts = time.time()
    pub.publish(b)
print(f"done {t0}", flush=True)
sys.stdin.readline()
pub.shutdown(5)
"""


def _engine(n: int, events: int, rate: float, tmp: Path, tag: str):
    ep, rep = f"ipc://{tmp}/{tag}.pub", f"ipc://{tmp}/{tag}.rep"
    p = subprocess.Popen([sys.executable, "-c", ENGINE, str(ROOT), str(n), str(events), str(rate), ep, rep],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p, ep, rep


def _bridge_proc(url: str, ep: str, rep: str, tmp: Path, pack: int, storage: str = "file") -> subprocess.Popen:
    status = tmp / f"bridge-{time.monotonic_ns()}.json"
    p = subprocess.Popen([sys.executable, "-m", "kvevents.transport.nats.cli", "bridge", "--nats", url,
                          "--engine", f"engine-0={ep},{rep},model=m", "--window", "1024", "--status-file", str(status),
                          "--pack", str(pack), "--storage", storage],
                         cwd=ROOT, stderr=subprocess.DEVNULL)
    end = time.monotonic() + 30
    while not status.exists() and time.monotonic() < end:
        time.sleep(0.02)  # the bridge writes its status file once it is connected and subscribed
    time.sleep(0.3)  # ZeroMQ's slow joiner: its SUB connects before the engine starts
    return p


# ---- 1 and 2: direct vs plane -----------------------------------------------------------------

def _cpu_s(pid: int | None = None) -> float:
    """CPU seconds (user + system) used so far by process ``pid`` (this process if None)."""
    if pid is None:
        import resource
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _cpu_all(procs: dict[str, int | None]) -> dict[str, float]:
    return {name: _cpu_s(pid) for name, pid in procs.items()}


def _machine() -> tuple[float, float]:
    """(busy, idle) CPU seconds of the whole machine so far, all cores (/proc/stat)."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = f[3] + f[4]
    return (sum(f[:8]) - idle) / os.sysconf("SC_CLK_TCK"), idle / os.sysconf("SC_CLK_TCK")


def _minflt(pid: int) -> int:
    """Minor page faults of process ``pid`` so far (a fault on fresh anonymous memory zeroes a page,
    or a 2 MB huge page: most of nats-server's file-storage CPU when its Go heap is not warm)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])


def run_direct(n: int, events: int, rate: float, tmp: Path) -> tuple[float, list[float]]:
    from consumers import KVRouter
    from kvevents import Subscriber, peek_ts

    p, ep, rep = _engine(n, events, rate, tmp, f"d{time.monotonic_ns()}")
    router = KVRouter(model="m")
    lags = []
    with Subscriber([(ep, rep, "engine-0")], raw=True) as sub:
        time.sleep(0.3)  # ZeroMQ's slow joiner: the SUB connects before the engine starts
        procs = {"engine": p.pid, "router (subscriber + apply)": None}
        cpu0 = _cpu_all(procs)
        p.stdin.write("go\n")
        p.stdin.flush()
        got = 0
        end = time.monotonic() + 120
        apply = router.apply_payload
        while got < n and time.monotonic() < end:
            for d in sub.poll(50):
                if d.payload is not None:
                    apply("engine-0", d.payload)
                    if rate:  # the lag runs; a rate run's router does the router's work only
                        lags.append(time.time() - peek_ts(d.payload))
                    got += 1
        t_end = time.time()
        cpu1 = _cpu_all(procs)
    t0 = float(p.stdout.readline().split()[1])
    p.stdin.write("bye\n")
    p.stdin.flush()
    p.wait(10)
    run_direct.cpu = {k: cpu1[k] - cpu0[k] for k in procs}  # CPU seconds of the last run, per process
    return got * events / (t_end - t0), lags


def run_plane(n: int, events: int, rate: float, tmp: Path, srv: Server, pack: int = 1,
              storage: str = "file") -> tuple[float, list[float], dict]:
    from consumers import KVRouter
    from kvevents import peek_ts
    from kvevents.transport.nats.source import JetStreamSource
    from kvevents.transport.nats.wire import StreamSpec

    srv.reset_stream()
    p, ep, rep = _engine(n, events, rate, tmp, f"p{time.monotonic_ns()}")
    br = _bridge_proc(srv.url, ep, rep, tmp, pack, storage)
    router = KVRouter(model="m")
    lags = []
    procs = {"engine": p.pid, "bridge": br.pid, "nats-server": srv.proc.pid, "router (source + apply)": None}
    with JetStreamSource(srv.url, durable="bench", stream=StreamSpec(storage=storage)) as src:
        cpu0 = _cpu_all(procs)
        flt0 = _minflt(srv.proc.pid)
        m0 = _machine()
        p.stdin.write("go\n")
        p.stdin.flush()
        got = 0
        end = time.monotonic() + 180
        apply = router.apply_payload
        while got < n and time.monotonic() < end:
            for d in src.poll(50):
                if d.payload is not None:
                    apply("engine-0", d.payload)
                    if rate:  # the lag runs; a rate run's router does the router's work only
                        lags.append(time.time() - peek_ts(d.payload))
                    got += 1
        t_end = time.time()
        cpu1 = _cpu_all(procs)
        stats = src.stats()
        stats["server_faults"] = _minflt(srv.proc.pid) - flt0
        m1 = _machine()
        stats["machine"] = (m1[0] - m0[0], m1[1] - m0[1])  #: (busy, idle) CPU seconds, all processes
    stats["cpu"] = {k: cpu1[k] - cpu0[k] for k in procs}
    t0 = float(p.stdout.readline().split()[1])
    p.stdin.write("bye\n")
    p.stdin.flush()
    p.wait(10)
    br.terminate()
    br.wait(10)
    return got * events / (t_end - t0), lags, stats


def stage_rates(n: int, events: int, srv: Server) -> list[tuple[str, float]]:
    """Each stage alone on the same payloads, in events/s."""
    from consumers import KVRouter
    from kvevents.transport.nats.sender import PlaneSender
    from kvevents.transport.nats.source import JetStreamSource
    from kvevents.transport.nats.wire import plane_headers

    data = payloads(n, events)
    r = KVRouter(model="m")
    t = time.perf_counter()
    for pl in data:
        r.apply_payload("engine-0", pl)
    apply_rate = n * events / (time.perf_counter() - t)
    srv.reset_stream()
    sender = PlaneSender(srv.url, window=1024)
    t = time.perf_counter()
    sender.put_many([("kvevents.m.engine-0", pl, plane_headers("batch", "engine-0", "t", 0, i, 0))
                     for i, pl in enumerate(data)])
    sender.flush(120)
    publish_rate = n * events / (time.perf_counter() - t)
    sender.close()
    with JetStreamSource(srv.url, durable="stage") as src:
        got = 0
        t = time.perf_counter()
        while got < n:
            got += len(src.poll(50))
        read_rate = n * events / (time.perf_counter() - t)
    return [("publish into the stream (acked, window 1024)", publish_rate),
            ("read the stream (JetStreamSource, no router)", read_rate),
            ("router apply_payload alone", apply_rate)]


# ---- 3: warm vs cold restart ------------------------------------------------------------------

def restart(blocks: int, srv: Server) -> list[list]:
    from consumers import KVRouter
    from kvevents.transport.nats.sender import PlaneSender
    from kvevents.transport.nats.source import JetStreamSource
    from kvevents.transport.nats.wire import plane_headers

    srv.reset_stream()
    per_event, events = 16, 16  # 16 blocks per BlockStored, 16 events per batch: 256 blocks per message
    n = blocks // (per_event * events)
    from kvevents import BlockStored, KVEventBatch, encode_batch
    sender = PlaneSender(srv.url, window=1024)
    for i in range(n):
        evs = []
        for k in range(events):
            base = (i * events + k) * per_event
            evs.append(BlockStored([_hash(base + j) for j in range(per_event)], None,
                                   list(range(base * 16, (base + per_event) * 16)), 16, None, "GPU", None))
        sender.put("kvevents.m.engine-0", encode_batch(KVEventBatch(time.time(), evs, 0)),
                   plane_headers("batch", "engine-0", "t", 0, i, 0))
    sender.flush(300)
    sender.close()
    t = time.perf_counter()
    cold = KVRouter(model="m")
    with JetStreamSource(srv.url, durable="cold") as src:
        while src.position < n:
            for d in src.poll(50):
                cold.handle(d)
    cold_s = time.perf_counter() - t
    rows = [["cold: read the whole stream", cold.entries(), "-", "-", "-", f"{cold_s:.2f}"]]
    if not hasattr(cold, "snapshot"):
        rows.append(["warm: router has no snapshot()/restore() in this build", "-", "-", "-", "-", "-"])
        return rows
    t = time.perf_counter()
    data = cold.snapshot(stream_seq=n)
    save_s = time.perf_counter() - t
    t = time.perf_counter()
    warm = KVRouter(model="m")
    warm.restore(data)
    load_s = time.perf_counter() - t
    with JetStreamSource(srv.url, durable="warm", start_seq=n + 1) as src:
        src.poll(10)
    ready_s = time.perf_counter() - t
    rows.append(["warm: restore the snapshot, read on", warm.entries(), f"{len(data) / max(1, warm.entries()):.1f}",
                 f"{save_s:.2f}", f"{load_s:.2f}", f"{ready_s:.2f}"])
    return rows


# ---- 4: scale-out -----------------------------------------------------------------------------

def scale(engines: int, batches_per_engine: int, srv: Server) -> list:
    from consumers import KVRouter
    from kvevents.transport.nats.sender import PlaneSender
    from kvevents.transport.nats.source import JetStreamSource
    from kvevents.transport.nats.wire import plane_headers, subject_for

    srv.reset_stream()
    events = 16
    sender = PlaneSender(srv.url, window=1024)
    items = []
    for e in range(engines):
        for i, pl in enumerate(payloads(batches_per_engine, events, start=e * batches_per_engine)):
            items.append((subject_for("kvevents", "m", f"engine-{e}"), pl,
                          plane_headers("batch", f"engine-{e}", f"kv@engine-{e}@m", 0, i, 0)))
    sender.put_many(items)
    sender.flush(300)
    sender.close()
    total = len(items)
    r = KVRouter(model="m")
    t = time.perf_counter()
    with JetStreamSource(srv.url, durable="scale") as src:
        while src.position < total:
            for d in src.poll(50):
                r.handle(d)
    ingest_s = time.perf_counter() - t
    snap = ["-", "-"]
    if hasattr(r, "snapshot"):
        t = time.perf_counter()
        data = r.snapshot(stream_seq=total)
        snap = [len(data), f"{(time.perf_counter() - t) * 1000:.0f}"]
    return [engines, total, r.entries(), f"{total / ingest_s:,.0f}", f"{total * events / ingest_s:,.0f}", *snap]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only-rate", action="store_true", help="section 1 (rates and CPU per stage) only")
    ap.add_argument("--only-lag", action="store_true", help="section 2 (lag at 100k events/s) only")
    ap.add_argument("--events", type=int, nargs="*", default=[16, 64], help="events per batch in section 1")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds in section 1")
    ap.add_argument("--pack", type=int, default=PACK, help="batches per stream message in the packed plane runs")
    ap.add_argument("--batches", type=int, default=None, help="batches per run in section 1")
    ap.add_argument("--no-pack1", action="store_true", help="section 1 without the unpacked plane runs")
    ap.add_argument("--no-warmup", action="store_true", help="section 1 without its untimed warm-up runs")
    ap.add_argument("--server-env", action="append", default=[], metavar="NAME=VALUE",
                    help="more environment of the nats-server process, e.g. GOGC=400 (repeatable)")
    ap.add_argument("--plain-server", action="store_true",
                    help="start nats-server without the recommended GODEBUG=madvdontneed=0 (kvevents.transport.nats.broker)")
    args = ap.parse_args()
    extra = dict(kv.split("=", 1) for kv in args.server_env)
    base = dict(os.environ) if args.plain_server else broker_env()
    srv = Server({**base, **extra})
    shown = {k: srv.env[k] for k in ["GODEBUG", *extra] if k in srv.env}
    print("nats-server environment: " + (" ".join(f"{k}={v}" for k, v in shown.items()) or "plain (no GODEBUG)")
          + (" (--plain-server)" if args.plain_server else " (the recommended broker environment)") + "\n")
    tmp = Path(tempfile.mkdtemp(prefix="kvfleet-ipc-"))
    try:
        # 40,000 batches: the engine's replay ring fills in the first ~10,000 (fresh pages per batch), so
        # a shorter run measures mostly that first fill, not the steady state a deployment runs in
        n = args.batches or (2000 if args.quick else 40000)
        rounds = args.rounds or (1 if args.quick else 3)
        k = args.pack
        rows = []
        cpu_rows: dict[int, dict[str, float]] = {}
        faults: dict[tuple[int, str], float] = {}
        others: dict[tuple[int, str], str] = {}
        warm = not args.no_warmup and not args.only_lag and args.events
        if warm:
            # "sustains": a long-running server. A fresh nats-server's Go heap grows through its
            # first run (each fresh page faulted in and zeroed by the kernel: 45-85 faults per 1,000
            # events in a first file-storage run, 0-20 after), so the measured rounds come after
            # one untimed run per storage kind
            for storage in ("file", "memory"):
                run_plane(min(n, 20000), args.events[0], 0, tmp, srv, k, storage)
        for events in ([] if args.only_lag else args.events):
            d_rates = []
            p_rates: dict[tuple[int, str], list[float]] = {(1, "file"): [], (k, "file"): [], (k, "memory"): []}
            if args.no_pack1:
                del p_rates[1, "file"]
            for _ in range(rounds):  # interleaved rounds
                d_rates.append(run_direct(n, events, 0, tmp)[0])
                cpu_rows[events, "direct ZeroMQ"] = run_direct.cpu
                for pack, storage in p_rates:
                    rate, _, stats = run_plane(n, events, 0, tmp, srv, pack, storage)
                    p_rates[pack, storage].append(rate)
                    if pack == k:
                        cpu_rows[events, storage] = stats["cpu"]
                        faults[events, storage] = stats["server_faults"] * 1000 / (n * events)
                        ours = sum(stats["cpu"].values())
                        busy, idle = stats["machine"]
                        others[events, storage] = f"{ours / (busy + idle) * 2:.2f} / {max(0.0, busy - ours) / (busy + idle) * 2:.2f} / {idle / (busy + idle) * 2:.2f}"
            d = statistics.median(d_rates)
            med = {c: statistics.median(v) for c, v in p_rates.items()}
            best = max(med.values())
            cols = ((1, "file"), (k, "file"), (k, "memory"))
            fmed = med[k, "file"]
            rows.append([events, n, f"{d:,.0f}", *(f"{med[c]:,.0f}" if c in med else "-" for c in cols),
                         f"{best / d:.2f}", f"{TARGET_RATE:,}", "met" if fmed >= TARGET_RATE else "missed",
                         "met" if best >= TARGET_RATE else "missed",
                         " ".join(f"{v / 1000:.0f}k" for v in p_rates[k, "file"])])
        if rows:
            print_table("1. engine -> router, events/s (median of interleaved rounds" + (
                        ", after an untimed warm-up run per storage kind" if warm else "") +
                        "; plane = engine -> ZeroMQ -> bridge "
                        "process -> JetStream -> JetStreamSource -> KVRouter; direct ZeroMQ = engine -> Subscriber -> "
                        "KVRouter, the limit on this machine; the target is for file storage, the durable default)",
                        ["events/batch", "batches", "direct ZeroMQ", "plane pack=1", f"plane pack={k}",
                         f"pack={k} memory storage", "best/direct", "target", f"pack={k} file vs target",
                         "best vs target", f"pack={k} file, each round"], rows)
            print()
            names = next(v for k, v in cpu_rows.items() if k[1] != "direct ZeroMQ")
            crow = []
            order = sorted(cpu_rows.items(), key=lambda kv: (kv[0][0], kv[0][1] == "direct ZeroMQ"))
            for (events, storage), cpu in order:
                total = sum(cpu.values())
                if storage == "direct ZeroMQ":  # engine and router only: the same engine, no plane between
                    per = [cpu["engine"], None, None, cpu["router (subscriber + apply)"]]
                else:
                    per = [cpu[c] for c in names]
                flt = faults.get((events, storage))
                crow.append([events, storage, *("-" if v is None else f"{v * 1e6 / (n * events):.2f}" for v in per),
                             f"{total * 1e6 / (n * events):.2f}", f"{2 * n * events / total:,.0f}",
                             "-" if flt is None else f"{flt:.1f}", others.get((events, storage), "-")])
            print_table(f"1c. where the time goes: CPU microseconds per event, per process (plane pack={k}, last round; "
                        "the machine has 2 cores, so 2 / total is the most the whole path could do here; the direct "
                        "ZeroMQ row: the same engine read by a router without the plane, same round)",
                        ["events/batch", "storage", *names, "total", "2 cores / total, ev/s",
                         "nats-server page faults / 1k events", "cores: path / rest of machine / idle"], crow)
            print()
        if args.only_rate:
            return
        if not args.only_lag:
            print_table(f"1b. where the time goes: each stage alone ({n} batches x 16 events)",
                        ["stage", "events/s"], [[s, f"{r:,.0f}"] for s, r in stage_rates(n, 16, srv)])
            print()
        lag_rows = []
        target = 100_000
        events = 16
        nl = int(target / events * (2 if args.quick else 5))
        _, dl = run_direct(nl, events, target, tmp)
        _, pl1, _ = run_plane(nl, events, target, tmp, srv, 1)
        _, pl32, _ = run_plane(nl, events, target, tmp, srv, k)
        _, pl32m, _ = run_plane(nl, events, target, tmp, srv, k, "memory")
        direct_p99 = None
        for name, lags in (("direct ZeroMQ", dl), ("plane pack=1", pl1), (f"plane pack={k}", pl32),
                           (f"plane pack={k}, memory storage", pl32m)):
            lags.sort()
            p99 = lags[int(len(lags) * 0.99)] * 1000
            direct_p99 = p99 if direct_p99 is None else direct_p99
            is_direct = name.startswith("direct")
            verdict = "-" if is_direct else ("met" if p99 <= TARGET_P99_MS else "missed")
            lag_rows.append([name, len(lags), f"{lags[len(lags) // 2] * 1000:.1f}", f"{p99:.1f}",
                             "-" if is_direct else f"{p99 - direct_p99:+.1f}", f"{lags[-1] * 1000:.1f}",
                             f"<= {TARGET_P99_MS}", verdict])
        print_table(f"2. lag at {target:,} events/s ({events}-event batches): apply time - batch ts, ms (the engine "
                    "paces by sleeping)", ["path", "batches", "p50", "p99", "p99 added", "max", "target p99", "vs target"],
                    lag_rows)
        print()
        if args.only_lag:
            return
        blocks = 100_000 if args.quick else 1_000_000
        print_table(f"3. restart with a {blocks:,}-block index",
                    ["how", "entries", "snapshot B/entry", "save s", "load s", "ready s"], restart(blocks, srv))
        print()
        srows = [scale(e, max(1, (200 if args.quick else 1000) // max(1, e // 10)), srv)
                 for e in ((10, 100, 1000) if args.quick else (10, 100, 1000))]
        print_table("4. scale-out: simulated engines -> one replica",
                    ["engines", "messages", "entries", "msgs/s", "events/s", "snapshot B", "snapshot ms"], srows)
    finally:
        srv.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
