"""Store backpressure: the engine's step time with an fs tier throttled below the store rate.

A simulated engine (CPU primary + fs tier) serves requests with unique prompts, so every
offloaded block is a new store for the fs tier. First unthrottled, to measure the rate at
which the engine offers blocks to the tier; then with the tier's store path throttled to
``--fraction`` of that rate, with the default policy (``bounded``: skip while
``max_store_backlog_blocks`` are queued) and with ``unbounded`` (queue everything).

Printed per run: step time p50 / p99 (wall time of ``SimEngine.step()``), blocks offered to
the tier (the primary's completed stores), stored, skipped, store errors, the backlog's peak,
the primary's rejected stores (no room: blocks pinned by queued tier stores), and
``unaccounted`` = offered - stored - skipped - errors after the tier drained (0: nothing
lost silently). Lower is better for step times; a flat p99 under throttling is the point.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import threading
import time
from typing import Any

import numpy as np

from benchmarks._table import format_table
from manager.cpu import CPUOffloadingManager
from manager.engine_sim import SimEngine
from manager.tiering import TieringOffloadingManager
from manager.tiering.fs import FileSystemSecondaryTierManager


class ThrottledFs(FileSystemSecondaryTierManager):
    """The fs tier with its store path limited to ``blocks_per_s`` (a slow disk)."""

    def __init__(self, *a: Any, blocks_per_s: float = 0.0, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.blocks_per_s = blocks_per_s
        self._pace = threading.Lock()
        self._next = time.monotonic()

    def _store_task(self, state, lo, hi):  # type: ignore[no-untyped-def]
        if self.blocks_per_s > 0:
            with self._pace:  # one disk: its time is shared by every store thread
                start = max(self._next, time.monotonic())
                self._next = start + (hi - lo) / self.blocks_per_s
            threading.Event().wait(max(0.0, self._next - time.monotonic()))
        return super()._store_task(state, lo, hi)


def run(root: str, args: argparse.Namespace, blocks_per_s: float, policy: str) -> dict[str, Any]:
    tier = ThrottledFs(root=root, blocks_per_s=blocks_per_s, store_policy=policy,
                       store_policy_args={"max_backlog_blocks": args.backlog} if policy == "bounded" else None)
    primary = CPUOffloadingManager(args.cpu_blocks, enable_events=True)
    m = TieringOffloadingManager(primary, [tier])
    e = SimEngine(m, None, gpu_blocks=2048, block_size=16, offload_block_size=16, host_blocks=args.cpu_blocks,
                  max_num_seqs=16, max_tokens_per_step=4096, row_elems=args.row_elems, use_torch=False,
                  sync_transfers=True)
    rng = np.random.default_rng(1)
    for i in range(args.requests):
        e.add_request(f"r{i}", rng.integers(0, 30000, args.prompt).tolist(), max_new_tokens=1)
    times, peak = [], 0
    t0 = time.perf_counter()
    while e.requests_finished < args.requests:
        s = time.perf_counter()
        e.step()
        times.append(time.perf_counter() - s)
        peak = max(peak, tier.store_backlog())
    served = time.perf_counter() - t0
    e.run_until_idle(max_steps=1_000_000)  # the tier drains
    assert tier.drain_jobs(timeout=600)
    offered = primary.stats().get("stores_completed", getattr(primary, "stores_completed", 0))
    st = tier.stats()
    out = {
        "steps": len(times), "p50": float(np.percentile(times, 50)) * 1e3, "p99": float(np.percentile(times, 99)) * 1e3,
        "served_s": served, "offered": offered, "stored": st["stores"], "skipped": st["blocks_skipped"],
        "errors": st["store_errors"], "peak": peak, "rejected": e.connector.store_rejections,
        "verify": e.load_verify_failures,
    }
    out["unaccounted"] = out["offered"] - out["stored"] - out["skipped"] - out["errors"]
    e.shutdown()
    tier.shutdown()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--prompt", type=int, default=512, help="prompt tokens (32 blocks of 16)")
    ap.add_argument("--row-elems", type=int, default=8192, help="int64 per GPU block row (default: 64 KiB blocks)")
    ap.add_argument("--cpu-blocks", type=int, default=1024)
    ap.add_argument("--backlog", type=int, default=512, help="max_store_backlog_blocks of the bounded policy")
    ap.add_argument("--fraction", type=float, default=0.25, help="throttle: this fraction of the offered rate")
    ap.add_argument("--dir", default="/var/tmp")
    args = ap.parse_args(argv)
    rows = []
    base = tempfile.mkdtemp(prefix="fs_bp-", dir=args.dir)
    try:
        free = run(f"{base}/free", args, 0.0, "unbounded")
        rate = free["offered"] / free["served_s"]
        throttle = rate * args.fraction
        runs = [("unthrottled", "unbounded", free),
                (f"throttled to {args.fraction:g}x", "bounded", run(f"{base}/b", args, throttle, "bounded")),
                (f"throttled to {args.fraction:g}x", "unbounded", run(f"{base}/u", args, throttle, "unbounded"))]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    for name, policy, r in runs:
        rows.append([name, policy, r["steps"], f"{r['p50']:.2f}", f"{r['p99']:.2f}", r["offered"], r["stored"],
                     r["skipped"], r["errors"], r["peak"], r["rejected"], r["unaccounted"]])
    print(format_table(
        f"fs tier store backpressure: {args.requests} requests x {args.prompt} tokens, offered rate unthrottled "
        f"{rate:.0f} blocks/s, throttle {throttle:.0f} blocks/s",
        ["tier", "policy", "steps", "step p50 ms", "step p99 ms", "offered", "stored", "skipped", "errors",
         "backlog peak", "primary rejected", "unaccounted"], rows))
    print("offered = the primary's completed stores (each cascades to the tier once); unaccounted = offered - "
          "stored - skipped - errors after the tier drained (0 = nothing lost silently)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
