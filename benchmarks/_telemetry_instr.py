"""``telemetry_overhead.py --instructions``: the same paths and modes, costed in instructions.

Wall and CPU time on a shared 2-core VM move by +-8% between runs; instruction counts under
``valgrind --tool=callgrind`` repeat for the same binary, inputs and environment
(``PYTHONHASHSEED=0`` is set for the children). One child process per path runs under callgrind
(Python's start-up under valgrind costs ~15 s, so not one per (path, mode)); it warms every mode
up, then for each mode runs the path's operation loop with ``n`` and with ``2n`` operations, each
loop being exactly the region the timing mode times (``_Clock``), marked with callgrind client
requests. Instructions per operation = (Ir(2n) - Ir(n)) / (ops(2n) - ops(n)), which cancels what
a region costs once (its set-up and tear-down inside the marks). Ir counts every thread of the
process: the publisher's sender thread and ZeroMQ's I/O threads are included, as in the CPU
times of the timing mode.

Differences from the timing mode, for determinism: the metric reader never collects on a timer
(``export_interval_millis=inf``; under valgrind a 500 ms timer would collect ~50x more often per
operation than at native speed, and a wall-clock-dependent number of times), so ``metrics`` is
the per-operation recording cost only; the publisher waits for its sends by joining its sender
thread (``shutdown``) instead of polling ``stats()``; the subscriber's settle sleep before its
loop is 30x longer. What stays timing-dependent: how many batches the publisher's sender takes
per wake-up (the GIL switch interval), and the span processor's 5 s export timer.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

from benchmarks import _callgrind
from benchmarks._table import format_table

SETTLE = 30.0


def _modes(args, every: int) -> list[tuple[str, bool, int | None]]:
    modes = [("off", False, None), ("metrics", True, None), (f"traces 1/{every}", True, every)]
    if not args.no_every_batch and every != 1:
        modes.append(("traces 1/1", True, 1))
    return modes


def _child(args, T) -> None:
    p = args.instr_child
    n, n_req, every = args.n, args.engine_requests, args.sample_every
    _, fn, mult = T.PATHS[p]
    ops = n_req if mult is None else n * mult
    warm = 4 if p == "engine" else 20
    modes = [T.Mode(name, m, e, export_interval_millis=math.inf) for name, m, e in _modes(args, every)]
    for mode in modes:
        fn(mode, warm)
    lib = os.environ["KV_CALLGRIND_LIB"]
    region = _callgrind.Region(lib)
    T._INSTR, T._SETTLE, T._REGION = True, SETTLE, region
    done: dict[str, int] = {}
    for mode in modes:
        for k in (1, 2):
            region.label = f"{mode.name}|{k}"
            fn(mode, k * ops)
            done[region.label] = region.last.n
    T._REGION = None
    for mode in modes:
        mode.shutdown()
    with open(os.path.join(os.path.dirname(lib), "ops.json"), "w") as f:
        json.dump(done, f)


def main(args, ap, T) -> None:
    if args.n is None:
        args.n = 100
    if args.engine_requests is None:
        args.engine_requests = 8
    if args.instr_child:
        return _child(args, T)
    _callgrind.require_tools()
    every = args.sample_every
    modes = _modes(args, every)
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    for p in paths:
        if p not in T.PATHS:
            ap.error(f"unknown path {p!r}; choose from {', '.join(T.PATHS)}")
    env = dict(os.environ, PYTHONHASHSEED="0")
    root = os.path.dirname(os.path.dirname(os.path.abspath(T.__file__)))
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    rows, verdicts, excluded = [], [], []
    for p in paths:
        out = _callgrind.new_out_dir(f"kvcg-{p}-")
        argv = [sys.executable, os.path.abspath(T.__file__), "--instr-child", p, "--n", str(args.n),
                "--engine-requests", str(args.engine_requests), "--sample-every", str(every)]
        if args.no_every_batch:
            argv.append("--no-every-batch")
        t0 = time.monotonic()
        rc, tail = _callgrind.run_child(argv, out, env, timeout=args.instr_timeout)
        secs = time.monotonic() - t0
        label = T.PATHS[p][0]
        if rc != 0:
            msg = f"{p}: excluded, child under callgrind {'timed out' if rc is None else f'exited {rc}'}"
            excluded.append(msg)
            print(msg + "\n" + tail, file=sys.stderr)
            continue
        ir = _callgrind.read_dumps(out)
        with open(os.path.join(out, "ops.json")) as f:
            ops = json.load(f)
        print(f"# {p}: child {secs:.0f} s under callgrind, dumps in {out}", file=sys.stderr)
        per = {}
        for name, _, _ in modes:
            a, b = f"{name}|1", f"{name}|2"
            per[name] = (ir[b] - ir[a]) / (ops[b] - ops[a])
        for name, _, e in modes:
            ov = (per[name] / per["off"] - 1) * 100
            if name == "off":
                rows.append([label, name, per[name], "-", "-", "-"])
                continue
            if e == 1 and every != 1:
                verdict = "(info)"
            else:
                ok = ov <= T.TARGET
                verdict = "met" if ok else "NOT met"
                verdicts.append(ok)
            rows.append([label, name, per[name], f"{ov:+.2f}%", f"<= {T.TARGET:g}%", verdict])
    print(format_table(
        f"telemetry overhead, instructions per operation (callgrind Ir, all threads, (2n - n) difference; "
        f"n={args.n}, publisher n={4 * args.n}, engine requests={args.engine_requests}, sample_every={every})",
        ["path", "mode", "instr/op", "overhead", "target", "verdict"], rows))
    print(f"\n5% target met on {sum(verdicts)} of {len(verdicts)} (path, SDK-on mode) cells "
          "(instruction counts; metric collections on a timer excluded, see --help/the module docstring)")
    for msg in excluded:
        print(msg)
