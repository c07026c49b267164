"""CPU offload manager throughput: ours beside vLLM 0.33's ``CPUOffloadingManager``.

    python benchmarks/manager.py [--quick] [--requests N] [--capacity BLOCKS] [--repeat R]

The trace is deterministic (seeded): ``--docs`` documents whose lengths (in blocks) are drawn
once, requested with Zipf(``--zipf``) popularity; each request is its document's blocks (a
shared prefix) followed by a unique tail. Block keys are 32 hash bytes + a 4-byte group index,
identical for both managers.

Per request, the same call sequence for both managers (the scheduler's pattern):
``on_new_request``; ``lookup`` block by block until the first non-HIT; for the hit prefix
``prepare_load`` + ``touch`` + ``complete_load``; for the rest ``prepare_store`` +
``complete_store``; ``on_request_finished``; drain ``take_events()`` (events enabled).

``--positions``: each request's context says every key's token position (16 tokens a block), as
vLLM 0.33's scheduler does (ours: ``ReqContext.key_positions``; vLLM's:
``set_offload_key_position``), so both LRUs rank a running request's blocks by position.

Rates are per CPU second of this process (time.process_time), which a shared machine
perturbs less than wall time. Columns: requests/s, block operations/s (keys passed through lookup, prepare/complete load,
touch, prepare/complete store), hits (blocks served from the cache). The peer runs where
``import vllm`` works (set up with ``bash ../shared/peers/setup-vllm.sh /work/peer-venv .`` and
run this script from that venv). Target: ours >= 2x vLLM's block ops/s, hits no lower.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._table import fmt_rate, print_table
from manager import CPUOffloadingManager, LookupResult, ReqContext, make_offload_key

TARGET_RATIO = 2.0
POLICIES = ("lru", "arc")


# --- the trace ---------------------------------------------------------------------------------


def build_trace(
    requests: int, docs: int, zipf: float, doc_blocks: tuple[int, int], tail_blocks: tuple[int, int], seed: int
) -> list[list[bytes]]:
    rng = random.Random(seed)
    doc_len = [rng.randint(*doc_blocks) for _ in range(docs)]
    weights = [1.0 / (i + 1) ** zipf for i in range(docs)]
    doc_keys: dict[int, list[bytes]] = {}

    def key(*parts: int) -> bytes:
        h = hashlib.blake2b(b"".join(p.to_bytes(8, "big") for p in parts), digest_size=32).digest()
        return make_offload_key(h, 0)

    trace = []
    for r, d in enumerate(rng.choices(range(docs), weights=weights, k=requests)):
        if d not in doc_keys:
            doc_keys[d] = [key(0, d, i) for i in range(doc_len[d])]
        tail = [key(1, r, i) for i in range(rng.randint(*tail_blocks))]
        trace.append(doc_keys[d] + tail)
    return trace


# --- drivers -------------------------------------------------------------------------------------


def drive(
    mgr: Any, trace: list[list[bytes]], make_ctx: Callable[[str, list[bytes] | None], Any], hit: Any,
    positions: bool = False,
) -> tuple[float, int, int]:
    """Run the trace; (seconds, block ops, hits)."""
    lookup, prepare_load, touch, complete_load = mgr.lookup, mgr.prepare_load, mgr.touch, mgr.complete_load
    prepare_store, complete_store = mgr.prepare_store, mgr.complete_store
    on_new, on_finished, take_events = mgr.on_new_request, mgr.on_request_finished, mgr.take_events
    ops = hits = 0
    gc.collect()
    gc.disable()
    t0 = time.process_time()
    for i, keys in enumerate(trace):
        ctx = make_ctx(f"req-{i}", keys if positions else None)
        on_new(ctx)
        n = 0
        for k in keys:
            if lookup(k, ctx) is not hit:
                break
            n += 1
        ops += n + (n < len(keys))
        if n:
            prefix = keys[:n]
            prepare_load(prefix, ctx)
            touch(prefix, ctx)
            complete_load(prefix, ctx)
            ops += 3 * n
            hits += n
        if n < len(keys):
            rest = keys[n:]
            out = prepare_store(rest, ctx)
            ops += len(rest)
            if out is not None:
                complete_store(out.keys_to_store, ctx)
                ops += len(out.keys_to_store)
        on_finished(ctx)
        for _ in take_events():
            pass
    dt = time.process_time() - t0
    gc.enable()
    return dt, ops, hits


def ours(capacity: int, policy: str) -> tuple[Any, Callable[[str, list[bytes] | None], Any], Any]:
    def make_ctx(req_id: str, keys: list[bytes] | None) -> ReqContext:
        if keys is None:
            return ReqContext(req_id)
        return ReqContext(req_id, None, {k: 16 * (j + 1) for j, k in enumerate(keys)})

    return CPUOffloadingManager(capacity, policy, enable_events=True), make_ctx, LookupResult.HIT


def peer_factory() -> Callable[[int, str], tuple[Any, Callable[[str], Any], Any]] | None:
    try:
        from vllm.v1.kv_offload.base import LookupResult as VLookup
        from vllm.v1.kv_offload.base import ReqContext as VReqContext
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager as VCPU
    except Exception as exc:  # noqa: BLE001 - any import failure means "no peer"
        print(f"peer: vLLM not importable ({type(exc).__name__}: {exc}).")
        print("  set it up with: bash ../shared/peers/setup-vllm.sh /work/peer-venv /work/main")
        print("  then: . /work/peer-venv/bin/activate && python benchmarks/manager.py\n")
        return None

    def make_ctx(req_id: str, keys: list[bytes] | None) -> Any:
        ctx = VReqContext(req_id=req_id)
        for j, k in enumerate(keys or ()):
            ctx.set_offload_key_position(k, 16 * (j + 1))
        return ctx

    def make(capacity: int, policy: str) -> tuple[Any, Callable[[str, list[bytes] | None], Any], Any]:
        return VCPU(capacity, cache_policy=policy, enable_events=True), make_ctx, VLookup.HIT

    return make


def measure(factories: list[Callable[..., Any]], capacity: int, policy: str, trace: list[list[bytes]], repeat: int,  # type: ignore[no-untyped-def]
            positions: bool = False):
    """Median (seconds, ops, hits) per factory; the factories' runs alternate so that a
    disturbance of the machine falls on both alike."""
    times: list[list[float]] = [[] for _ in factories]
    last: list[tuple[int, int]] = [(0, 0)] * len(factories)
    for _ in range(repeat):
        for i, factory in enumerate(factories):
            mgr, make_ctx, hit = factory(capacity, policy)
            dt, ops, hits = drive(mgr, trace, make_ctx, hit, positions)
            times[i].append(dt)
            last[i] = (ops, hits)
    return [(statistics.median(t), *r) for t, r in zip(times, last)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small trace (smoke run)")
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--docs", type=int, default=400)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--capacity", type=int, default=4096, help="cache size in blocks")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--positions", action="store_true", help="contexts give each key's token position")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.repeat = 500, 2
    trace = build_trace(args.requests, args.docs, args.zipf, (8, 64), (2, 16), args.seed)
    total_blocks = sum(map(len, trace))
    print(
        f"trace: {args.requests} requests, {args.docs} docs, zipf {args.zipf}, {total_blocks:,} block refs, "
        f"{len({k for t in trace for k in t}):,} distinct; capacity {args.capacity} blocks; "
        f"median of {args.repeat}; positions {'given' if args.positions else 'unknown'}; "
        f"python {platform.python_version()}\n"
    )
    peer = peer_factory()
    rows = []
    verdicts = []
    for policy in POLICIES:
        results = measure([ours] if peer is None else [ours, peer], args.capacity, policy, trace, args.repeat,
                          args.positions)
        dt, ops, hits = results[0]
        ours_ops = ops / dt
        rows.append([policy, "ours", fmt_rate(args.requests / dt), fmt_rate(ours_ops), hits, "-"])
        if peer is not None:
            pdt, pops, phits = results[1]
            peer_ops = pops / pdt
            ratio = ours_ops / peer_ops
            rows.append([policy, "vLLM 0.33", fmt_rate(args.requests / pdt), fmt_rate(peer_ops), phits, "1.00x"])
            rows[-2][-1] = f"{ratio:.2f}x"
            ok = ratio >= TARGET_RATIO and hits >= phits
            verdicts.append(f"{policy}: {ratio:.2f}x ops/s, hits {hits} vs {phits} -> {'MET' if ok else 'NOT MET'}")
    print_table(
        "CPU offload manager, lookup -> load -> store per request (events on)",
        ["policy", "impl", "requests/s", "block ops/s", "hits", "ours/peer"],
        rows,
    )
    for v in verdicts:
        print(f"target >= {TARGET_RATIO:.0f}x vLLM ops/s with hits no lower -- {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
