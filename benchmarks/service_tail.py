"""Where the score route's tail comes from: the API loop thread's stalls, and what overlapped them.

    python benchmarks/service_tail.py                  # 262,144 blocks, 4 s per run, stream on and off
    python benchmarks/service_tail.py --blocks 1048576 --seconds 5 --runs 3

The service of ``benchmarks/service.py`` (64 pods x 2 tiers, pre-filled, the same prompts), ``wrk
-t1 -c16`` in its own process, runs alternating with and without the feeder's ~1,000 batches/s.
For each run it records, on the loop thread, every ``FastHttp.data_received`` call (start, end),
and on the ingest thread every delivery taken and every health round (start, end), plus the
collector's passes (``gc.callbacks``, any thread). A **stall** is a gap of over 1 ms between
two consecutive ``data_received`` calls while 16 clients keep the loop busy: the loop thread
was waiting (for the GIL, the fleet lock, a CPU) or doing something else. Each stall is put down
to what overlapped it: a health round, deliveries taken, a collection, or nothing we recorded
(the machine). It also prints each thread's CPU share and context switches (``/proc``): the
involuntary ones are preemptions.

A diagnostic: it wraps a few service methods to time them, which costs a little per call; the
figures of record are ``benchmarks/service.py``'s.
"""

from __future__ import annotations

import argparse
import collections
import gc
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchmarks.service as S  # noqa: E402


def _thread_stat(tid: int) -> tuple[float, int, int]:
    """(CPU seconds, voluntary, involuntary context switches) of one thread of this process."""
    base = f"/proc/{os.getpid()}/task/{tid}"
    f = Path(f"{base}/stat").read_text().rsplit(")", 1)[1].split()
    st = dict(line.split(":\t") for line in Path(f"{base}/status").read_text().splitlines() if "ctxt" in line)
    return ((int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK"), int(st["voluntary_ctxt_switches"]),
            int(st["nonvoluntary_ctxt_switches"]))


class Recorder:
    """Timestamps of the loop's reads and the ingest thread's work (perf_counter seconds)."""

    def __init__(self, fleet) -> None:
        from kvservice import fasthttp

        self.reads: list[tuple[float, float]] = []
        self.takes: list[tuple[float, float]] = []
        self.rounds: list[tuple[float, float]] = []
        self.gcs: list[tuple[float, float, int, str]] = []
        self._gc_t0 = 0.0
        clock = time.perf_counter
        reads, takes, rounds = self.reads, self.takes, self.rounds
        orig_read = fasthttp.FastHttp.data_received

        def data_received(proto, data):
            t0 = clock()
            orig_read(proto, data)
            reads.append((t0, clock()))

        fasthttp.FastHttp.data_received = data_received
        orig_take, orig_round = fleet.take, fleet._health_round

        def take(d):
            t0 = clock()
            orig_take(d)
            takes.append((t0, clock()))

        def health_round():
            t0 = clock()
            orig_round()
            rounds.append((t0, clock()))

        fleet.take, fleet._health_round = take, health_round
        gc.callbacks.append(self._gc)

    def _gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        else:
            self.gcs.append((self._gc_t0, time.perf_counter(), info["generation"], threading.current_thread().name))

    def clear(self) -> None:
        for x in (self.reads, self.takes, self.rounds, self.gcs):
            x.clear()

    def stalls(self, over: float = 1e-3) -> dict:
        ev = sorted(self.reads)
        gaps = [(a[1], b[0]) for a, b in zip(ev, ev[1:]) if b[0] - a[1] > over]
        why: collections.Counter = collections.Counter()
        for a, b in gaps:
            def hit(xs):
                return any(s < b and e > a for s, e, *_ in xs)
            why["health round" if hit(self.rounds) else "collector" if hit(self.gcs) else
                "deliveries taken" if hit(self.takes) else "none recorded"] += 1
        lost = sum(b - a for a, b in gaps)
        return {"n": len(gaps), "ms": lost * 1e3, "max": max((b - a for a, b in gaps), default=0.0) * 1e3,
                "why": dict(why), "reads": len(ev)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=1 << 18)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--runs", type=int, default=2, help="pairs of runs (stream on, stream off)")
    ap.add_argument("--gil-switch-ms", type=float, help="api.gil_switch_ms for the service (default: its own)")
    ap.add_argument("--poll-interval", type=float, help="subscriber.poll_interval (s) for the service (default: its own)")
    ap.add_argument("--no-stream-off", action="store_true", help="only the runs with the stream")
    args = ap.parse_args()
    rnd = random.Random(0)
    d = Path(tempfile.mkdtemp(prefix="kvbench-tail-"))
    cfg, fleet, docs = S.build_fleet(d, 64, args.blocks, rnd)
    if args.poll_interval is not None:
        fleet.poll_interval = args.poll_interval
    if args.gil_switch_ms is not None:
        cfg.api.gil_switch_ms = args.gil_switch_ms
    rec = Recorder(fleet)
    svc = S.Service(cfg, fleet)
    tids: dict = {}
    svc.loop.call_soon_threadsafe(lambda: tids.update(loop=threading.get_native_id()))
    while "loop" not in tids:
        time.sleep(0.01)
    ingest_tid = fleet._thread.native_id
    script = S.lua_script(d, S.prompts(docs, rnd, 32))
    print(f"# 64 pods x 2 tiers, {args.blocks:,} blocks, wrk -t1 -c16, {args.seconds:g} s per run; "
          f"switch interval {sys.getswitchinterval() * 1e3:g} ms, poll_interval {fleet.poll_interval * 1e3:g} ms\n")
    hdr = ("stream", "req/s", "p50 ms", "p99 ms", "stalls > 1 ms", "stall ms", "longest", "stalls overlapping",
           "collections (max ms)", "loop CPU %", "loop inv. switches", "ingest CPU %", "ingest vol. switches")
    rows = []
    try:
        for _ in range(args.runs):
            for stream in (True,) if args.no_stream_off else (True, False):
                feed = S.start_feeder(d, [0, 1, 2, 3], rate=1000, seconds=args.seconds + 5) if stream else None
                rec.clear()
                l0, i0 = _thread_stat(tids["loop"]), _thread_stat(ingest_tid)
                r = S.run_wrk(svc.url, script, 16, args.seconds)
                l1, i1 = _thread_stat(tids["loop"]), _thread_stat(ingest_tid)
                if feed is not None:
                    feed.kill()
                    feed.wait()
                s = rec.stalls()
                gcs = rec.gcs
                rows.append(("~1,000 batches/s" if stream else "none", r["rps"], r["p50"], r["p99"], s["n"], s["ms"],
                             s["max"], ", ".join(f"{k} {v}" for k, v in sorted(s["why"].items())) or "-",
                             f"{len(gcs)} ({max(((e - b) * 1e3 for b, e, *_ in gcs), default=0):.2f})",
                             100 * (l1[0] - l0[0]) / args.seconds, l1[2] - l0[2],
                             100 * (i1[0] - i0[0]) / args.seconds, i1[1] - i0[1]))
    finally:
        svc.close()
    S.print_table("the API loop thread's stalls under wrk -c16 (a stall: > 1 ms between two reads)", list(hdr), rows)
    ok = [r for r in rows if r[0] != "none"]
    if ok:
        print(f"\nmedian with the stream: p99 {statistics.median(r[3] for r in ok):.2f} ms, "
              f"stalls {statistics.median(r[4] for r in ok):g} per run")


if __name__ == "__main__":
    main()
