"""The router service's ingest path in instructions per delivery (callgrind), for a before/after:

    python benchmarks/ingest_instr.py                  # this checkout
    python benchmarks/ingest_instr.py --against OTHER  # and another checkout (its root, C extension built in place)

One child per (checkout, case) under ``valgrind --tool=callgrind`` builds the service's ingest
side (``kvservice.ingest.Fleet``, ``--pods`` configured pods, connect mode, nothing published;
its subscriber closed once its health is read, so no ZeroMQ I/O thread retries a connection
inside a region: callgrind counts every thread) and raw deliveries as its subscriber makes them
(payload bytes, vLLM's empty topic, the configured publisher's identity), each a batch of
``--events`` GPU ``BlockStored`` events of 4 blocks, then counts the instructions of ``n`` and
``2n`` deliveries into an index held full (``router.max_entries`` 8,192 after a warm-up of
twice as many blocks: every store evicts, no table grows). The garbage collector is collected
before and off during each region, so no collection falls in one region and not the other; per
delivery = ``(2n - n) / n``, so what every region pays once (a health round) cancels out. Cases:

  take  ``Fleet.take(delivery)`` alone: attribution looked up, the lag stamp, the router's
        ``handle`` under the fleet's lock, the outcome acted on
  loop  the ingest thread's whole loop over a source whose polls hand over 64 deliveries each
        (a backlog: never paced) until it runs dry and stops the fleet

Only what both sides of a change have is used (the loop: ``Fleet.run``, else ``Fleet._loop``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile

CASES = ("take", "loop")
POLL = 64  #: deliveries per poll in the ``loop`` case
MAX_ENTRIES = 1 << 13  #: the router's index size: held full during the regions


class _Marks:
    """The callgrind marks without importing the ``benchmarks`` package (the child's path starts
    at the checkout under test)."""

    def __init__(self, lib: str) -> None:
        import ctypes

        self._lib = ctypes.CDLL(lib)
        self._lib.kv_cg_dump.argtypes = [ctypes.c_char_p]

    def start(self) -> None:
        self._lib.kv_cg_dump(b"-discard-")
        self._lib.kv_cg_zero()

    def stop(self, label: str) -> None:
        self._lib.kv_cg_dump(label.encode())


class _Backlog:
    """A source whose polls return the given deliveries ``POLL`` at a time, then stop the fleet."""

    def __init__(self, fleet, deliveries: list, health) -> None:
        self.fleet, self.left, self._health = fleet, deliveries, health

    def poll(self, timeout_ms: int) -> list:
        got, self.left = self.left[:POLL], self.left[POLL:]
        if not got:
            self.fleet._stop.set()
        return got

    def health(self) -> dict:
        return self._health

    def close(self) -> None:
        pass


def _deliveries(pods: int, count: int, events: int, seed: int, seq0: int) -> list:
    from kvevents import BlockStored, Delivery, DeliveryKind, KVEventBatch, encode_batch

    rnd = random.Random(seed)
    out = []
    for i in range(count):
        evs = [BlockStored([rnd.getrandbits(63) for _ in range(4)], None, [rnd.randrange(150_000) for _ in range(64)],
                           16, None, "GPU", None) for _ in range(events)]
        payload = encode_batch(KVEventBatch(1000.0 + i, evs, 0))
        out.append(Delivery(DeliveryKind.BATCH, f"pod{i % pods}", "", seq0 + i // pods, None, 1000.5 + i,
                            payload=payload))
    return out


def _child(case: str, n: int, pods: int, events: int) -> None:
    from kvservice.config import from_dict
    from kvservice.ingest import Fleet

    marks = _Marks(os.environ["KV_CALLGRIND_LIB"])
    d = tempfile.mkdtemp(prefix="kv-ingest-instr-")
    # an index held full (warmed up past max_entries): each region evicts as it stores and none
    # grows a table (a growth's copy, landing in one region or the other as the heap lies, would
    # read as a per-delivery cost of hundreds of instructions)
    cfg = from_dict({"router": {"model": "m", "max_entries": MAX_ENTRIES}, "subscriber": {"late_join": False},
                     "pods": [{"name": f"pod{p}", "endpoint": f"ipc://{d}/pod{p}.pub"} for p in range(pods)]}).validate()
    fleet = Fleet(cfg, health_interval=1e9)  # (one health round per region: cancelled by (2n - n))
    fleet.sub.close()
    fleet.sub = source = _Backlog(fleet, [], fleet.sub.health())
    loop = getattr(fleet, "run", None) or fleet._loop
    seq = 0
    warm = 2 * MAX_ENTRIES // (4 * events)
    for k, count in ((0, warm), (1, n), (2, 2 * n)):  # 0: warm-up (not marked)
        ds = _deliveries(pods, count, events, seed=k, seq0=seq)
        seq += count // pods + 1
        if case == "loop":
            source.left = ds
            fleet._stop.clear()
        gc.collect()  # (a collection inside one region but not the other would be counted as per-delivery)
        gc.disable()
        if k:
            marks.start()
        if case == "take":
            for dl in ds:
                fleet.take(dl)
        else:
            loop()
        if k:
            marks.stop(f"{case}|{k}")
        gc.enable()
    assert fleet.deliveries == warm + 3 * n and fleet.router.entries() <= MAX_ENTRIES, fleet.deliveries
    fleet.stop()


def _measure(root: str, case: str, args) -> float | None:
    from benchmarks import _callgrind

    out = _callgrind.new_out_dir(f"kvcg-ingest-{case}-")
    env = dict(os.environ, PYTHONHASHSEED="0", PYTHONPATH=os.path.abspath(root))
    argv = [sys.executable, os.path.abspath(__file__), "--child", case, "--n", str(args.n), "--pods", str(args.pods),
            "--events", str(args.events)]
    rc, tail = _callgrind.run_child(argv, out, env, args.timeout)
    if rc != 0:
        print(f"{case} ({root}): child exited {rc}\n{tail}", file=sys.stderr)
        return None
    ir = _callgrind.read_dumps(out)
    return (ir[f"{case}|2"] - ir[f"{case}|1"]) / args.n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--n", type=int, default=256, help="deliveries in the shorter region (default 256)")
    ap.add_argument("--pods", type=int, default=8, help="configured pods, deliveries round-robin (default 8)")
    ap.add_argument("--events", type=int, default=4, help="BlockStored events of 4 blocks per batch (default 4)")
    ap.add_argument("--against", help="another checkout (its root) measured the same way, e.g. before a change")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        sys.path.remove(os.path.dirname(os.path.abspath(__file__)))
        return _child(args.child, args.n, args.pods, args.events)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, here)
    from benchmarks import _callgrind
    from benchmarks._table import format_table

    _callgrind.require_tools()
    cases = _callgrind.pick_cases(ap, args.cases, CASES)
    roots = [("this", here)] + ([("against", args.against)] if args.against else [])
    res = {(name, c): _measure(root, c, args) for c in cases for name, root in roots}
    rows = []
    for c in cases:
        a = res[("this", c)]
        row = [c, "-" if a is None else f"{a:,.0f}"]
        if args.against:
            b = res[("against", c)]
            row[1:1] = ["-" if b is None else f"{b:,.0f}"]
            row.append("-" if a is None or b is None else f"{(a / b - 1) * 100:+.1f}%")
        rows.append(row)
    head = ["case", "against", "this", "change"] if args.against else ["case", "instr/delivery"]
    print(format_table(f"service ingest, instructions per delivery ({args.pods} pods, {args.events} events of "
                       f"4 blocks per batch; callgrind Ir, (2n - n) / n, n={args.n})", head, rows))
    print(json.dumps({f"{k[0]}:{k[1]}": v for k, v in res.items()}))


if __name__ == "__main__":
    main()
