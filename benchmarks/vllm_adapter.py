"""What the vLLM adapter costs: our manager called through ``KVEventsManagerAdapter`` vs directly.

Part 1 (always): the same scheduler-side call sequence, per request ``on_new_request``, ``lookup``
of each of its blocks, ``prepare_store`` + ``complete_store``, ``prepare_load`` +
``complete_load``, ``on_request_finished``, then ``on_schedule_end`` + ``take_events``, driven
(a) on our CPU manager directly with our types and (b) on the adapter with vLLM's types (what
vLLM's connector does). Rounds alternate a/b; the table gives the median ns per call of each
kind and the overhead. Target: <= 10% per call.

Part 2 (``--engine``, needs a vLLM that can run an engine): a real CPU engine (the tiny test
model of ``tests/vllm/engine.py``) started twice, without offloading and with
``KVEventsOffloadingSpec`` (vLLM's own CPU offloading does not run on its CPU backend, so it
cannot be the comparison); the same requests each time; vLLM's own histograms give the mean
time per output token after the first (a decode step) and to the first token.

Part 3 (``--instr``, needs valgrind): the same call sequence counted under callgrind: instructions
per call of each kind, direct and through the adapter (deterministic: the figure to compare
across changes on a shared machine, where the wall-clock medians move with the load).

    /work/vllmcpu/bin/python benchmarks/vllm_adapter.py [--rounds 15] [--engine] [--instr]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BLOCKS = 16  # blocks per request
REQUESTS = 200  # per round
PASSES = 5
KINDS = ("lookup", "store", "load", "request", "step")


def _keys(r: int, n: int) -> list[bytes]:
    return [(r * 1000 + i).to_bytes(8, "big") + b"\0\0\0\0" for i in range(n)]


def drive(m, make_ctx, requests: list[list[bytes]], out: dict[str, list[float]]) -> None:
    """One round of the call sequence; ``out[kind]`` gets ns per call."""
    pc = time.perf_counter_ns
    t = {k: 0 for k in KINDS}
    n = {k: 0 for k in KINDS}
    for keys in requests:
        ctx = make_ctx()
        t0 = pc()
        m.on_new_request(ctx)
        t["request"] += pc() - t0
        t0 = pc()
        for k in keys:
            m.lookup(k, ctx)
        t["lookup"] += pc() - t0
        n["lookup"] += len(keys)
        t0 = pc()
        m.prepare_store(keys, ctx)
        m.complete_store(keys, ctx)
        t["store"] += pc() - t0
        n["store"] += 1
        t0 = pc()
        m.prepare_load(keys, ctx)
        m.complete_load(keys, ctx)
        t["load"] += pc() - t0
        n["load"] += 1
        t0 = pc()
        m.on_request_finished(ctx)
        t["request"] += pc() - t0
        n["request"] += 1
        t0 = pc()
        m.on_schedule_end(None)
        m.take_events()
        t["step"] += pc() - t0
        n["step"] += 1
    for k in KINDS:
        out[k].append(t[k] / n[k])


def drive_counted(m, make_ctx, requests: list[list[bytes]], region, name: str) -> None:
    """:func:`drive`'s call sequence with a callgrind region around each kind's calls (one dump
    per region, labelled ``name|kind|n``; an ``empty`` region measures the marks' own cost)."""
    start, stop = region.start, region.stop
    for n, keys in enumerate(requests):
        ctx = make_ctx()

        def lookups() -> None:
            for k in keys:
                m.lookup(k, ctx)

        for kind, call in (
            ("empty", lambda: None),
            ("request", lambda: m.on_new_request(ctx)),
            ("lookup", lookups),
            ("store", lambda: (m.prepare_store(keys, ctx), m.complete_store(keys, ctx))),
            ("load", lambda: (m.prepare_load(keys, ctx), m.complete_load(keys, ctx))),
            ("finish", lambda: m.on_request_finished(ctx)),
            ("step", lambda: (m.on_schedule_end(None), m.take_events())),
        ):
            region.label = f"{name}|{kind}|{n}"
            start()
            call()
            stop()


def _pair():
    from vllm.v1.kv_offload.base import ReqContext as VReqContext

    from kvevents_vllm.manager_adapter import KVEventsManagerAdapter
    from manager.base import ReqContext
    from manager.cpu import CPUOffloadingManager

    capacity = 4 * BLOCKS * REQUESTS
    ids = iter(range(10**9))
    return (("direct", CPUOffloadingManager(capacity, "lru", True), lambda: ReqContext(f"r{next(ids)}")),
            ("adapter", KVEventsManagerAdapter(CPUOffloadingManager(capacity, "lru", True)),
             lambda: VReqContext(req_id=f"r{next(ids)}")))


def instr_child(requests: int) -> None:
    import os

    from benchmarks._callgrind import Region

    region = Region(os.environ["KV_CALLGRIND_LIB"])
    pair = _pair()
    for rnd in range(6):  # past the first evictions, uninstrumented (--instr-atstart=no)
        for _, m, make in pair:
            drive(m, make, [_keys(rnd * REQUESTS + r, BLOCKS) for r in range(REQUESTS)], {k: [] for k in KINDS})
    region.instrument()
    reqs = [_keys(10**6 + r, BLOCKS) for r in range(requests)]
    for name, m, make in pair:
        drive_counted(m, make, reqs, region, name)


def bench_instr(requests: int) -> None:
    import os

    from benchmarks._callgrind import require_tools, new_out_dir, read_dumps, run_child

    require_tools()
    out = new_out_dir("kvbench-vllm-adapter-")
    rc, tail = run_child(["--instr-atstart=no", sys.executable, __file__, "--instr-child", str(requests)], out,
                         dict(os.environ, PYTHONPATH=str(ROOT)), timeout=1800)
    if rc != 0:
        sys.exit(f"the callgrind child failed (rc {rc}): {tail}")
    total = {}
    for label, ir in read_dumps(out).items():
        name, kind, _ = label.split("|")
        total[name, kind] = total.get((name, kind), 0) + ir
    print(f"adapter overhead: instructions per call (callgrind, all threads, mean of {requests} requests x {BLOCKS} "
          "blocks after 6 warm-up rounds; the marks' own cost taken off)")
    print(f"{'call':<34}{'direct':>11}{'adapter':>12}{'overhead':>10}")
    label = {"lookup": "lookup (per key)", "store": "prepare_store+complete_store", "load": "prepare_load+complete_load",
             "request": "on_new_request", "finish": "on_request_finished", "step": "on_schedule_end+take_events"}
    whole = {"direct": 0, "adapter": 0}
    for k, text in label.items():
        d, a = ((total[n, k] - total[n, "empty"]) / requests for n in ("direct", "adapter"))
        whole["direct"] += d
        whole["adapter"] += a
        per = BLOCKS if k == "lookup" else 1
        print(f"{text:<34}{d / per:>11.0f}{a / per:>12.0f}{(a / d - 1) * 100:>9.1f}%")
    d, a = whole["direct"], whole["adapter"]
    print(f"{'a whole request (all of the above)':<34}{d:>11.0f}{a:>12.0f}{(a / d - 1) * 100:>9.1f}%")


def bench_calls(rounds: int) -> None:
    direct, adapted = _pair()
    res = {"direct": {k: [] for k in KINDS}, "adapter": {k: [] for k in KINDS}}
    for rnd in range(rounds):
        reqs = [_keys(rnd * REQUESTS + r, BLOCKS) for r in range(REQUESTS)]
        for name, m, make in (direct, adapted)[::1 if rnd % 2 else -1]:
            gc.collect()
            gc.disable()  # a collection inside a round times the collector, not the calls
            try:
                drive(m, make, reqs, res[name])
            finally:
                gc.enable()
    print(f"adapter overhead: median ns per call over {rounds} rounds of {REQUESTS} requests x {BLOCKS} blocks "
          "(rounds alternate the order)")
    print(f"{'call':<34}{'direct ns':>11}{'adapter ns':>12}{'overhead':>10}")
    label = {"lookup": "lookup (per key)", "store": "prepare_store+complete_store", "load": "prepare_load+complete_load",
             "request": "on_new_request+on_request_finished", "step": "on_schedule_end+take_events"}
    total = {"direct": 0.0, "adapter": 0.0}
    for k in KINDS:
        d, a = statistics.median(res["direct"][k]), statistics.median(res["adapter"][k])
        per = BLOCKS if k == "lookup" else 1
        total["direct"] += d * per
        total["adapter"] += a * per
        print(f"{label[k]:<34}{d:>11.0f}{a:>12.0f}{(a / d - 1) * 100:>9.1f}%")
    d, a = total["direct"], total["adapter"]
    print(f"{'a whole request (all of the above)':<34}{d:>11.0f}{a:>12.0f}{(a / d - 1) * 100:>9.1f}%")


def bench_engine() -> None:
    import tempfile

    from tests.vllm.engine import BLOCK, make_tiny_model, start_engine

    model = make_tiny_model(Path(tempfile.mkdtemp(prefix="tiny-")))
    prompts = [[(s * 7919 + i * 31) % 1000 for i in range(4 * BLOCK + 5)] for s in range(8)]
    spec = json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"spec_name": "KVEventsOffloadingSpec",
                                                     "cpu_bytes_to_use": 64 << 20}})
    print(f"engine: tiny 2-layer Llama on vLLM's CPU backend, {PASSES} passes of 8 prompts of 517 tokens, "
          "32 output tokens each; mean decode step (inter-token latency) of the cold pass and the median "
          "of the warm passes, median TTFT and wall time per pass")
    print(f"{'configuration':<30}{'step ms cold':>14}{'step ms warm':>14}{'TTFT ms':>10}{'pass s':>8}")
    for name, extra in (("no offloading", []), ("KVEventsOffloadingSpec", ["--kv-transfer-config", spec])):
        e = start_engine(model, extra)
        try:
            itl, ttft, walls = [], [], []
            for _ in range(PASSES):  # the first pass stores (cold), later ones hit the device cache
                m0, t0 = e.metrics(), time.perf_counter()
                for p in prompts:
                    e.complete(p, 32)
                walls.append(time.perf_counter() - t0)
                m1 = e.metrics()
                itl.append(_mean_delta(m0, m1, "vllm:inter_token_latency_seconds"))
                ttft.append(_mean_delta(m0, m1, "vllm:time_to_first_token_seconds"))
        finally:
            e.stop()
        print(f"{name:<30}{itl[0] * 1e3:>14.2f}{statistics.median(itl[1:]) * 1e3:>14.2f}"
              f"{statistics.median(ttft) * 1e3:>10.1f}{statistics.median(walls):>8.2f}")


def _mean_delta(m0: dict, m1: dict, name: str) -> float:
    return (m1[f"{name}_sum"] - m0.get(f"{name}_sum", 0.0)) / max(1.0, m1[f"{name}_count"] - m0.get(f"{name}_count", 0.0))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--engine", action="store_true", help="also time a real CPU engine with and without our spec")
    ap.add_argument("--instr", type=int, nargs="?", const=50, metavar="REQUESTS",
                    help="also count instructions under callgrind (default 50 requests)")
    ap.add_argument("--instr-child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.instr_child:
        instr_child(args.instr_child)
        return
    bench_calls(args.rounds)
    if args.instr:
        bench_instr(args.instr)
    if args.engine:
        bench_engine()


if __name__ == "__main__":
    main()
