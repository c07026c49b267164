"""What vLLM's scheduler thread pays per ``publish()``: vLLM's ``ZmqEventPublisher`` vs ours.

Both publishers get the same vLLM ``KVEventBatch`` (one ``BlockStored`` of ``--blocks`` blocks of
128 tokens, the CPU backend's block size; a prefill step's batch) ``--batches`` times, in
alternating rounds, with one subscriber connected. The time is the caller's: from the call to
its return, summed over a round, per call (ns). vLLM's publisher only puts the batch on its
queue (its thread encodes it); ours encodes it (msgspec, vLLM's own encoding) on the caller's
thread and hands the bytes to our queue. Each round ends once everything published has been
received, so a round's backlog never spills into the next. The table gives the median round,
and the process's CPU time per batch over the round (both publishers' threads run under the
GIL the scheduler needs, so this is what the engine's process pays in all).

    /work/vllmcpu/bin/python benchmarks/vllm_publisher.py [--rounds 9] [--batches 2000] [--blocks 4]
"""

from __future__ import annotations

import argparse
import gc
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks._table import print_table  # noqa: E402


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--batches", type=int, default=2000)
    ap.add_argument("--blocks", type=int, default=4)
    args = ap.parse_args()

    import zmq
    from vllm.distributed import kv_events as V

    from kvevents_vllm.publisher import KVEventsPublisher, register_publisher

    register_publisher()
    bs = 128

    def batch(i: int) -> V.KVEventBatch:
        return V.KVEventBatch(ts=time.time(), events=[V.BlockStored(
            block_hashes=[i * 64 + b for b in range(args.blocks)], parent_block_hash=None,
            token_ids=list(range(args.blocks * bs)), block_size=bs, lora_id=None, medium="GPU",
            lora_name=None, extra_keys=[None] * args.blocks, group_idx=0,
            kv_cache_spec_kind="full_attention")])

    ctx = zmq.Context.instance()
    pubs, subs = {}, {}
    for name in ("vLLM ZmqEventPublisher", "kvevents"):
        port = _port()
        cls = V.ZmqEventPublisher if name.startswith("vLLM") else KVEventsPublisher
        pubs[name] = cls(data_parallel_rank=0, endpoint=f"tcp://*:{port}")
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.connect(f"tcp://127.0.0.1:{port}")
        subs[name] = sub
    # the slow joiner: publish until each subscriber hears one
    for name, pub in pubs.items():
        while not subs[name].poll(50):
            pub.publish(batch(0))
        while subs[name].poll(200):
            subs[name].recv_multipart()

    prepared = [batch(i) for i in range(args.batches)]
    size = len(__import__("msgspec").msgpack.encode(prepared[0]))
    per_call: dict[str, list[float]] = {n: [] for n in pubs}
    cpu: dict[str, list[float]] = {n: [] for n in pubs}
    for r in range(args.rounds):
        for name in (list(pubs) if r % 2 == 0 else list(reversed(pubs))):
            pub, sub = pubs[name], subs[name]
            items = [batch(i) for i in range(args.batches)]
            gc.collect()
            gc.disable()
            c0 = time.process_time_ns()
            t0 = time.perf_counter_ns()
            for b in items:
                pub.publish(b)
            elapsed = time.perf_counter_ns() - t0
            gc.enable()
            per_call[name].append(elapsed / args.batches)
            got = 0
            while got < args.batches and sub.poll(5000):
                sub.recv_multipart()
                got += 1
            if got < args.batches:
                raise SystemExit(f"{name}: {args.batches - got} batches not received in round {r}")
            cpu[name].append((time.process_time_ns() - c0) / args.batches)
    for pub in pubs.values():
        pub.shutdown()
    base = statistics.median(per_call["vLLM ZmqEventPublisher"])
    rows = [[name, round(statistics.median(v)), round(min(v)), round(max(v)),
             f"{statistics.median(v) / base:.2f}x", round(statistics.median(cpu[name]))]
            for name, v in per_call.items()]
    print_table(f"publish() on the caller's thread, ns per call ({args.batches} batches x {args.rounds} rounds, "
                f"one BlockStored of {args.blocks} x {bs} tokens, {size} bytes encoded); cpu: the process's CPU "
                "time per batch until the subscriber has it (publisher threads + this script's SUB)",
                ["publisher", "median", "min", "max", "vs vLLM", "cpu ns/batch"], rows)


if __name__ == "__main__":
    main()
