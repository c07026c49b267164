"""Publisher cost in instructions: ours vs vLLM's ZmqEventPublisher, under callgrind.

    python benchmarks/publisher_instr.py [--n 400] [--sub] [--only kvevents] [--no-caller] [--paced]

Each publisher runs in its own child process under ``valgrind --tool=callgrind`` (ours with
this interpreter, vLLM's with the peer venv's: ``$KVEVENTS_PEER_PYTHON``, else ``../peer-venv``;
see ../shared/peers/), on the batches ``benchmarks/pubsub.py`` sends (16 GPU BlockStored events
of 16 tokens), to an ipc:// PUB socket with a replay socket, as in that benchmark. Imports and
set-up run uninstrumented (``--instr-atstart=no``). The child warms up until the replay ring
is full (both default to 10,000 batches: the steady state, eviction included), then publishes
``n`` and ``2n`` batches, each a region marked with callgrind client requests (after a
``gc.collect()``) that ends when the publisher has sent everything (ours: its sender goes idle;
vLLM's: its queue's ``join()``). Instructions per batch = (Ir(2n) - Ir(n)) / n, which cancels
what a region costs once. With ``--sub`` a counting SUB in a second process (not under
valgrind) receives every batch; without it nothing is connected and ZeroMQ drops each message.

Columns: all threads of the process; the caller's thread alone (a second run with
``--separate-threads=yes``, where a client-request dump holds only the requesting thread: the
``publish()`` calls); the rest (the sender thread, ZeroMQ's threads). Repeatable to ~1%
Instruction counts are a proxy (a syscall or a wake-up costs far more than its instructions);
``benchmarks/pubsub.py`` measures the delivered rate.

``--paced``: each batch is published after the previous one was sent (the sender thread asleep
again), as an engine stepping slower than the sender does: every ``publish()`` then pays the
wake-up of the sender, which a back-to-back burst mostly does not.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import _callgrind  # noqa: E402
from benchmarks.pubsub import WARMUP_RANK, make_events  # noqa: E402  (the same batches as that benchmark)
from benchmarks._table import print_table  # noqa: E402

PEER_PYTHON = os.environ.get("KVEVENTS_PEER_PYTHON") or os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "peer-venv", "bin", "python")


def child(which: str, n: int, ep: str, rep: str, flag: str | None, n_events: int, out_dir: str,
          paced: bool = False) -> None:
    ring = 10_000  # both publishers' default buffer_steps
    if which == "vllm":
        from vllm.distributed import kv_events as kind

        pub = kind.ZmqEventPublisher(0, ep, rep, topic="bench")

        def wait_sent() -> None:
            pub._event_queue.join()  # task_done() comes after each send
    else:
        import kvevents as kind

        pub = kind.ZmqEventPublisher(ep, rep, topic="bench")

        def wait_sent() -> None:
            pub._idle.wait()  # set by the sender when it finds nothing more to send

    region = _callgrind.Region(os.environ["KV_CALLGRIND_LIB"])
    warm = kind.KVEventBatch(ts=0.0, events=make_events(kind, 1, 0), data_parallel_rank=WARMUP_RANK)
    if flag:  # a subscriber is connecting: warm-up batches until it says it sees them
        open(flag + ".up", "w").close()  # the parent starts the subscriber now (its idle timeout is 5 s)
        while not os.path.exists(flag):
            pub.publish(warm)
            time.sleep(0.05)
    batches = [kind.KVEventBatch(ts=float(i), events=make_events(kind, n_events, i), data_parallel_rank=0)
               for i in range(4 * n)]
    publish = pub.publish
    region.instrument()  # set-up ran uninstrumented (--instr-atstart=no): fast
    # warm-up: code paths, allocator, socket buffers, and a FULL replay ring (10,000 batches by
    # default in both publishers), so that the regions measure the steady state, eviction included
    for r in range(-(-(ring + n) // n)):
        for b in batches[:n]:
            publish(b)
        wait_sent()
    pos = n
    for k in (1, 2):
        region.label = f"{which}|{k}"
        chunk = batches[pos:pos + k * n]
        pos += k * n
        gc.collect()  # no collection of the set-up's objects falls due inside a region
        region.start()
        if paced:
            for b in chunk:
                publish(b)
                wait_sent()
        else:
            for b in chunk:
                publish(b)
            wait_sent()
        region.stop()
    pub.shutdown()
    with open(os.path.join(out_dir, "done.json"), "w") as f:
        json.dump({"total": pos + -(-(ring + n) // n) * n}, f)


# ---------------------------------------------------------------- parent

read_dumps = _callgrind.read_dumps


def measure(which: str, python: str, n: int, sub: bool, n_events: int, timeout: float, threads: bool,
            paced: bool = False) -> dict:
    """All threads' instructions per batch; with ``threads``, the caller's thread's alone
    (``--separate-threads=yes``: then a dump holds only the thread that asked for it)."""
    out = _callgrind.new_out_dir(f"kvcg-pub-{which}-")
    tmp = tempfile.mkdtemp(prefix="kvcgpub-")
    ep, rep = f"ipc://{tmp}/p.pub", f"ipc://{tmp}/p.rep"
    flag = os.path.join(tmp, "synced") if sub else None
    argv = [python, os.path.abspath(__file__), "--child", which, "--n", str(n), "--endpoint", ep,
            "--replay", rep, "--events-per-batch", str(n_events), "--out-dir", out]
    if flag:
        argv += ["--flag", flag]
    if paced:
        argv.append("--paced")
    lib = _callgrind._build_helper(out)
    env = dict(os.environ, PYTHONHASHSEED="0", KV_CALLGRIND_LIB=lib)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--separate-threads={'yes' if threads else 'no'}",
           f"--callgrind-out-file={out}/cg.out", "--dump-instr=no", "--dump-line=no"] + argv
    child_proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sub_proc = None
    if sub:
        import msgspec

        from kvevents import BlockStored, KVEventBatch

        class K:
            pass
        K.BlockStored, K.KVEventBatch = BlockStored, KVEventBatch
        warm_bytes = len(msgspec.msgpack.encode(KVEventBatch(0.0, make_events(K, 1, 0), WARMUP_RANK)))
        deadline = time.monotonic() + timeout
        while not os.path.exists(flag + ".up"):  # the child's imports run slowly under valgrind
            if child_proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{which}: child under callgrind never opened its publisher")
            time.sleep(0.2)
        sub_proc = subprocess.Popen(
            [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "pubsub.py"),
             "--role", "bare-sub", "--endpoint", ep, "--expect", str(3 * n + -(-(10_000 + n) // n) * n),
             "--warm-max-bytes", str(warm_bytes)], stdout=subprocess.PIPE, text=True)
        assert sub_proc.stdout.readline().strip() == "ready"
        assert sub_proc.stdout.readline().strip() == "synced"
        open(flag, "w").close()
    try:
        tail, _ = child_proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child_proc.kill()
        raise RuntimeError(f"{which}: child under callgrind timed out after {timeout:.0f} s")
    if child_proc.returncode != 0:
        raise RuntimeError(f"{which}: child exited {child_proc.returncode}:\n{tail[-3000:]}")
    got = None
    if sub_proc is not None:
        got = json.loads(sub_proc.stdout.readline())
        sub_proc.wait(30)
    ir = read_dumps(out)
    return {"ir": (ir[f"{which}|2"] - ir[f"{which}|1"]) / n, "dumps": out, "sub": got}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=400, help="batches in the first region (the second has 2n)")
    ap.add_argument("--events-per-batch", type=int, default=16)
    ap.add_argument("--sub", action="store_true", help="a counting SUB receives (else nothing is connected)")
    ap.add_argument("--peer-python", default=PEER_PYTHON, help="interpreter of the venv where vllm imports")
    ap.add_argument("--only", choices=("kvevents", "vllm"), help="measure one publisher")
    ap.add_argument("--no-caller", action="store_true", help="skip the caller-thread run (one child each)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--paced", action="store_true", help="each batch after the previous one was sent")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--endpoint", help=argparse.SUPPRESS)
    ap.add_argument("--replay", help=argparse.SUPPRESS)
    ap.add_argument("--flag", help=argparse.SUPPRESS)
    ap.add_argument("--out-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.n, args.endpoint, args.replay, args.flag, args.events_per_batch,
                     args.out_dir, args.paced)
    _callgrind.require_tools()
    plan = [("kvevents", sys.executable)]
    if os.path.exists(args.peer_python):
        plan.append(("vllm", args.peer_python))
    else:
        print(f"# peer: {args.peer_python} not found; vLLM's publisher not measured", file=sys.stderr)
    if args.only:
        plan = [p for p in plan if p[0] == args.only]
    rows = []
    res = {}
    for which, python in plan:
        t0 = time.monotonic()
        total = measure(which, python, args.n, args.sub, args.events_per_batch, args.timeout, threads=False,
                        paced=args.paced)
        caller = None if args.no_caller else measure(which, python, args.n, args.sub, args.events_per_batch,
                                                      args.timeout, threads=True, paced=args.paced)
        res[which] = (total["ir"], caller["ir"] if caller else None)
        print(f"# {which}: {time.monotonic() - t0:.0f} s under callgrind, dumps in {total['dumps']}"
              + (f"; SUB got {total['sub']}" if total["sub"] else ""), file=sys.stderr)
        tot, cal = res[which]
        rows.append([which, tot, cal, None if cal is None else tot - cal])
    if len(res) == 2:
        (ta, ca), (tb, cb) = res["kvevents"], res["vllm"]
        rows.append(["ours/vllm", f"{ta / tb:.2f}x", f"{ca / cb:.2f}x" if ca and cb else None,
                     f"{(ta - ca) / (tb - cb):.2f}x" if ca and cb else None])
    print_table(f"instructions per published batch ({args.events_per_batch} GPU events; "
                f"{'counting SUB connected' if args.sub else 'nothing connected'}; n={args.n}"
                f"{'; paced: one batch per wake-up' if args.paced else ''})",
                ["publisher", "all threads", "caller thread", "other threads"], rows)

if __name__ == "__main__":
    main()
