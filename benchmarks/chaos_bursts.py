"""The chaos suite's ``bursts`` set: publishers in bursts while the machine's cores are busy.

    python benchmarks/chaos.py --set bursts            # the full run
    python benchmarks/chaos_bursts.py --seconds 20     # this set alone

``PODS`` publisher processes (``ZmqEventPublisher`` with a replay socket, vLLM's default topic)
publish bursts of batches with quiet spells between them (long enough for the subscriber's idle
probes to fire), one of them restarted ``--restarts`` times on purpose (a new process, seqs from
0); ``BURNERS`` processes spin on the cores the whole time. One ``Subscriber`` (connect mode, as
the router service uses it) reads them all and feeds a ``KVRouter``. The figures: resets seen per
pod beside its deliberate restarts, unverified resets, gaps, probes, and the pods the router
leaves out of its score at the end (a pod left out needs evidence: a restart is not one).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PODS = 4


def burn(stop) -> None:
    """Spin until ``stop`` is set: one busy core."""
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x += 1


def publisher(pub: str, replay: str, run: int, seed: int, ready, stop, burst: int = 1500) -> None:
    """Bursts of 50..``burst`` batches (no pause inside), then a quiet spell of 0.3..1.6 s, until ``stop``."""
    import random

    from kvevents import BlockStored, KVEventBatch
    from kvevents.publisher import ZmqEventPublisher

    rng = random.Random(seed * 1000 + run)
    p = ZmqEventPublisher(pub.replace("127.0.0.1", "*"), replay.replace("127.0.0.1", "*"), topic="")  # (binds)
    ready.set()
    seq = 0
    try:
        while not stop.is_set():
            for _ in range(rng.randint(50, burst)):
                p.publish(KVEventBatch(ts=run * 1e6 + seq, events=[BlockStored(
                    block_hashes=[run * 10**9 + seq], parent_block_hash=None, token_ids=list(range(16)),
                    block_size=16, lora_id=None, medium="GPU", lora_name=None)]))
                seq += 1
            stop.wait(rng.uniform(0.3, 1.6))
    finally:
        p.shutdown(timeout=0.5)


def run(seconds: float, restarts: int, burners: int, seed: int, workdir: str, burst: int = 1500,
        tcp: bool = False, routers: int = 2) -> dict:
    ctx = mp.get_context("spawn")
    stop_burn = ctx.Event()
    burn_procs = [ctx.Process(target=burn, args=(stop_burn,), daemon=True) for _ in range(burners)]
    for b in burn_procs:
        b.start()
    if tcp:
        from tests.pubsub_helpers import free_tcp_port

        eps = [(f"tcp://127.0.0.1:{free_tcp_port()}", f"tcp://127.0.0.1:{free_tcp_port()}") for _ in range(PODS)]
    else:
        eps = [(f"ipc://{workdir}/p{i}.pub", f"ipc://{workdir}/p{i}.replay") for i in range(PODS)]
    stops = [ctx.Event() for _ in range(PODS)]
    procs: list = [None] * PODS
    runs = [0] * PODS

    def start(i: int) -> None:
        ready = ctx.Event()
        stops[i] = ctx.Event()
        procs[i] = ctx.Process(target=publisher, args=(*eps[i], runs[i], seed + i, ready, stops[i], burst),
                               daemon=True)
        procs[i].start()
        ready.wait(30)

    for i in range(PODS):
        start(i)
    from kvservice.config import from_dict
    from kvservice.ingest import Fleet

    # two routers as the service runs them (a Fleet: its ingest thread, raw deliveries, health rounds)
    cfg = from_dict({"router": {"model": "m"}, "pods": [
        {"name": f"pod{i}", "endpoint": p, "replay_endpoint": r} for i, (p, r) in enumerate(eps)]}).validate()
    fleets = [Fleet(cfg) for _ in range(routers)]
    for f in fleets:
        f.start()
    t0 = time.monotonic()
    restart_at = [t0 + seconds * (k + 1) / (restarts + 1) for k in range(restarts)]
    made = [0] * PODS
    try:
        while time.monotonic() - t0 < seconds:
            time.sleep(0.05)
            if restart_at and time.monotonic() >= restart_at[0]:
                restart_at.pop(0)
                i = 0  # the deliberate restarts: always pod0, a new process, seqs from 0
                stops[i].set()
                procs[i].join(10)
                runs[i] += 1
                made[i] += 1
                start(i)
        for s in stops:  # the publishers stop; the routers read what is left
            s.set()
        for p in procs:
            p.join(10)
        for f in fleets:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and any(
                    sum(h.received for h in f.sub.health().values()) != n for n in [f.deliveries]):
                time.sleep(0.1)
        results = []
        for f in fleets:
            f._health_round()
            with f.lock:
                scored = f.router.score(list(range(16)))
            results.append((f.sub.health(), scored, f.deliveries, f.router.stats.resets, f.router.stats.gaps))
    finally:
        for s in stops:
            s.set()
        stop_burn.set()
        for p in [*procs, *burn_procs]:
            p.join(10)
            if p.is_alive():
                p.terminate()
        for f in fleets:
            f.stop()
    out = []
    for k, (health, scored, delivered, rr, rg) in enumerate(results):
        pods = []
        for i in range(PODS):
            h = health[f"pod{i}"]
            pods.append({"pod": f"pod{i}", "router": k, "restarts": made[i], "resets": h.resets,
                         "unverified": h.unverified_resets, "reconnects": h.reconnects, "gaps": h.gaps,
                         "unrecoverable": h.unrecoverable, "probes": h.probes, "state": h.state.value,
                         "routed": f"pod{i}" in scored})
        out.append({"pods": pods, "delivered": delivered, "router_resets": rr, "router_gaps": rg})
    return {"routers": out, "seconds": seconds, "burners": burners}


def rows(result: dict) -> list[list]:
    out = []
    for p in (p for r in result["routers"] for p in r["pods"]):
        ok = p["resets"] == p["restarts"] and p["routed"]
        out.append([p["router"], p["pod"], f"{p['resets']} / {p['restarts']}", p["unverified"], p["reconnects"], p["gaps"],
                    p["unrecoverable"], p["probes"], p["state"], "yes" if p["routed"] else "NO",
                    "ok" if ok else "FAIL"])
    return out


HEADER = ["router", "pod", "resets / restarts", "unverified", "reconnects", "gaps", "unrecoverable", "probes", "state",
          "routed", "verdict"]


def main(argv: list[str] | None = None) -> int:
    import tempfile

    from benchmarks._table import print_table

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--restarts", type=int, default=3)
    ap.add_argument("--burners", type=int, default=os.cpu_count() or 2, help="busy processes (default: one per core)")
    ap.add_argument("--seed", type=int, default=20261127)
    ap.add_argument("--burst", type=int, default=1500, help="largest burst (batches)")
    ap.add_argument("--tcp", action="store_true", help="loopback TCP instead of ipc://")
    ap.add_argument("--routers", type=int, default=2, help="router services (Fleets) reading the publishers")
    a = ap.parse_args(argv)
    import faulthandler

    faulthandler.dump_traceback_later(a.seconds + 120, exit=True)  # a hang shows where, and ends
    with tempfile.TemporaryDirectory(prefix="kvbursts-") as d:
        r = run(a.seconds, a.restarts, a.burners, a.seed, d, a.burst, a.tcp, a.routers)
    print_table(f"bursts under load: {PODS} publishers ({'tcp' if a.tcp else 'ipc'}, bursts of 50..{a.burst} "
                f"batches, quiet 0.3..1.6 s), {len(r['routers'])} routers (service ingest), {r['burners']} busy "
                f"processes, {r['seconds']:.0f} s; deliveries per router "
                f"{[x['delivered'] for x in r['routers']]}", HEADER, rows(r))
    bad = [p for x in r["routers"] for p in x["pods"] if p["resets"] != p["restarts"] or not p["routed"]]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
