"""Publisher -> subscriber, two processes: delivered events/s and the caller's cost per publish().

    python benchmarks/pubsub.py [--batches N] [--events-per-batch 16] [--quick]

The subscriber (our ``kvevents.Subscriber``, replay on) runs in a child process; the parent
publishes N batches of GPU BlockStored events (16 tokens per block) as fast as it can, timing
each ``publish()`` call, and the child reports when the last batch was delivered and what was
missing. Delivered rate = delivered events / (last delivery - first publish), both read from
the same wall clock. Where ``import vllm`` works (see ../shared/peers/; from a venv without
it, the script re-runs itself under ``$KVEVENTS_PEER_PYTHON`` or ``../peer-venv``'s interpreter
when one exists), vLLM's own ZmqEventPublisher is run the same way on the same batches, in the
same run, and the ratio is printed. Physical limit column: a bare pyzmq PUB -> SUB of the same pre-encoded payloads
(no encoding, no decoding, no bookkeeping) — what ZeroMQ + Python can move at all.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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


def run_bare_subscriber(endpoint: str, expect: int, warm_max_bytes: int = 0) -> None:
    """A counting SUB: no decoding, no bookkeeping beyond seq continuity (what a publisher
    benchmark needs from its consumer: never the bottleneck, and proof nothing went missing).
    Warm-up frames: topic b"warm", or a payload of at most ``warm_max_bytes``."""
    import zmq

    s = zmq.Context.instance().socket(zmq.SUB)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.setsockopt(zmq.RCVHWM, 0)
    s.connect(endpoint)
    print("ready", flush=True)
    got = 0
    first = last = 0.0
    first_seq = last_seq = -1
    synced = False
    recv, more = s.recv, s.getsockopt
    while got < expect:
        try:
            frames = [recv(zmq.NOBLOCK)]
        except zmq.Again:
            if not s.poll(5000):
                break
            continue
        while more(zmq.RCVMORE):
            frames.append(recv())
        if frames[0] == b"warm" or len(frames[-1]) <= warm_max_bytes:
            if not synced:
                synced = True
                print("synced", flush=True)
            continue
        seq = int.from_bytes(frames[1], "big")
        if got == 0:
            first = time.time()
            first_seq = seq
        got += 1
        last_seq = seq
        last = time.time()
    missing = (last_seq - first_seq + 1 - got) if got else expect
    print(json.dumps({"got": got, "first": first, "last": last, "missing": missing}), flush=True)


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


def bench_publisher(name: str, make_pub, kind, n: int, n_events: int, tmp: str, counting: bool = False) -> dict:
    """Delivered rate through our Subscriber (``counting=False``) or to a counting SUB."""
    ep, rep = f"ipc://{tmp}/{name}.pub", f"ipc://{tmp}/{name}.rep"
    pub = make_pub(ep, rep)
    batches = [kind.KVEventBatch(ts=float(i), events=make_events(kind, n_events, i), data_parallel_rank=0)
               for i in range(n)]
    warm = kind.KVEventBatch(ts=0.0, events=make_events(kind, 1, 0), data_parallel_rank=WARMUP_RANK)
    if counting:
        import msgspec

        warm_bytes = len(msgspec.msgpack.encode(warm))
        proc = _spawn(["--role", "bare-sub", "--endpoint", ep, "--expect", str(n),
                       "--warm-max-bytes", str(warm_bytes)])
    else:
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
    if counting:
        return {"delivered_eps": out["got"] * n_events / elapsed if elapsed > 0 else 0.0,
                "delivered": out["got"], "silent_loss": n - out["got"]}
    return {
        "delivered_eps": out["events"] / elapsed if elapsed > 0 else 0.0,
        "delivered": out["got"], "lost_reported": out["lost"], "gaps": out["gaps"],
        "silent_loss": n - out["got"] - out["lost"],
        "publish_us_mean": sum(per_call) / len(per_call) * 1e6,
        "publish_us_p99": per_call[int(len(per_call) * 0.99)] * 1e6,
        "publish_us_p50": per_call[len(per_call) // 2] * 1e6,
    }


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


def _use_peer_venv() -> None:
    """Where ``import vllm`` fails here but the peer venv exists (``$KVEVENTS_PEER_PYTHON``, else
    ``../peer-venv`` beside the checkout), run this script under that venv's interpreter: both
    publishers (and every subscriber process) then run on one interpreter and one pyzmq/msgspec."""
    try:
        import vllm  # noqa: F401
        return
    except Exception:  # noqa: BLE001 - any import failure: look for the peer venv
        pass
    root = Path(__file__).resolve().parent.parent
    peer = os.environ.get("KVEVENTS_PEER_PYTHON") or str(root.parent / "peer-venv" / "bin" / "python")
    if os.environ.get("_KVEVENTS_IN_PEER") or not os.path.exists(peer) \
            or os.path.abspath(peer) == os.path.abspath(sys.executable):
        return
    print(f"# peer: vLLM not importable here; running under {peer}", file=sys.stderr, flush=True)
    os.environ["_KVEVENTS_IN_PEER"] = "1"
    os.execv(peer, [peer, str(Path(__file__).resolve()), *sys.argv[1:]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", default="main", help=argparse.SUPPRESS)
    ap.add_argument("--endpoint", help=argparse.SUPPRESS)
    ap.add_argument("--replay", help=argparse.SUPPRESS)
    ap.add_argument("--expect", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--warm-max-bytes", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--batches", type=int, default=20_000)
    ap.add_argument("--events-per-batch", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=7, help="interleaved rounds (medians are reported)")
    ap.add_argument("--quick", action="store_true", help="2,000 batches, one round")
    args = ap.parse_args()
    if args.role == "sub":
        return run_subscriber(args.endpoint, args.replay, args.expect, idle=3.0)
    if args.role == "bare-sub":
        return run_bare_subscriber(args.endpoint, args.expect, args.warm_max_bytes)
    if args.quick:
        args.batches, args.repeat = 2_000, 1

    _use_peer_venv()
    import kvevents

    tmp = tempfile.mkdtemp(prefix="kvbench-")
    n, k = args.batches, args.events_per_batch
    pubs = {"kvevents": (lambda ep, rep: kvevents.ZmqEventPublisher(ep, rep, topic="bench"), kvevents)}
    peer = "absent"
    try:
        from vllm.distributed import kv_events as vk
        import vllm
        peer = f"vllm {vllm.__version__}"
        pubs["vllm"] = (lambda ep, rep: vk.ZmqEventPublisher(0, ep, rep, topic="bench"), vk)
    except Exception as exc:  # noqa: BLE001 - any import failure means no peer
        print(f"# peer: vLLM not importable ({type(exc).__name__}); set it up with "
              f"bash ../shared/peers/setup-vllm.sh DIR and run this script in that venv", file=sys.stderr)

    # Interleaved rounds (ours, then the peer, then the next round...), so both see the same
    # machine weather; ratios are taken per round and the median is the verdict.
    runs: dict[str, dict[str, list[dict]]] = {name: {"count": [], "sub": []} for name in pubs}
    for r in range(args.repeat):
        for mode in ("count", "sub"):
            for name, (make_pub, kind) in pubs.items():
                runs[name][mode].append(bench_publisher(f"{name}{mode}{r}", make_pub, kind, n, k, tmp,
                                                        counting=mode == "count"))
    bare = [bench_bare(n, k, tmp)["delivered_eps"] for _ in range(args.repeat)]

    def med(values):
        return statistics.median(values)

    rows = []
    for name, m in runs.items():
        sub = m["sub"]
        rows.append([name, med([x["delivered_eps"] for x in m["count"]]), med([x["delivered_eps"] for x in sub]),
                     med([x["publish_us_p50"] for x in sub]), med([x["publish_us_mean"] for x in sub]),
                     med([x["publish_us_p99"] for x in sub]),
                     sum(x["delivered"] for x in m["count"] + sub), sum(x["lost_reported"] for x in sub),
                     sum(x["silent_loss"] for x in m["count"] + sub)])
    rows.append(["bare pyzmq (limit)", med(bare), None, None, None, None, None, None, None])
    print(f"# pubsub: {n} batches x {k} GPU events (16 tokens/block), ipc://, 2 processes; {args.repeat} "
          f"interleaved rounds, medians; peer: {peer}; machine: {os.cpu_count()} cores")
    print_table("delivered rate and caller cost", ["publisher", "to counting SUB ev/s", "via Subscriber ev/s",
                                                    "publish() us p50", "publish() us mean",
                                                    "publish() us p99", "batches delivered",
                                                    "reported lost", "silent loss"], rows)
    print("(delivered = first publish() to last arrival in a second process. To a counting SUB that only "
          "checks seq continuity: the publisher's rate. Via kvevents.Subscriber: decoding and ordering too; "
          "the same consumer for both publishers, so it bounds both rates.)")
    if "vllm" in runs:
        def ratios(mode, key, inverse=False):
            pairs = zip(runs["kvevents"][mode], runs["vllm"][mode])
            return sorted((b[key] / a[key]) if inverse else (a[key] / b[key]) for a, b in pairs)

        rc, rs = ratios("count", "delivered_eps"), ratios("sub", "delivered_eps")
        cost = ratios("sub", "publish_us_p50")
        silent = sum(x["silent_loss"] for mode in ("count", "sub") for x in runs["kvevents"][mode])
        print(f"\nper-round ratios ours/vllm (median [min..max]):")
        print(f"  delivered to a counting SUB  {med(rc):.2f}x [{rc[0]:.2f}..{rc[-1]:.2f}]  "
              f"target >= 1.5x: {'met' if med(rc) >= 1.5 else 'NOT met'}")
        print(f"  delivered via Subscriber     {med(rs):.2f}x [{rs[0]:.2f}..{rs[-1]:.2f}]")
        print(f"  caller cost, publish() p50   {med(cost):.2f}x [{cost[0]:.2f}..{cost[-1]:.2f}]  "
              f"target <= 1.0x: {'met' if med(cost) <= 1.0 else 'NOT met'}")
        print(f"  silent loss (ours)           {silent}  target 0: {'met' if silent == 0 else 'NOT met'}")


if __name__ == "__main__":
    main()
