"""The chaos suite's ``plane`` set: attacks on the NATS JetStream event plane, as tables.

    python benchmarks/chaos_plane.py            # the full set (a minute or two)
    python benchmarks/chaos_plane.py --quick    # the short form (CI runs it as tests/chaos/test_plane_attacks.py)
    python benchmarks/chaos.py --set plane      # the same, from the chaos suite

Each run starts its own nats-server (Debian's). What is done and judged: ``tests/chaos/plane_attacks.py``.

1. Forged messages on live pods' subjects while the writers publish (our ``"nats"`` publisher,
   one per pod), first without the server's permissions (what the reader's own checks catch),
   then with the plane's users and permissions (the attacker logs in as a replica). Figures:
   forged messages published / stored by the server / rejected by the reader (run, seq or id
   that cannot follow) / garbage (malformed) / conflicts (a second message for a delivered
   batch) / forgeries applied (won the race to a pod's next seq with a well-formed id), real
   batches published / delivered / reported lost (GAP) / dropped as a conflict / **silently
   dropped** (target 0).
2. Snapshots a replica must not trust: refused, restored, **serving another stream's index**
   (target 0), batches missing from its index against a cold read of the stream (target 0),
   and the cold-start reason it gives.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._table import print_table  # noqa: E402
from tests.chaos.plane_attacks import SNAPSHOT_CASES, forgery_run, snapshot_run  # noqa: E402


def run(quick: bool = False, seed: int = 20261127) -> dict:
    """Print both tables; return the headline figures."""
    batches, forgeries = (600, 120) if quick else (20_000, 3_000)
    t0 = time.monotonic()
    rows, silent = [], 0
    for secured in (False, True):
        r = forgery_run(batches=batches, forgeries=forgeries, pods=4, secured=secured, seed=seed)
        silent += r["silent"]
        rows.append(["with permissions (attacker logs in as a replica)" if secured else "no permissions",
                     r["forged"], r["forged_stored"], r["rejected"], r["malformed"], r["conflicts"],
                     r["forged_accepted"], r["published"], r["delivered"], r["reported"], r["conflict_dropped"],
                     r["silent"]])
    print_table(f"1. forged messages on live pods' subjects ({batches:,} real batches over 4 pods, "
                f"{forgeries:,} forgeries of 6 kinds in turn; {time.monotonic() - t0:.0f} s)",
                ["server", "forged", "stored", "rejected", "malformed", "conflicts", "forgeries applied",
                 "real batches", "delivered", "reported lost", "conflict-dropped", "silently dropped"], rows)
    t1 = time.monotonic()
    srows, foreign = [], 0
    for case in SNAPSHOT_CASES:
        r = snapshot_run(case)
        foreign += r["wrong_index"] if case == SNAPSHOT_CASES[0] else 0
        srows.append([case, r["refused"], "yes" if r["restored"] else "no (cold start)", r["wrong_index"],
                      r["foreign_pods"], r["missing"], r["reason"][:90]])
    print_table(f"2. snapshots a replica must not trust (one fresh server each; {time.monotonic() - t1:.0f} s)",
                ["snapshot", "refused", "restored", "wrong index", "another stream's pods", "batches missing",
                 "cold-start reason"], srows)
    print(f"targets: 0 real batches silently dropped after a forgery (here {silent}); 0 replicas serving another "
          f"stream's index (here {foreign}); with permissions, 0 forgeries stored")
    return {"silent": silent, "foreign": foreign}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--seed", type=int, default=20261127)
    args = ap.parse_args()
    figures = run(args.quick, args.seed)
    sys.exit(1 if figures["silent"] or figures["foreign"] else 0)


if __name__ == "__main__":
    main()
