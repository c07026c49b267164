"""The demo's RSS past the point where its replay rings are full: the plateau, shown quickly.

    python benchmarks/rss_plateau.py [--ring 500] [--window 2000] [--learned 20000] [--keys 50000] [--duration 90] [--engines 3] [--tolerance 8]

Runs ``kvevents demo`` in this process (``kvdemo.run.execute``, no baseline engines) with every
bound that fills slowly made small, so that the point where all of them are full comes in
seconds: the engines' replay rings (``buffer_steps=--ring``; the default 10,000 batches take
minutes to fill at the demo's rate, which is why no earlier run reached the plateau) and the
request-lifecycle windows of finished ids (``--window``; default 65,536 per window, two per
engine) and the router's learned engine-hash -> key map (``--learned``; default ``max_entries``,
4,194,304 mappings: the demo adds ~1,500 a second and never reaches it, so this map alone grew
RSS by ~0.1-0.2 MiB/s in every earlier run, in doubling reallocations of its C table seen with
an LD_PRELOAD malloc tracer: 1.5, 3, 6 MiB). It samples this process's RSS, the rings' fill, the windows' fill and the router's index
entries every second of the demo's loop (the drain and summary after it are not sampled), and
prints the curve.

The judgement is on the part after the rings and the windows are full: RSS growth over it, per
second and in all, beside the growth while they were filling (issue 10's tracemalloc survey
found these two, and the index, bounded by ``max_entries``, growing; the index entries are
printed so its part shows). The target: after that point RSS grows by at most ``--tolerance``
MiB (default 8) over the rest of the run; a drift of the old ~0.1 MB/s would be 0.1 x the
seconds left.
"""

from __future__ import annotations

import argparse
import functools
import io
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._table import print_table  # noqa: E402


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ring", type=int, default=500, help="replay ring of each engine, batches (default 500)")
    ap.add_argument("--window", type=int, default=2000, help="finished-id window of each request lifecycle (default 2000)")
    ap.add_argument("--learned", type=int, default=20000,
                    help="the router's learned engine-hash -> key mappings at most (default 20000)")
    ap.add_argument("--keys", type=int, default=50000,
                    help="the router index's keys at most (max_entries; default 50000). The index keeps a key "
                         "whose every bit was cleared (its parent link) until key-count eviction, so with the "
                         "default 4,194,304 its key table grows for hours at the demo's rate")
    ap.add_argument("--duration", type=float, default=90.0, help="seconds of demo (default 90)")
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--tolerance", type=float, default=8.0, help="MiB of growth allowed after the rings are full")
    ap.add_argument("--every", type=float, default=1.0, help="seconds between samples")
    args = ap.parse_args()

    import kvdemo.nodes as nodes
    import manager.lifecycle as lifecycle
    from kvdemo.run import DemoOptions, DemoRun, execute

    windows = []
    life_init = lifecycle.RequestLifecycle.__init__

    @functools.wraps(life_init)
    def small_window(self, owner, recent_limit=args.window):
        life_init(self, owner, recent_limit)
        windows.append(self)

    lifecycle.RequestLifecycle.__init__ = small_window  # harness only, as the ring below

    pubs = []
    real = nodes.ZmqEventPublisher

    def small_ring(*a, **kw):
        kw.setdefault("buffer_steps", args.ring)
        p = real(*a, **kw)
        pubs.append(p)
        return p

    nodes.ZmqEventPublisher = small_ring  # the demo's engines get the small ring (harness only)
    runs = []
    init = DemoRun.__init__

    @functools.wraps(init)
    def capture(self, *a, **kw):
        init(self, *a, **kw)
        runs.append(self)

    DemoRun.__init__ = capture
    build = DemoRun.build

    @functools.wraps(build)
    def small_learned(self):
        build(self)
        self.router._learned.max_size = args.learned  # harness only, as the ring and windows
        index = self.router._index  # and the index's key bound (the low-water mark as make_index sets it)
        index.max_entries = args.keys
        index.low_water = args.keys - max(1, args.keys // 64)

    DemoRun.build = small_learned
    # (t, rss, ring batches, ring bytes, entries, window ids, learned mappings, index keys)
    samples: list[tuple[float, float, int, int, int, int, int, int]] = []
    stop = threading.Event()
    t0 = time.monotonic()

    def sample() -> None:
        while not stop.wait(args.every):
            if time.monotonic() - t0 > args.duration + 1:
                continue  # the demo's loop is over: its drain and summary are not the steady state
            st = [p.stats() for p in list(pubs)]
            router = getattr(runs[0], "router", None) if runs else None
            entries = router.entries() if router is not None else 0
            keys = len(router.index) if router is not None else 0
            learned = sum(map(len, list(router._learned.maps.values()))) if router is not None else 0
            samples.append((time.monotonic() - t0, rss_mib(), sum(s["ring_batches"] for s in st),
                            sum(s["ring_bytes"] for s in st), entries, sum(len(w.recent) for w in list(windows)),
                            learned, keys))

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out = io.StringIO()
    code, run = execute(DemoOptions(duration=args.duration, engines=args.engines, baseline=False,
                                    progress_every=3600.0), out)
    stop.set()
    th.join()
    full_windows = args.window * len(windows)
    learned_full = args.learned - args.learned // 64  # what an eviction leaves (consumers/learned.py)
    keys_full = args.keys - max(1, args.keys // 64)  # what an index eviction leaves
    full_at = next((i for i, s in enumerate(samples) if s[2] >= args.ring * args.engines and s[5] >= full_windows
                    and s[6] >= learned_full and s[7] >= keys_full), None)
    rows = [[f"{t:.0f}", f"{r:.1f}", b, f"{nb / 2**20:.2f}", f"{w:,} / {full_windows:,}", e, f"{k:,}", f"{lm:,}"]
            for t, r, b, nb, e, w, lm, k in samples]
    print_table(f"demo RSS, {args.engines} engines, replay ring {args.ring} batches each, "
                f"{args.duration:.0f} s (sampled every {args.every:g} s)",
                ["t s", "RSS MiB", "ring batches (all)", "ring MiB (all)", "finished-id windows", "router index entries",
                 "index keys", "learned map"],
                rows[:: max(1, len(rows) // 40)])
    print(f"demo exit code {code}; silently lost {run.silently_lost()}")
    if full_at is None:
        last = samples[-1] if samples else (0,) * 8
        print(f"not everything filled (rings {last[2]} of {args.ring * args.engines} batches, windows {last[5]} of "
              f"{full_windows} ids, learned map {last[6]} of {learned_full}, index keys {last[7]} of {keys_full}): run longer or "
              f"with a smaller --ring / --window / --learned / --keys")
        return 2
    t_full, r_full = samples[full_at][0], samples[full_at][1]
    t_end, r_end = samples[-1][0], samples[-1][1]
    r_start = samples[0][1]
    peak_after = max(s[1] for s in samples[full_at:])
    grew_after = peak_after - r_full
    rate_before = (r_full - r_start) / max(1e-9, t_full - samples[0][0])
    rate_after = (r_end - r_full) / max(1e-9, t_end - t_full)
    ok = grew_after <= args.tolerance
    print_table("RSS before and after the rings, the windows, the learned map and the index keys are full",
                ["window", "seconds", "RSS from -> to MiB", "MiB/s", "index entries from -> to"],
                [["filling", f"{t_full - samples[0][0]:.0f}", f"{r_start:.1f} -> {r_full:.1f}",
                  f"{rate_before:.3f}", f"{samples[0][4]} -> {samples[full_at][4]}"],
                 ["full", f"{t_end - t_full:.0f}", f"{r_full:.1f} -> {r_end:.1f} (peak {peak_after:.1f})",
                  f"{rate_after:.3f}", f"{samples[full_at][4]} -> {samples[-1][4]}"]])
    print(f"target: after the rings, the windows, the learned map and the index keys are full RSS grows <= {args.tolerance:g} MiB: "
          f"{'met' if ok else 'NOT MET'} (+{grew_after:.1f} MiB over {t_end - t_full:.0f} s)")
    return 0 if ok and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
