"""Wire-format throughput: encode and decode events/s, ours beside a bare msgspec typed codec.

    python benchmarks/wire.py [--quick]

Workloads: GPU events (BlockStored, one block of 16 tokens, a random uint64 hash and parent,
block_size 16, medium GPU) and offload events (BlockStored, no tokens, block_size 0, no parent,
medium CPU), in batches of 1, 16 and 256 events.

Columns: ours through the module functions (``kvevents.encode_batch`` / ``decode_batch``) and
through reusable ``BatchEncoder`` / ``BatchDecoder`` instances; the bare limit for Python
(``msgspec.msgpack.Encoder().encode`` / ``msgspec.msgpack.Decoder(KVEventBatch).decode`` of the
same payloads, no wrapper); and, where ``import vllm`` works, vLLM's own ``KVEventBatch``
structs through the same msgspec calls (what its publisher and consumers do).

Target: our decode within 1.25x of the bare typed decode, i.e. ours/bare >= 0.80 in rate.
"""

from __future__ import annotations

import argparse
import gc
import os
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

import msgspec

import kvevents
from benchmarks._table import fmt_rate, print_table
from kvevents import BlockStored, KVEventBatch

TARGET_DECODE_RATIO = 0.80  # ours/bare in rate, i.e. at most 1.25x the bare time
BATCH_SIZES = (1, 16, 256)
BLOCK_SIZE = 16


# --- payloads --------------------------------------------------------------------------------


def _gpu_event(rng: random.Random) -> dict[str, Any]:
    return dict(
        block_hashes=[rng.getrandbits(64)],
        parent_block_hash=rng.getrandbits(64),
        token_ids=[rng.randrange(0, 152_000) for _ in range(BLOCK_SIZE)],
        block_size=BLOCK_SIZE,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


def _offload_event(rng: random.Random) -> dict[str, Any]:
    return dict(
        block_hashes=[rng.getrandbits(64)],
        parent_block_hash=None,
        token_ids=[],
        block_size=0,
        lora_id=None,
        medium="CPU",
        lora_name=None,
    )


WORKLOADS: dict[str, Callable[[random.Random], dict[str, Any]]] = {"gpu": _gpu_event, "offload": _offload_event}


def make_fields(kind: str, n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(f"{kind}-{n}-{seed}")
    return [WORKLOADS[kind](rng) for _ in range(n)]


# --- timing ----------------------------------------------------------------------------------


def calibrate(fn: Callable[[Any], Any], arg: Any, target_s: float) -> int:
    """Loop count so that one run of ``fn(arg)`` x loops takes about ``target_s``."""
    loops = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(loops):
            fn(arg)
        dt = time.perf_counter() - t0
        if dt >= target_s / 4 or loops >= 1 << 24:
            return max(1, int(loops * target_s / max(dt, 1e-9)))
        loops *= 4


def best_times(
    cands: dict[str, tuple[Callable[[Any], Any], Any]], repeats: int, target_s: float
) -> tuple[dict[str, float], list[dict[str, float]]]:
    """Best seconds per call for each candidate, and every round's seconds per call.

    Runs are interleaved (one run of each candidate per round, in a shuffled order so periodic
    load elsewhere on the machine cannot lock onto one candidate) with gc off.
    """
    loops = {name: calibrate(fn, arg, target_s) for name, (fn, arg) in cands.items()}
    order = list(cands)
    shuffler = random.Random(len(order) * 7919 + repeats)
    rounds: list[dict[str, float]] = []
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            this: dict[str, float] = {}
            shuffler.shuffle(order)
            for name in order:
                fn, arg = cands[name]
                n = loops[name]
                rng = range(n)
                t0 = time.perf_counter()
                for _ in rng:
                    fn(arg)
                this[name] = (time.perf_counter() - t0) / n
            rounds.append(this)
    finally:
        if gc_was:
            gc.enable()
    best = {name: min(r[name] for r in rounds) for name in cands}
    return best, rounds


def ratio(best: dict[str, float], name: str, ref: str = "bare") -> float:
    """rate(name) / rate(ref) from the best runs (the least disturbed by load elsewhere)."""
    return best[ref] / best[name]


# --- vLLM peer (optional) --------------------------------------------------------------------


def load_vllm() -> tuple[Any, str]:
    try:
        from vllm.distributed import kv_events as vk  # type: ignore[import-not-found]
    except Exception as exc:  # ImportError, or vLLM failing to initialise on this machine
        return None, f"not available ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    import vllm  # type: ignore[import-not-found]

    return vk, f"vllm {getattr(vllm, '__version__', '?')}"


# --- main ------------------------------------------------------------------------------------


def run(quick: bool) -> int:
    repeats, target_s = (15, 0.002) if quick else (101, 0.002)
    vk, vllm_note = load_vllm()

    print("kvevents wire benchmark")
    print(
        f"python {platform.python_version()} ({platform.machine()}), msgspec {msgspec.__version__}, "
        f"kvevents {kvevents.__version__}, {os.cpu_count()} CPUs; vLLM peer: {vllm_note}"
    )
    print(
        f"method: time.perf_counter around a loop of N calls on one prepared input (N calibrated to "
        f"~{target_s * 1e3:.0f} ms a run), best of {repeats} runs, candidates interleaved in a shuffled order each round, "
        f"gc disabled while timing; ev/s = events per batch / best seconds per call; x/bare = ratio of "
        f"those best rates."
    )
    print(f"target: our decode within 1.25x of the bare typed decode (ours/bare >= {TARGET_DECODE_RATIO:.2f}).\n")

    bare_enc = msgspec.msgpack.Encoder()
    bare_dec = msgspec.msgpack.Decoder(KVEventBatch)
    our_enc = kvevents.BatchEncoder()
    our_dec = kvevents.BatchDecoder()
    if vk is not None:
        v_enc = msgspec.msgpack.Encoder()
        v_dec = msgspec.msgpack.Decoder(vk.KVEventBatch)

    rows: dict[str, list[list[Any]]] = {"encode": [], "decode": []}
    legacy_rows: list[list[Any]] = []
    misses: list[str] = []
    byte_diffs: list[str] = []
    for kind in WORKLOADS:
        for n in BATCH_SIZES:
            fields = make_fields(kind, n)
            batch = KVEventBatch(ts=1_700_000_000.25, events=[BlockStored(**f) for f in fields], data_parallel_rank=0)
            payload = kvevents.encode_batch(batch)
            # Sanity: every path agrees on bytes and on the decoded value.
            assert bare_enc.encode(batch) == payload == our_enc.encode(batch)
            assert kvevents.decode_batch(payload) == bare_dec.decode(payload) == our_dec.decode(payload) == batch
            enc_c: dict[str, tuple[Callable[[Any], Any], Any]] = {
                "ours fn": (kvevents.encode_batch, batch),
                "ours cls": (our_enc.encode, batch),
                "bare": (bare_enc.encode, batch),
            }
            dec_c: dict[str, tuple[Callable[[Any], Any], Any]] = {
                "ours fn": (kvevents.decode_batch, payload),
                "ours cls": (our_dec.decode, payload),
                "bare": (bare_dec.decode, payload),
            }
            if vk is not None:
                vbatch = vk.KVEventBatch(
                    ts=batch.ts, events=[vk.BlockStored(**f) for f in fields], data_parallel_rank=0
                )
                vpayload = v_enc.encode(vbatch)
                if vpayload != payload:
                    byte_diffs.append(f"{kind} x{n}")
                enc_c["vllm"] = (v_enc.encode, vbatch)
                dec_c["vllm"] = (v_dec.decode, payload)
            label = f"{kind} x{n}"
            for op, cands in (("encode", enc_c), ("decode", dec_c)):
                t, _rounds = best_times(cands, repeats, target_s)
                rate = {k: n / v for k, v in t.items()}
                r_fn, r_cls = ratio(t, "ours fn"), ratio(t, "ours cls")
                row: list[Any] = [
                    label,
                    len(payload),
                    fmt_rate(rate["ours fn"]),
                    fmt_rate(rate["ours cls"]),
                    fmt_rate(rate["bare"]),
                    fmt_rate(rate["vllm"]) if "vllm" in rate else "-",
                    f"{r_fn:.2f}",
                    f"{r_cls:.2f}",
                    f"{ratio(t, 'vllm'):.2f}" if "vllm" in rate else "-",
                ]
                if op == "decode":
                    met = min(r_fn, r_cls) >= TARGET_DECODE_RATIO
                    row.append("met" if met else "NOT MET")
                    if not met:
                        misses.append(f"{label}: fn {r_fn:.3f}, cls {r_cls:.3f}")
                rows[op].append(row)

            # Informational: the fallback path, an old (<= 0.25) producer's payload.
            legacy_payload = kvevents.encode_batch(batch, legacy=True)
            legacy_bare = msgspec.msgpack.Decoder(_legacy_batch_type())
            t, _rounds = best_times(
                {"ours": (our_dec.decode, legacy_payload), "bare": (legacy_bare.decode, legacy_payload)},
                repeats,
                target_s,
            )
            legacy_rows.append(
                [label, len(legacy_payload), fmt_rate(n / t["ours"]), fmt_rate(n / t["bare"]), f"{ratio(t, 'ours'):.2f}"]
            )

    common = ["workload", "bytes", "ours fn ev/s", "ours cls ev/s", "bare ev/s", "vllm ev/s", "fn/bare", "cls/bare", "vllm/bare"]
    print_table("ENCODE (current map encoding)", common, rows["encode"])
    print_table(
        f"DECODE (current map encoding); target ours/bare >= {TARGET_DECODE_RATIO:.2f}",
        common + ["target"],
        rows["decode"],
    )
    print_table(
        "DECODE of legacy (<= 0.25 array) payloads: fallback path, informational, no target; "
        "bare = msgspec Decoder(legacy struct) with no conversion",
        ["workload", "bytes", "ours ev/s", "bare legacy ev/s", "ours/bare"],
        legacy_rows,
    )
    if vk is not None:
        print(
            "vLLM's encoder wrote bytes identical to ours for every payload."
            if not byte_diffs
            else "WARNING: vLLM's bytes differ from ours for: " + ", ".join(byte_diffs)
        )
    if misses:
        print("decode target NOT MET for: " + "; ".join(misses))
    else:
        print("decode target met for every workload and batch size.")
    return 0


def _legacy_batch_type() -> type:
    from kvevents.events import LegacyKVEventBatch  # the legacy layout's struct, for the bare column

    return LegacyKVEventBatch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer, shorter runs (a smoke test; numbers are noisier)")
    args = ap.parse_args(argv)
    return run(args.quick)


if __name__ == "__main__":
    sys.exit(main())
