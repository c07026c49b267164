"""The chaos suite's ``bursts`` set: publishers in bursts while the machine's cores are busy.

    python benchmarks/chaos.py --set bursts                        # with the suite (60 s, tcp)
    python benchmarks/chaos_bursts.py --seconds 20 --tcp --burst 20000

``PODS`` publisher processes (``ZmqEventPublisher`` with a replay socket, vLLM's default topic
and ring) publish bursts of 50..``--burst`` batches with quiet spells of 0.3..1.6 s between them
(long enough for idle probes to fire); pod0 is restarted ``--restarts`` times on purpose (a new
process, seqs from 0); ``--burners`` processes spin on the cores the whole time. ``--routers``
router services' ingest sides (``kvservice.ingest.Fleet``: the subscriber on its own thread,
raw deliveries, health rounds) read them all. The figures, per router and pod: RESETs seen
beside the deliberate restarts, unverified RESETs, reconnects, gaps, batches reported lost, idle
probes (and those moot: answered past the last delivered batch on an unbroken connection), the
state, and whether the router still scores the pod at the end (the publishers all up: a pod
left out would be left out without evidence). Verdict ok: RESETs == restarts and routed.
Batches reported lost are expected here: a subscriber lagging more than a ring (10,000 batches)
behind a burst cannot replay what the ring no longer holds; they are counted, never silent.
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


def publisher(pub: str, replay: str, run: int, seed: int, ready, stop, burst: int = 1500, ring: int = 10_000) -> None:
    """Bursts of 50..``burst`` batches (no pause inside), then a quiet spell of 0.3..1.6 s, until
    ``stop``; each batch's ts names its run and seq."""
    import random

    from kvevents import BlockStored, KVEventBatch
    from kvevents.publisher import ZmqEventPublisher

    rng = random.Random(seed * 1000 + run)
    p = ZmqEventPublisher(pub.replace("127.0.0.1", "*"), replay.replace("127.0.0.1", "*"), topic="",
                          buffer_steps=ring)  # (binds)
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
        tcp: bool = False, routers: int = 2, ring: int = 10_000) -> dict:
    """One run (see the module docstring): per router, per pod figures."""
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
        procs[i] = ctx.Process(target=publisher, args=(*eps[i], runs[i], seed + i, ready, stops[i], burst, ring),
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
        # a router that lags under the load may not have read a restarted pod's new run yet: wait
        # (bounded) until every router has seen at least the restarts made; more than that stays
        # visible (a false reset), fewer after the deadline is a missed one
        seen_by = time.monotonic() + 60.0
        while time.monotonic() < seen_by and any(
                f.sub.health()[f"pod{i}"].resets < made[i] for f in fleets for i in range(PODS)):
            time.sleep(0.05)
        results = []  # while the publishers still run: every pod is up, none may be left out
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
                         "unrecoverable": h.unrecoverable, "probes": f"{h.probes} ({getattr(h, 'probes_moot', 0)} moot)",
                         "state": h.state.value,
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
    ap.add_argument("--ring", type=int, default=10_000, help="the publishers' replay ring (batches; vLLM's default)")
    a = ap.parse_args(argv)
    import faulthandler

    faulthandler.dump_traceback_later(a.seconds + 120, exit=True)  # a hang shows where, and ends
    with tempfile.TemporaryDirectory(prefix="kvbursts-") as d:
        r = run(a.seconds, a.restarts, a.burners, a.seed, d, a.burst, a.tcp, a.routers, a.ring)
    print_table(f"bursts under load: {PODS} publishers ({'tcp' if a.tcp else 'ipc'}, bursts of 50..{a.burst} "
                f"batches, quiet 0.3..1.6 s, ring {a.ring}), {len(r['routers'])} routers (service ingest), {r['burners']} busy "
                f"processes, {r['seconds']:.0f} s; deliveries per router "
                f"{[x['delivered'] for x in r['routers']]}", HEADER, rows(r))
    bad = [p for x in r["routers"] for p in x["pods"] if p["resets"] != p["restarts"] or not p["routed"]]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
