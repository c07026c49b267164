"""Publisher -> subscriber, two processes: delivered events/s and the caller's cost per publish().

    python benchmarks/pubsub.py [--batches N] [--events-per-batch 16] [--quick]

The subscriber (our ``kvevents.Subscriber``, replay on) runs in a child process; the parent
publishes N batches of GPU BlockStored events (16 tokens per block) as fast as it can, timing
each ``publish()`` call, and the child reports when the last batch was delivered and what was
missing. Delivered rate = delivered events / (last delivery - first publish), both read from
the same wall clock. Where ``import vllm`` works (see ../shared/peers/), vLLM's own
ZmqEventPublisher is run the same way on the same batches, in the same run, and the ratio is
printed. Physical limit column: a bare pyzmq PUB -> SUB of the same pre-encoded payloads
(no encoding, no decoding, no bookkeeping) — what ZeroMQ + Python can move at all.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._table import print_table  # noqa: E402

WARMUP_RANK = 7  # data_parallel_rank marks warm-up batches; measured ones carry 0


def make_events(kind, n_events: int, i: int):
    base = i * n_events
    return [kind.BlockStored([(base + k) * 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF],
                             None if k == 0 else (base + k - 1) * 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF,
                             list(range(k * 16, k * 16 + 16)), 16, None, "GPU", None)
            for k in range(n_events)]


# ---------------------------------------------------------------- subscriber (child process)

def run_subscriber(endpoint: str, replay: str | None, expect: int, idle: float) -> None:
    from kvevents import DeliveryKind, PublisherSpec, Subscriber

    sub = Subscriber([PublisherSpec(endpoint, replay, "bench")])
    print("ready", flush=True)
    synced = False
    got = events = 0
    first = last = 0.0
    lost = 0
    deadline_idle = None
    while True:
        ds = sub.poll(100)
        now = time.time()
        for d in ds:
            if d.kind is DeliveryKind.BATCH:
                if d.batch.data_parallel_rank == WARMUP_RANK:
                    if not synced:
                        synced = True
                        print("synced", flush=True)
                    continue
                if got == 0:
                    first = now
                got += 1
                events += len(d.batch.events)
                last = now
            elif d.kind is DeliveryKind.GAP:
                lost += d.missed
        if got and got + lost >= expect:
            break
        if ds:
            deadline_idle = now + idle
        elif deadline_idle is not None and now > deadline_idle and got:
            break
    h = sub.health()["bench"]
    print(json.dumps({"got": got, "events": events, "first": first, "last": last, "lost": lost,
                      "gaps": h.gaps, "recovered": h.recovered}), flush=True)
    sub.close()


def run_bare_subscriber(endpoint: str, expect: int) -> None:
    import zmq

    s = zmq.Context.instance().socket(zmq.SUB)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.setsockopt(zmq.RCVHWM, 0)
    s.connect(endpoint)
    print("ready", flush=True)
    got = 0
    first = last = 0.0
    synced = False
    while got < expect:
        if not s.poll(5000):
            break
        frames = s.recv_multipart()
        if frames[0] == b"warm":
            if not synced:
                synced = True
                print("synced", flush=True)
            continue
        if got == 0:
            first = time.time()
        got += 1
        last = time.time()
    print(json.dumps({"got": got, "first": first, "last": last}), flush=True)


# ---------------------------------------------------------------- publisher side (parent)

def _spawn(args: list[str]) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _sync(proc: subprocess.Popen, send_warm) -> None:
    import select

    while True:
        send_warm()
        r, _, _ = select.select([proc.stdout], [], [], 0.01)
        if r:
            assert proc.stdout.readline().strip() == "synced"
            return


def bench_publisher(name: str, make_pub, kind, n: int, n_events: int, tmp: str) -> dict:
    ep, rep = f"ipc://{tmp}/{name}.pub", f"ipc://{tmp}/{name}.rep"
    pub = make_pub(ep, rep)
    batches = [kind.KVEventBatch(ts=float(i), events=make_events(kind, n_events, i), data_parallel_rank=0)
               for i in range(n)]
    warm = kind.KVEventBatch(ts=0.0, events=make_events(kind, 1, 0), data_parallel_rank=WARMUP_RANK)
    proc = _spawn(["--role", "sub", "--endpoint", ep, "--replay", rep, "--expect", str(n)])
    _sync(proc, lambda: pub.publish(warm))
    publish = pub.publish
    per_call = []
    t0 = time.time()
    for b in batches:
        c0 = time.perf_counter()
        publish(b)
        per_call.append(time.perf_counter() - c0)
    out = json.loads(proc.stdout.readline())
    proc.wait(30)
    pub.shutdown()
    per_call.sort()
    elapsed = out["last"] - t0
    return {
        "delivered_eps": out["events"] / elapsed if elapsed > 0 else 0.0,
        "delivered": out["got"], "lost_reported": out["lost"], "gaps": out["gaps"],
        "silent_loss": n - out["got"] - out["lost"],
        "publish_us_mean": sum(per_call) / len(per_call) * 1e6,
        "publish_us_p99": per_call[int(len(per_call) * 0.99)] * 1e6,
        "publish_us_p50": per_call[len(per_call) // 2] * 1e6,
    }


def bench_alone(name: str, make_pub, kind, n: int, n_events: int, tmp: str) -> float:
    """Events/s one publisher pushes out with no subscriber: its own capacity (publish -> all sent)."""
    pub = make_pub(f"ipc://{tmp}/{name}-alone.pub", f"ipc://{tmp}/{name}-alone.rep")
    batches = [kind.KVEventBatch(ts=float(i), events=make_events(kind, n_events, i), data_parallel_rank=0)
               for i in range(n)]
    t0 = time.perf_counter()
    for b in batches:
        pub.publish(b)
    if hasattr(pub, "stats") and "batches_published" in pub.stats():
        while pub.stats()["batches_published"] < n:
            time.sleep(0.0002)
    else:  # vLLM's: its queue is joined once every batch has been sent
        pub._event_queue.join()
    elapsed = time.perf_counter() - t0
    pub.shutdown()
    return n * n_events / elapsed


def bench_bare(n: int, n_events: int, tmp: str) -> dict:
    import zmq

    from kvevents import BlockStored, KVEventBatch, encode_batch

    class K:  # our structs under the names make_events uses
        pass
    K.BlockStored, K.KVEventBatch = BlockStored, KVEventBatch
    payloads = [encode_batch(KVEventBatch(float(i), make_events(K, n_events, i), 0)) for i in range(n)]
    ep = f"ipc://{tmp}/bare.pub"
    s = zmq.Context.instance().socket(zmq.PUB)
    s.setsockopt(zmq.SNDHWM, 0)
    s.bind(ep)
    proc = _spawn(["--role", "bare-sub", "--endpoint", ep, "--expect", str(n)])
    _sync(proc, lambda: s.send_multipart([b"warm", b"\0" * 8, b""]))
    t0 = time.time()
    for i, p in enumerate(payloads):
        s.send_multipart([b"t", i.to_bytes(8, "big"), p])
    out = json.loads(proc.stdout.readline())
    proc.wait(30)
    s.close(0)
    elapsed = out["last"] - t0
    return {"delivered_eps": out["got"] * n_events / elapsed if elapsed > 0 else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", default="main", help=argparse.SUPPRESS)
    ap.add_argument("--endpoint", help=argparse.SUPPRESS)
    ap.add_argument("--replay", help=argparse.SUPPRESS)
    ap.add_argument("--expect", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--batches", type=int, default=20_000)
    ap.add_argument("--events-per-batch", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3, help="runs per publisher; the best is reported")
    ap.add_argument("--quick", action="store_true", help="2,000 batches, one run")
    args = ap.parse_args()
    if args.role == "sub":
        return run_subscriber(args.endpoint, args.replay, args.expect, idle=3.0)
    if args.role == "bare-sub":
        return run_bare_subscriber(args.endpoint, args.expect)
    if args.quick:
        args.batches, args.repeat = 2_000, 1

    import kvevents

    tmp = tempfile.mkdtemp(prefix="kvbench-")
    n, k = args.batches, args.events_per_batch
    results: dict[str, dict] = {}

    def best(name, make_pub, kind):
        runs = [bench_publisher(f"{name}{r}", make_pub, kind, n, k, tmp) for r in range(args.repeat)]
        results[name] = max(runs, key=lambda r: r["delivered_eps"])
        results[name]["alone_eps"] = max(bench_alone(f"{name}{r}", make_pub, kind, n, k, tmp)
                                         for r in range(args.repeat))

    best("kvevents", lambda ep, rep: kvevents.ZmqEventPublisher(ep, rep, topic="bench"), kvevents)
    peer = "absent"
    try:
        from vllm.distributed import kv_events as vk
        import vllm
        peer = f"vllm {vllm.__version__}"
    except Exception as exc:  # noqa: BLE001 - any import failure means no peer
        print(f"# peer: vLLM not importable ({type(exc).__name__}); set it up with "
              f"bash ../shared/peers/setup-vllm.sh DIR and run this script in that venv", file=sys.stderr)
    if peer != "absent":
        best("vllm", lambda ep, rep: vk.ZmqEventPublisher(0, ep, rep, topic="bench"), vk)
    bare = max((bench_bare(n, k, tmp) for _ in range(args.repeat)), key=lambda r: r["delivered_eps"])

    rows = []
    for name, r in results.items():
        rows.append([name, r["delivered_eps"], r["alone_eps"], r["publish_us_p50"], r["publish_us_mean"],
                     r["publish_us_p99"], r["delivered"], r["lost_reported"], r["silent_loss"]])
    rows.append(["bare pyzmq (limit)", bare["delivered_eps"], None, None, None, None, None, None, None])
    print(f"# pubsub: {n} batches x {k} GPU events (16 tokens/block), ipc://, 2 processes, best of "
          f"{args.repeat}; peer: {peer}; machine: {os.cpu_count()} cores")
    print_table("delivered rate and caller cost", ["publisher", "delivered ev/s", "sent alone ev/s",
                                                    "publish() us p50", "publish() us mean",
                                                    "publish() us p99", "delivered",
                                                    "reported lost", "silent loss"], rows)
    print("(delivered: through our Subscriber in a second process; sent alone: the same batches with no "
          "subscriber, publish() of the first to the last one sent — the publisher's own capacity)")
    if "vllm" in results:
        ours, theirs = results["kvevents"], results["vllm"]
        ratio = ours["delivered_eps"] / theirs["delivered_eps"]
        cost = ours["publish_us_p50"] / theirs["publish_us_p50"]
        cost_mean = ours["publish_us_mean"] / theirs["publish_us_mean"]
        alone = ours["alone_eps"] / theirs["alone_eps"]
        print(f"\nratio delivered ours/vllm = {ratio:.2f}x (target >= 1.5x: {'met' if ratio >= 1.5 else 'NOT met'}); "
              f"caller cost p50 ours/vllm = {cost:.2f}x (target <= 1.0x: {'met' if cost <= 1.0 else 'NOT met'}; "
              f"mean {cost_mean:.2f}x: the mean is dominated by waits for the GIL behind the sending thread); "
              f"silent loss ours = {ours['silent_loss']} (target 0: {'met' if ours['silent_loss'] == 0 else 'NOT met'}); "
              f"sent alone ours/vllm = {alone:.2f}x")


if __name__ == "__main__":
    main()
