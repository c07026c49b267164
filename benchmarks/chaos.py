"""The chaos suite's long runs: fuzzing, hostile peers, kill -9 — one table with the targets beside the figures.

    python benchmarks/chaos.py            # the full run (several minutes)
    python benchmarks/chaos.py --quick    # a smoke run
    python benchmarks/chaos.py --set plane [--quick]   # the event plane's attack set (benchmarks/chaos_plane.py)
    python benchmarks/chaos.py --set http               # the HTTP attacks on the router service (benchmarks/chaos_http.py)
    python benchmarks/chaos.py --set bursts [--quick]  # bursts under load: resets equal restarts (benchmarks/chaos_bursts.py)

Sections (each row says what was done and what came of it):

* fuzz: mutated payloads through ``decode_batch`` (current, legacy, vLLM's own bytes as seeds),
  ``KVRouter.apply_payload`` against ``apply(decode_batch(...))``, hostile record streams through
  the subscriber's SeqTracker (``DeliveryStream``), damaged recording files through the reader and
  ``inspect``'s summary. Oracles: ``tests/chaos/oracles.py``. (The C parser under AddressSanitizer,
  coverage-guided: ``benchmarks/fuzz_native.py``.)
* attacks on a live publisher (this process) by a separate attacker process while a steady
  stream of batches goes to a legitimate ``Subscriber`` (another process, with replay): per
  attack, the publisher's RSS peak, ``publish()`` p99 under attack beside its p99 in the same
  run's unattacked windows (the attacker paused every other 0.5 s), batches published /
  delivered / reported lost (GAP) / silently lost (neither).
* kill -9: a publisher process killed at random points and restarted (RESETs detected, splices);
  in connect mode and in bind mode (the publisher connects to the subscriber's socket); a
  late-joining subscriber process killed and restarted (in order, no silent loss, no splice);
  a recorder killed and restarted with ``--append`` (file readable, bad records).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._table import print_table  # noqa: E402
from tests.chaos import oracles  # noqa: E402

RSS_BUDGET = 64 << 20  #: documented bound: publisher RSS growth under an attack <= its ring bytes + this


def rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


# ---- fuzz ------------------------------------------------------------------------------------------


def fuzz(name: str, n: int, one, seed: int) -> list:
    rnd = random.Random(seed)
    crashes = 0
    example = ""
    worst = 0.0
    base = rss()
    peak = base
    t0 = time.perf_counter()
    for i in range(n):
        t = time.perf_counter()
        try:
            one(rnd)
        except oracles.Crash as exc:
            crashes += 1
            example = example or str(exc)[:160]
        worst = max(worst, time.perf_counter() - t)
        if i % 1000 == 0:
            peak = max(peak, rss())
    elapsed = time.perf_counter() - t0
    hangs = int(worst > 5.0)
    return [f"fuzz: {name}", n, crashes, hangs, f"{(peak - base) / 2**20:.1f}", "-", "-", "-", "-", "-", "-", "-", "-",
            f"slowest input {worst * 1e3:.0f} ms; {n / elapsed:,.0f}/s" + (f"; e.g. {example}" if example else "")]


def fuzz_rows(scale: float, seed: int) -> list[list]:
    payloads = oracles.seed_payloads()
    seed_rec = oracles.seed_recording()
    work = Path(tempfile.mkdtemp(prefix="kvchaos-"))
    rows = [
        fuzz("decode_batch (mutated)", int(700_000 * scale),
             lambda r: oracles.check_decode(oracles.mutate(r.choice(payloads), r)), seed),
        fuzz("decode_batch (random bytes)", int(100_000 * scale),
             lambda r: oracles.check_decode(r.randbytes(r.randrange(64))), seed + 1),
        fuzz("apply_payload vs typed decoder", int(150_000 * scale),
             lambda r: oracles.check_apply_payload(oracles.mutate(r.choice(payloads), r)), seed + 2),
        fuzz("replay answers + live frames (SeqTracker)", int(40_000 * scale),
             lambda r: oracles.check_stream(oracles.random_records(r, r.randrange(1, 40))), seed + 3),
        fuzz("damaged recording files (reader, inspect)", int(10_000 * scale),
             lambda r: oracles.check_recording_bytes(oracles.damage_recording(seed_rec, r), work), seed + 4),
    ]
    return rows


# ---- attacks on a live publisher ---------------------------------------------------------------------


def _subscriber_proc(pub_ep: str, rep_ep: str, conn, stop) -> None:
    from kvevents import DeliveryKind, Subscriber

    sub = Subscriber([(pub_ep, rep_ep)], late_join=True)
    seen: set[int] = set()
    lost = resets = 0
    conn.send("ready")
    while not stop.is_set():
        for d in sub.poll(50):
            if d.kind is DeliveryKind.BATCH:
                seen.add(d.seq)
            elif d.kind is DeliveryKind.GAP:
                lost += d.missed
            else:
                resets += 1
    end = time.monotonic() + 5
    while time.monotonic() < end:  # drain what is still on the way
        ds = sub.poll(100)
        for d in ds:
            if d.kind is DeliveryKind.BATCH:
                seen.add(d.seq)
            elif d.kind is DeliveryKind.GAP:
                lost += d.missed
        if not ds:
            break
    sub.close()
    conn.send({"seen": sorted(seen), "lost": lost, "resets": resets})


def _attacker_proc(kind: str, pub_ep: str, rep_ep: str, pub_port: int, stop, ready, pause, remote: bool = False) -> None:
    import zmq

    if remote:  # a peer on another machine: its own CPU time is not the publisher's machine's to pay
        os.nice(19)
        if hasattr(os, "SCHED_BATCH"):
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))

    ctx = zmq.Context()
    socks = []
    rnd = random.Random(7)
    ready.set()  # imported and running

    def idle() -> None:  # the baseline windows: the attacker holds its sockets but sends nothing
        while pause.is_set() and not stop.is_set():
            time.sleep(0.005)
    try:
        if kind == "replay flood (20 clients, reading)":
            socks = [ctx.socket(zmq.DEALER) for _ in range(20)]
            for s in socks:
                s.connect(rep_ep)
            while not stop.is_set():
                idle()
                for s in socks:
                    s.send_multipart([b"", (0).to_bytes(8, "big")])
                    while s.poll(0):
                        s.recv_multipart()
                time.sleep(0.01)
        elif kind == "replay clients that never read (20)":
            socks = [ctx.socket(zmq.DEALER) for _ in range(20)]
            for s in socks:
                s.setsockopt(zmq.RCVHWM, 0)
                s.connect(rep_ep)
            while not stop.is_set():
                idle()
                for s in socks:
                    s.send_multipart([b"", (0).to_bytes(8, "big")])
                time.sleep(0.05)
        elif kind == "malformed replay requests":
            s = ctx.socket(zmq.DEALER)
            s.connect(rep_ep)
            socks = [s]
            while not stop.is_set():
                idle()
                for _ in range(100):
                    s.send_multipart(rnd.choice([[b"x"], [b"", b"abc"], [b"", b"\0" * 8, b"more"], [b""] * 5]))
                time.sleep(0.001)
        elif kind == "stuck subscribers (4, never reading)":
            for _ in range(4):
                s = ctx.socket(zmq.SUB)
                s.setsockopt(zmq.SUBSCRIBE, b"")
                s.setsockopt(zmq.RCVBUF, 4096)
                s.connect(pub_ep)
                socks.append(s)
            stop.wait()
        elif kind == "raw TCP junk on the PUB port":
            while not stop.is_set():
                idle()
                try:
                    with socket.create_connection(("127.0.0.1", pub_port), timeout=1) as c:
                        c.sendall(rnd.randbytes(rnd.randrange(1, 512)))
                except OSError:
                    pass
                time.sleep(0.002)
        else:
            stop.wait()
    finally:
        for s in socks:
            s.close(0)
        ctx.term()


ATTACKS = ["none (baseline)", "replay flood (20 clients, reading)", "replay clients that never read (20)",
           "malformed replay requests", "stuck subscribers (4, never reading)", "raw TCP junk on the PUB port"]


def _publish_for(pub, seconds: float, rate: float, ev, lat: list, peak: list) -> int:
    """Publish at ``rate`` for ``seconds`` (the pace of an engine), each call's time into ``lat``."""
    from kvevents import KVEventBatch

    n = int(seconds * rate)
    t_next = time.perf_counter()
    for i in range(n):
        b = KVEventBatch(time.time(), ev, 0)
        t = time.perf_counter_ns()
        pub.publish(b)
        lat.append(time.perf_counter_ns() - t)
        if i % 200 == 0:
            peak[0] = max(peak[0], rss())
        t_next += 1.0 / rate
        delay = t_next - time.perf_counter()
        if delay > 0:
            time.sleep(delay)  # the pace of an engine
    return n


def _p99(lat: list) -> float:
    lat = sorted(lat)
    return lat[int(len(lat) * 0.99)] / 1000 if lat else float("nan")


def attack_row(kind: str, seconds: float, rate: float, window: float = 0.5, remote: bool = False) -> list:
    """One attack, with its own baseline in the same run: the attacker process runs throughout and
    is paused every other ``window`` seconds (it keeps its sockets: stuck subscribers stay stuck),
    ``seconds`` attacked and ``seconds`` paused in all; ``publish()`` is timed in both ("p99" and
    "p99 base"), so their ratio stands on a machine whose load drifts."""
    from kvevents import BlockStored
    from kvevents.publisher import ZmqEventPublisher

    port, rport = _free_port(), _free_port()
    pub_ep, rep_ep = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}"
    pub = ZmqEventPublisher(f"tcp://*:{port}", rep_ep, buffer_steps=20_000)
    spawn = mp.get_context("spawn")
    stop_sub, stop_att, att_ready, pause = spawn.Event(), spawn.Event(), spawn.Event(), spawn.Event()
    parent, child = spawn.Pipe()
    subp = spawn.Process(target=_subscriber_proc, args=(pub_ep, rep_ep, child, stop_sub))
    subp.start()
    assert parent.poll(60) and parent.recv() == "ready"
    ev = [BlockStored([i], None, list(range(16)), 16, None, "GPU", None) for i in range(4)]
    pause.set()
    att = spawn.Process(target=_attacker_proc, args=(kind, pub_ep, rep_ep, port, stop_att, att_ready, pause, remote))
    att.start()
    assert att_ready.wait(60), "attacker did not start"
    time.sleep(1.0)  # let the subscriber and the attacker connect: nothing to wait on but time
    base_lat: list[int] = []
    lat: list[int] = []
    base = rss()
    peak = [base]
    n = 0
    for r in range(2 * max(1, round(seconds / window))):
        attacked = r % 2 == 0
        (pause.clear if attacked else pause.set)()
        n += _publish_for(pub, window, rate, ev, lat if attacked else base_lat, peak)
    stop_att.set()
    att.join(30)
    if att.is_alive():
        att.kill()
    time.sleep(1.0)
    stop_sub.set()
    result = parent.recv() if parent.poll(60) else {"seen": [], "lost": 0, "resets": 0}
    subp.join(30)
    st = pub.stats()
    pub.shutdown()
    p99, p99_base = _p99(lat), _p99(base_lat)
    p50 = sorted(lat)[len(lat) // 2] / 1000
    seen = set(result["seen"])
    delivered = len(seen & set(range(n)))
    silent = n - delivered - result["lost"]
    ring = st["ring_bytes"]
    grew = peak[0] - base
    return [f"attack: {kind}", n, 0, 0, f"{grew / 2**20:.1f}", f"{p99:.1f}", f"{p99_base:.1f}",
            f"{p99 / p99_base:.2f}", n, delivered, result["lost"], max(0, silent), "-",
            f"publish p50 {p50:.1f} us; "
            f"RSS bound ring {ring / 2**20:.1f} MiB + {RSS_BUDGET >> 20} MiB: {'met' if grew <= ring + RSS_BUDGET else 'NOT MET'}; "
            f"replay served {st['replay_batches_served']:,}, malformed {st['replay_malformed']:,}, "
            f"reading paused at the global cap {st.get('replay_throttled', 0):,}x, "
            f"aborted {st['replay_aborted']:,}"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- kill -9 -------------------------------------------------------------------------------------------


def kill_publisher_row(rounds: int, seed: int, bind: bool = False) -> list:
    sys.path.insert(0, str(ROOT / "tests"))
    from tests.chaos.kill9 import kill_restart_rounds

    r = kill_restart_rounds(rounds, random.Random(seed), sub_timeout=60, bind=bind)
    ok = r["resets"] == r["restarts"] and r["splices"] == 0
    return [f"kill -9: publisher, restarted ({'bind' if bind else 'connect'} mode)", r["restarts"], 0, 0, "-", "-",
            "-", "-", "-", r["batches"], r["lost"],
            "-", f"{r['resets']} / {r['restarts']}",
            f"splices {r['splices']} (target 0), out of order {r['disorder']}, reconnects seen {r['reconnects']}; "
            f"{'met' if ok else 'NOT MET (issue 10 item 2)'}"]


def kill_subscriber_row(rounds: int, seed: int) -> list:
    from tests.chaos.kill9 import kill_subscriber_rounds

    r = kill_subscriber_rounds(rounds, random.Random(seed))
    ok = not (r["disorder"] or r["silent"] or r["splices"])
    return ["kill -9: late-joining subscriber, restarted", r["restarts"], 0, 0, "-", "-", "-", "-", "-", r["batches"],
            r["lost"],
            r["silent"], "-", f"out of order {r['disorder']}, splices {r['splices']}; {'met' if ok else 'NOT MET'}"]


def kill_recorder_row(rounds: int, seed: int) -> list:
    from kvevents.recording import RecordingReader
    from tests.chaos.kill9 import start_publisher
    from tests.pubsub_helpers import ipc_pair

    rnd = random.Random(seed)
    pub_ep, rep_ep = ipc_pair()
    proc = start_publisher(pub_ep, rep_ep, 1)
    out = Path(tempfile.mkdtemp(prefix="kvchaos-")) / "k.kvrec"
    bad = unreadable = 0
    total = 0
    try:
        for i in range(rounds):
            rec = subprocess.Popen([sys.executable, "-m", "kvevents.cli_record", "record", pub_ep, "--replay", rep_ep,
                                    "-q", "-o", str(out)] + (["--append"] if i else []), cwd=ROOT)
            time.sleep(0.4 + rnd.random() * 0.6)  # a random point in its life
            rec.send_signal(signal.SIGKILL)
            rec.wait()
            try:
                with RecordingReader(out) as r:
                    total = sum(1 for _ in r)
                    bad += r.bad_records + r.undecodable
            except Exception:  # noqa: BLE001 - counted
                unreadable += 1
    finally:
        proc.kill()
        proc.wait()
    return ["kill -9: recorder, restarted --append", rounds, unreadable, 0, "-", "-", "-", "-", "-", total, "-", "-",
            "-",
            f"{total:,} records readable; damaged records {bad} (target 0), unreadable files {unreadable}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seed", type=int, default=20261123)
    ap.add_argument("--skip", action="append", default=[], choices=["fuzz", "attacks", "kill"])
    ap.add_argument("--attack", action="append", default=[], metavar="WORD",
                    help="run only the attacks whose name contains WORD (repeatable; default: all)")
    ap.add_argument("--remote-attacker", action="store_true",
                    help="run the attacker process at nice 19 and SCHED_BATCH, as a peer on another machine would "
                         "cost this one nothing but its traffic (on a 2-core machine the attacker's own CPU otherwise "
                         "preempts the engine thread: involuntary switches of the caller inside publish())")
    ap.add_argument("--set", choices=["core", "plane", "http", "bursts"], default="core",
                    help="core: fuzzing, hostile peers, kill -9 (this script); plane: attacks on the NATS event "
                         "plane (benchmarks/chaos_plane.py); http: attacks on the router service's HTTP front "
                         "(benchmarks/chaos_http.py); bursts: bursts from real publishers with the cores busy "
                         "(benchmarks/chaos_bursts.py)")
    args = ap.parse_args()
    if args.set == "plane":
        from benchmarks import chaos_plane
        figures = chaos_plane.run(args.quick, args.seed)
        sys.exit(1 if figures["silent"] or figures["foreign"] else 0)
    if args.set == "http":
        from benchmarks import chaos_http

        return chaos_http.main(["--quick"] * args.quick + [a for w in args.attack for a in ("--attack", w)])
    if args.set == "bursts":
        from benchmarks import chaos_bursts

        return chaos_bursts.main(["--seconds", "20" if args.quick else "60", "--tcp", "--burst", "20000"])
    scale = 0.02 if args.quick else 1.0
    t0 = time.monotonic()
    rows: list[list] = []
    if "fuzz" not in args.skip:
        rows += fuzz_rows(scale, args.seed)
        print(f"  fuzz done, {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    if "attacks" not in args.skip:
        for kind in ATTACKS:
            if args.attack and not any(w in kind for w in args.attack):
                continue
            rows.append(attack_row(kind, 2.0 if args.quick else 10.0, 1000.0, remote=args.remote_attacker))
            print(f"  {kind} done, {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    if "kill" not in args.skip:
        rows.append(kill_publisher_row(5 if args.quick else 100, args.seed))
        rows.append(kill_publisher_row(5 if args.quick else 100, args.seed, bind=True))
        rows.append(kill_subscriber_row(3 if args.quick else 30, args.seed))
        rows.append(kill_recorder_row(3 if args.quick else 20, args.seed))
    fuzz_total = sum(r[1] for r in rows if r[0].startswith("fuzz"))
    print_table(f"Chaos suite ({'quick' if args.quick else 'full'} run, {time.monotonic() - t0:.0f} s; "
                f"attacker {'at nice 19, SCHED_BATCH (--remote-attacker)' if args.remote_attacker else 'at normal priority'}; "
                f"fuzz inputs in all: {fuzz_total:,}; peak RSS of this process "
                f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB)",
                ["scenario", "inputs", "crashes", "hangs", "RSS +MiB", "publish p99 us", "p99 base us", "p99/base",
                 "published", "delivered",
                 "reported lost", "silently lost", "RESETs / restarts", "notes"], rows)
    print("targets: >= 10^6 fuzz inputs per run (here and in benchmarks/fuzz_native.py), 0 crashes, 0 sanitizer "
          "reports (fuzz_native.py); RSS growth <= ring bytes + 64 MiB; 100 kill -9 restarts -> 100 RESETs or "
          "correct continuations, 0 splices; silent loss 0; publish() p99 <= 50 us under every attack. 'p99 base': the "
          "same publisher in the same run's unattacked windows (the attacker paused every other 0.5 s); p99/base "
          "near 1: the attack costs publish() nothing, the rest of its p99 is the machine's")


if __name__ == "__main__":
    main()
