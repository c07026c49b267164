"""Router hot paths in instructions per batch (callgrind): repeatable before/after evidence.

    python benchmarks/router_instr.py                       # every case
    python benchmarks/router_instr.py --cases gpu,rest      # some
    python benchmarks/router_instr.py --against /path/to/other/checkout   # both, side by side

Wall-clock ingest rates on a shared VM move by tens of percent between runs (benchmarks/router.py
reports them as ratios within a run); instruction counts under ``valgrind --tool=callgrind``
repeat for the same code and inputs. One child process per (checkout, case) runs under
callgrind; it builds the router and the payloads, warms up, then applies ``n`` and ``2n``
batches inside callgrind marks (benchmarks/_callgrind.py); instructions per batch =
(Ir(2n) - Ir(n)) / n, which cancels what a region costs once. Every batch has 16 events (vLLM-like
GPU stores of 4 blocks x 16 tokens; ``--blocks`` changes it) and fresh hashes.

Cases:
  gpu       ``apply_payload`` of GPU-store batches (the C path where it is built)
  offload   ``apply_payload`` of offload batches joining hashes the GPU batches taught
  rest      ``apply_payload`` of batches C stops in part-way (a LoRA chain start at event 8:
            the 8 events after it go through the Python path)
  apply     ``apply`` of decoded GPU-store batches (the Python ingest path; decoding outside)
  apply-py  the same with the pure-Python router (``KVEVENTS_PURE_PYTHON=1``: no C extension)
  score     ``score`` of a 512-token prompt against 64 batches' entries
Only public API is used, so ``--against`` can measure an older checkout the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

CASES = ("gpu", "offload", "rest", "apply", "apply-py", "score")
BS = 16


def _batches(n: int, seed: int, lora_at: int | None = None, blocks: int = 4):
    from kvevents import BlockStored, KVEventBatch

    rnd = random.Random(seed)
    gpu, off = [], []
    for _ in range(n):
        evs, offs = [], []
        for e in range(16):
            hs = [rnd.getrandbits(63) for _ in range(blocks)]
            lora = "ad1" if e == lora_at else None
            evs.append(BlockStored(hs, None, [rnd.randrange(150_000) for _ in range(blocks * BS)], BS, None, "GPU",
                                   lora))
            offs.append(BlockStored(hs, None, [], 0, None, "CPU", None))
        gpu.append(KVEventBatch(time.time(), evs, 0))
        off.append(KVEventBatch(time.time(), offs, 0))
    return gpu, off


class _Marks:
    """The callgrind marks (benchmarks/_callgrind.py's client requests), without importing the
    ``benchmarks`` package: the child's ``sys.path`` starts at the checkout under test."""

    def __init__(self, lib: str) -> None:
        import ctypes

        self._lib = ctypes.CDLL(lib)
        self._lib.kv_cg_dump.argtypes = [ctypes.c_char_p]
        self.label = ""

    def start(self) -> None:
        self._lib.kv_cg_dump(b"-discard-")
        self._lib.kv_cg_zero()

    def stop(self) -> None:
        self._lib.kv_cg_dump(self.label.encode())


def _child(case: str, n: int, blocks: int) -> None:
    from consumers import KVRouter, RouterConfig
    from kvevents import encode_batch

    region = _Marks(os.environ["KV_CALLGRIND_LIB"])
    cfg = dict(model="m", block_size=BS, offload_chunk_blocks={"CPU": 1})
    warm = 20
    for k in (0, 1, 2):  # 0: warm-up (not marked)
        count = warm if k == 0 else k * n
        r = KVRouter(RouterConfig(**cfg))
        gpu, off = _batches(count, seed=k, lora_at=8 if case == "rest" else None, blocks=blocks)
        if case == "score":
            for b in _batches(64, seed=99)[0]:
                r.apply("pod", b)
            prompt = [t for ev in _batches(1, seed=99)[0][0].events[:8] for t in ev.token_ids]
            ops = [prompt] * count
        elif case in ("gpu", "rest"):
            ops = [encode_batch(b) for b in gpu]
        elif case == "offload":
            for b in gpu:
                r.apply_payload("pod", encode_batch(b))
            ops = [encode_batch(b) for b in off]
        else:
            ops = gpu
        if k:
            region.label = f"{case}|{k}"
            region.start()
        if case == "score":
            for p in ops:
                r.score(p)
        elif case in ("apply", "apply-py"):
            for b in ops:
                r.apply("pod", b)
        else:
            for p in ops:
                r.apply_payload("pod", p)
        if k:
            region.stop()


def _measure(root: str, case: str, n: int, blocks: int, timeout: float) -> float | None:
    from benchmarks import _callgrind

    out = _callgrind.new_out_dir(f"kvcg-router-{case}-")
    env = dict(os.environ, PYTHONHASHSEED="0", PYTHONPATH=os.path.abspath(root))  # (its consumers/kvevents first)
    env.pop("KVEVENTS_PURE_PYTHON", None)
    if case == "apply-py":
        env["KVEVENTS_PURE_PYTHON"] = "1"
    argv = [sys.executable, os.path.abspath(__file__), "--child", case, "--n", str(n), "--blocks", str(blocks)]
    rc, tail = _callgrind.run_child(argv, out, env, timeout)
    if rc != 0:
        print(f"{case} ({root}): child exited {rc}\n{tail}", file=sys.stderr)
        return None
    ir = _callgrind.read_dumps(out)
    return (ir[f"{case}|2"] - ir[f"{case}|1"]) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--n", type=int, default=40, help="batches in the shorter region (default 40)")
    ap.add_argument("--against", help="another checkout (its root) to measure the same way, e.g. before a change")
    ap.add_argument("--blocks", type=int, default=4, help="blocks of 16 tokens per GPU event (default 4)")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        sys.path.remove(os.path.dirname(os.path.abspath(__file__)))
        return _child(args.child, args.n, args.blocks)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from benchmarks import _callgrind
    from benchmarks._table import format_table

    _callgrind.require_tools()
    cases = _callgrind.pick_cases(ap, args.cases, CASES)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    roots = [("this", here)] + ([("against", args.against)] if args.against else [])
    res = {(name, c): _measure(root, c, args.n, args.blocks, args.timeout) for c in cases for name, root in roots}
    head = ["case", "instr/batch"]
    if args.against:
        head = ["case", "against", "this", "change"]
    rows = []
    for c in cases:
        a = res[("this", c)]
        if args.against:
            b = res[("against", c)]
            ch = "-" if a is None or b is None else f"{(a / b - 1) * 100:+.1f}%"
            rows.append([c, "-" if b is None else f"{b:,.0f}", "-" if a is None else f"{a:,.0f}", ch])
        else:
            rows.append([c, "-" if a is None else f"{a:,.0f}"])
    print(format_table(f"router, instructions per 16-event batch of {args.blocks}-block events "
                       f"(callgrind Ir, (2n - n) / n, n={args.n})",
                       head, rows))
    print(json.dumps({f"{k[0]}:{k[1]}": v for k, v in res.items()}))


if __name__ == "__main__":
    main()
