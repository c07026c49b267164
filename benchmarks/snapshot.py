"""Router snapshots: size, save time, load time and time to ready for a 1M-block index.

Builds the same index as ``benchmarks/router.py`` (documents of 256 blocks on 3 of 64 pods:
~1M keys, ~3.4M (block, pod, tier) entries, ~1M learned engine hashes), then times
``KVRouter.snapshot()`` and ``KVRouter.restore()`` into a fresh router (CPU time of this
process, best of ``--rounds``) and checks the restored router answers as the original. Peer:
a cold rebuild, i.e. re-applying every batch (what a restarted router without a snapshot must
wait for, if the stream still held it). Target (issue 12): ready in <= 5 s from a 1M-block
snapshot.

    python benchmarks/snapshot.py [--blocks N] [--rounds R]
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.router import build_index, make_docs, pin_one_core  # noqa: E402
from consumers import KVRouter, fastpath_status  # noqa: E402


def _cpu(fn):
    gc.collect()
    t = time.process_time()
    out = fn()
    return time.process_time() - t, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=1 << 20)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    where = pin_one_core()
    rnd = random.Random(7)
    docs = make_docs(rnd, args.blocks)
    build_s, r = _cpu(lambda: build_index(docs, 64, rnd))
    entries, keys = r.entries(), len(r.index)
    print(f"# router snapshot benchmark ({where}; {fastpath_status()}; index backend "
          f"{type(r.index).__name__})\n")
    print(f"index: {keys:,} keys, {entries:,} (block, pod, tier) entries, {r.learned.size:,} learned engine hashes; "
          f"built (cold, by apply()) in {build_s:.1f} s CPU\n")
    saves, loads, data = [], [], b""
    for _ in range(args.rounds):
        s, data = _cpu(lambda: r.snapshot(stream_seq=123))
        saves.append(s)
        fresh = KVRouter(r.config)
        t, info = _cpu(lambda: fresh.restore(data))
        loads.append(t)
        assert info.entries == entries and info.stream_seq == 123
    prompt = docs[0][0]
    same = {p: s.tokens_by_tier for p, s in fresh.score(prompt).items()} == \
        {p: s.tokens_by_tier for p, s in r.score(prompt).items()}
    dig_s, _ = _cpu(lambda: (fresh.state_digest() == r.state_digest()) or sys.exit("restored state differs"))
    ready = min(loads)
    print("| measure | ours | target | met |")
    print("| --- | ---: | --- | --- |")
    print(f"| snapshot size | {len(data) / 1e6:.1f} MB ({len(data) / entries:.1f} B per entry, "
          f"{len(data) / keys:.1f} B per key) | | |")
    print(f"| save (snapshot()) | {min(saves):.2f} s | | |")
    print(f"| load (restore() into a fresh router) | {ready:.2f} s | <= 5 s | {'yes' if ready <= 5 else 'NO'} |")
    print(f"| cold rebuild by re-applying every batch (peer) | {build_s:.1f} s | | |")
    print(f"| restored router answers as the original (score of a document) | {'yes' if same else 'NO'} | | |")
    print(f"| state_digest() of both (equal) | {dig_s / 2:.2f} s each | | |")


if __name__ == "__main__":
    main()
