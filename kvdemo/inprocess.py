"""The smallest demo: a publisher and a subscriber in one process on an inproc endpoint.

``python -m kvdemo.inprocess`` (``kvevents demo`` is the whole simulated cluster,
:mod:`kvdemo.cluster`); it lived in ``kvevents`` once, and moved up here: the ground floor
holds no demo.

A producer thread publishes synthetic engine steps — GPU blocks stored in hash chains, every
fifth step an offload to the CPU tier and an eviction — while a fault injector keeps a fraction
of batches off the live socket; the subscriber heals those gaps by replay. Live counts every
half second, a summary at the end, exit code 1 if anything was lost without being reported.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time

from kvevents import BlockRemoved, BlockStored, DeliveryKind, KVEventBatch, PublisherSpec, Subscriber, ZmqEventPublisher

ENDPOINT = "inproc://kvevents-demo"
REPLAY_ENDPOINT = "inproc://kvevents-demo-replay"


def synthetic_steps(seed: int = 0):
    """Endless engine steps: 4 GPU blocks of 16 tokens per step; offload + eviction every 5th."""
    rng = random.Random(seed)
    step = 0
    stored: list[int] = []
    while True:
        parent = None
        events = []
        for _ in range(4):
            h = rng.getrandbits(64)
            events.append(BlockStored([h], parent, [rng.randrange(32000) for _ in range(16)], 16, None, "GPU", None))
            stored.append(h)
            parent = h
        if step % 5 == 4 and len(stored) >= 8:
            events.append(BlockStored(stored[-8:-6], None, [], 0, None, "CPU", None))
            events.append(BlockRemoved(stored[-8:-6], "GPU"))
        step += 1
        yield events


def run(duration: float = 5.0, drop_rate: float = 0.01, rate: float = 2000.0, out=sys.stdout) -> int:
    rng = random.Random(1)
    pub = ZmqEventPublisher(ENDPOINT, REPLAY_ENDPOINT, topic="kv@demo-pod@demo-model",
                            drop_live=lambda seq: seq > 0 and rng.random() < drop_rate)
    sub = Subscriber([PublisherSpec(ENDPOINT, REPLAY_ENDPOINT, "demo-pod")], late_join=True)
    stop = threading.Event()
    published = [0, 0]  # batches, events

    def produce() -> None:
        steps = synthetic_steps()
        interval = 1.0 / rate if rate > 0 else 0.0
        next_t = time.monotonic()
        while not stop.is_set():
            events = next(steps)
            pub.publish(KVEventBatch(time.time(), events, 0))
            published[0] += 1
            published[1] += len(events)
            if interval:
                next_t += interval
                delay = next_t - time.monotonic()
                if delay > 0:
                    stop.wait(delay)

    producer = threading.Thread(target=produce, name="demo-producer", daemon=True)
    print(f"kvevents demo: publisher -> subscriber on {ENDPOINT} (replay {REPLAY_ENDPOINT}), "
          f"{duration:g}s, {drop_rate:.1%} of live batches dropped on purpose to show replay healing", file=out)
    received = [0, 0, 0]  # batches, events, batches reported lost

    def take(timeout_ms: int) -> None:
        for d in sub.poll(timeout_ms):
            if d.kind is DeliveryKind.BATCH:
                received[0] += 1
                received[1] += len(d.batch.events)
            elif d.kind is DeliveryKind.GAP:
                received[2] += d.missed

    start = time.monotonic()
    last_print = start
    producer.start()
    try:
        while True:
            take(50)
            now = time.monotonic()
            if now - last_print >= 0.5 or now - start >= duration:
                h = sub.health()["demo-pod"]
                elapsed = now - start
                print(f"  t={elapsed:4.1f}s published={published[0]} batches received={received[0]} "
                      f"events/s={received[1] / max(elapsed, 1e-9):,.0f} gaps={h.gaps} healed={h.recovered} "
                      f"lost={h.unrecoverable} state={h.state.value}", file=out, flush=True)
                last_print = now
            if now - start >= duration:
                break
    finally:
        stop.set()
        producer.join()
    # let the tail arrive: what was published must be received or reported lost
    deadline = time.monotonic() + 5.0
    while received[0] + received[2] < published[0] and time.monotonic() < deadline:
        take(50)
    report = pub.shutdown(timeout=1.0)
    h = sub.health()["demo-pod"]
    ps = pub.stats()
    sub.close()
    silent = published[0] - received[0] - received[2]
    print(f"summary: published {published[0]} batches / {published[1]} events; received {received[0]} / "
          f"{received[1]}; live drops injected {ps['live_dropped']}, gaps {h.gaps}, healed by replay "
          f"{h.recovered}, reported lost {h.unrecoverable}; silently lost {silent}; "
          f"publisher queue overflow {ps['overflow']}, unsent at shutdown {report.unsent}", file=out)
    return 0 if silent == 0 else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvdemo.inprocess",
                                 description="Publisher and subscriber in one process on an inproc endpoint; "
                                             "exits by itself after --duration seconds.")
    ap.add_argument("--duration", type=float, default=5.0, metavar="S", help="seconds to run (default 5)")
    ap.add_argument("--drop-rate", type=float, default=0.01, metavar="P",
                    help="fraction of live batches kept off the socket to show replay healing (default 0.01)")
    ap.add_argument("--rate", type=float, default=2000.0, metavar="N", help="batches per second (0: flat out)")
    a = ap.parse_args(argv)
    return run(a.duration, a.drop_rate, a.rate)


if __name__ == "__main__":
    sys.exit(main())
