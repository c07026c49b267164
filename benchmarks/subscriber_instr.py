"""The subscriber's hot path in instructions per frame (callgrind), for a before/after of a change:

    python benchmarks/subscriber_instr.py                # this checkout
    python benchmarks/subscriber_instr.py --root OTHER   # another checkout (C extension built in place)

One child under ``valgrind --tool=callgrind`` per (mode, raw): connect mode (the subscriber's SUB
connects to a PUB) and bind mode (the subscriber binds, the PUB connects and sends under a topic),
payloads delivered raw or decoded. A plain ZeroMQ PUB queues n (then 2n) in-order live frames of a
16-event batch in the subscriber's SUB socket (unbounded HWMs) and, after a settle wait, the
measured region is ``poll(0)`` until every frame was delivered: 64 frames per poll, the drain's
bound. Instructions per frame = (Ir(2n) - Ir(n)) / n, all threads (nothing else runs then).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SETTLE = 20.0  # seconds for the queued frames to reach the SUB socket (valgrind runs ~50x slower)


def child(root: str, mode: str, raw: bool, n: int) -> None:
    sys.path.insert(0, root)
    import tempfile

    import zmq

    from kvevents import BlockStored, KVEventBatch, Subscriber, encode_batch
    from benchmarks import _callgrind

    ctx = zmq.Context.instance()
    d = tempfile.mkdtemp(prefix="kvsi-")
    ep = f"ipc://{d}/p.pub"
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.setsockopt(zmq.LINGER, 0)
    topic = b"kv@p@m"
    if mode == "connect":
        pub.bind(ep)
        sub = Subscriber([(ep, None, "p")], raw=raw, tail_probe_after=None, rcvhwm=0)
    else:
        sub = Subscriber(bind=ep, raw=raw, tail_probe_after=None, rcvhwm=0)
        pub.connect(ep)
    payload = encode_batch(KVEventBatch(1.0, [BlockStored([i], None, list(range(16)), 16, None, "GPU", None)
                                             for i in range(16)], 0))
    seq = 0

    def send(k: int) -> None:
        nonlocal seq
        for _ in range(k):
            pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])
            seq += 1

    got = 0
    end = time.monotonic() + 600
    while not got and time.monotonic() < end:  # the slow joiner
        send(1)
        got = len(sub.poll(50))
    while sub.poll(200):
        pass
    region = _callgrind.Region(os.environ["KV_CALLGRIND_LIB"])
    region.instrument()
    for k in (1, 2, 1, 2):
        send(k * n)
        time.sleep(SETTLE)  # outside the region: every frame queued in the SUB socket first
        region.label = f"{k}"
        region.start()
        left = k * n
        polls = 0
        while left > 0:
            left -= len(sub.poll(0))
            polls += 1
        region.stop()
        print(f"k={k} polls={polls}", file=sys.stderr)
    sub.close()
    pub.close(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=str(HERE.parent), help="the checkout to measure")
    ap.add_argument("--n", type=int, default=64 * 40, help="frames in the smaller region")
    ap.add_argument("--child", nargs=2, metavar=("MODE", "RAW"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.root, args.child[0], args.child[1] == "raw", args.n)
    sys.path.insert(0, str(HERE.parent))
    from benchmarks._callgrind import require_tools, new_out_dir, read_dumps, run_child
    from benchmarks._table import format_table

    require_tools()
    rows = []
    for mode in ("connect", "bind"):
        for raw in ("raw", "decoded"):
            out = new_out_dir(f"kvcg-sub-{mode}-{raw}-")
            env = dict(os.environ, PYTHONPATH=f"{args.root}:{HERE.parent}", PYTHONHASHSEED="0")
            rc, tail = run_child(["--instr-atstart=no", sys.executable, __file__, "--child", mode, raw,
                                  "--root", args.root, "--n", str(args.n)], out, env, timeout=1800)
            if rc != 0:
                raise SystemExit(f"child {mode}/{raw} failed ({rc}): {tail}")
            # the dumps of one label are the two repeats: keep the lower (a dump can catch a GC pass)
            dumps = sorted(Path(out).glob("cg.out.*"))
            by: dict[str, list[int]] = {}
            for p in dumps:
                text = p.read_text()
                m, s = re.search(r"^desc: Trigger: Client Request: (.*)$", text, re.M), re.search(r"^summary: (\d+)", text, re.M)
                if m and s and m.group(1).strip() != "-discard-":
                    by.setdefault(m.group(1).strip(), []).append(int(s.group(1)))
            per = (min(by["2"]) - min(by["1"])) / args.n
            polls = [int(x) for x in re.findall(r"k=2 polls=(\d+)", tail)]
            fpp = f"{2 * args.n / max(polls):.1f}" if polls else "?"  # 64: every frame was queued first
            rows.append([mode, raw, f"{per:,.0f}", fpp])
    print(format_table(f"subscriber instructions per frame (callgrind Ir, all threads, (2n - n), n={args.n}; "
                       f"{args.root})", ["mode", "payload", "instr/frame", "frames/poll"], rows))


if __name__ == "__main__":
    main()
