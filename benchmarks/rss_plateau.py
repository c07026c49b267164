"""The demo's RSS past the point where its replay rings are full: the plateau, shown quickly.

    python benchmarks/rss_plateau.py [--ring 500] [--duration 60] [--engines 3] [--tolerance 8]

Runs ``kvevents demo`` in this process (``kvdemo.run.execute``, no baseline engines) with the
engines' replay rings made small (``buffer_steps=--ring``: the default 10,000 batches take minutes
to fill at the demo's rate, which is why no earlier run reached the plateau), samples this
process's RSS, the rings' fill and the router's index entries every second, and prints the curve.

The judgement is on the part after the last ring filled: RSS growth over it, per second and in
all, beside the growth while the rings were filling. Everything that grows in the demo has a
bound (issue 10's tracemalloc survey: the rings; the router's index, ``max_entries``; the
request-lifecycle windows of finished ids, 65,536 per engine); with the rings full only those
two may still grow, and the index entries are printed so that their part shows. The target:
after the rings are full, RSS grows by at most ``--tolerance`` MiB (default 8) over the rest of
the run — a drift of the old ~0.1 MB/s would be 0.1 x the seconds left.
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
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of demo (default 60)")
    ap.add_argument("--engines", type=int, default=3)
    ap.add_argument("--tolerance", type=float, default=8.0, help="MiB of growth allowed after the rings are full")
    ap.add_argument("--every", type=float, default=1.0, help="seconds between samples")
    args = ap.parse_args()

    import kvdemo.nodes as nodes
    from kvdemo.run import DemoOptions, DemoRun, execute

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
    samples: list[tuple[float, float, int, int, int]] = []  # (t, rss MiB, ring batches, ring bytes, index entries)
    stop = threading.Event()
    t0 = time.monotonic()

    def sample() -> None:
        while not stop.wait(args.every):
            st = [p.stats() for p in list(pubs)]
            router = getattr(runs[0], "router", None) if runs else None
            entries = router.entries() if router is not None else 0
            samples.append((time.monotonic() - t0, rss_mib(), sum(s["ring_batches"] for s in st),
                            sum(s["ring_bytes"] for s in st), entries))

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    out = io.StringIO()
    code, run = execute(DemoOptions(duration=args.duration, engines=args.engines, baseline=False,
                                    progress_every=3600.0), out)
    stop.set()
    th.join()
    full_at = next((i for i, s in enumerate(samples) if s[2] >= args.ring * args.engines), None)
    rows = [[f"{t:.0f}", f"{r:.1f}", b, f"{nb / 2**20:.2f}", e] for t, r, b, nb, e in samples]
    print_table(f"demo RSS, {args.engines} engines, replay ring {args.ring} batches each, "
                f"{args.duration:.0f} s (sampled every {args.every:g} s)",
                ["t s", "RSS MiB", "ring batches (all)", "ring MiB (all)", "router index entries"],
                rows[:: max(1, len(rows) // 40)])
    print(f"demo exit code {code}; silently lost {run.silently_lost()}")
    if full_at is None:
        print(f"the rings never filled ({samples[-1][2] if samples else 0} of {args.ring * args.engines} batches): "
              "run longer or with a smaller --ring")
        return 2
    t_full, r_full = samples[full_at][0], samples[full_at][1]
    t_end, r_end = samples[-1][0], samples[-1][1]
    r_start = samples[0][1]
    peak_after = max(s[1] for s in samples[full_at:])
    grew_after = peak_after - r_full
    rate_before = (r_full - r_start) / max(1e-9, t_full - samples[0][0])
    rate_after = (r_end - r_full) / max(1e-9, t_end - t_full)
    ok = grew_after <= args.tolerance
    print_table("RSS before and after the rings are full",
                ["window", "seconds", "RSS from -> to MiB", "MiB/s", "index entries from -> to"],
                [["rings filling", f"{t_full - samples[0][0]:.0f}", f"{r_start:.1f} -> {r_full:.1f}",
                  f"{rate_before:.3f}", f"{samples[0][4]} -> {samples[full_at][4]}"],
                 ["rings full", f"{t_end - t_full:.0f}", f"{r_full:.1f} -> {r_end:.1f} (peak {peak_after:.1f})",
                  f"{rate_after:.3f}", f"{samples[full_at][4]} -> {samples[-1][4]}"]])
    print(f"target: after the rings are full RSS grows <= {args.tolerance:g} MiB: "
          f"{'met' if ok else 'NOT MET'} (+{grew_after:.1f} MiB over {t_end - t_full:.0f} s)")
    return 0 if ok and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
