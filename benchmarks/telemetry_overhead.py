"""Hot-path cost of telemetry: SDK off vs on, at benchmark rates.

    python benchmarks/telemetry_overhead.py           # full
    python benchmarks/telemetry_overhead.py --quick   # smoke run

Paths: publisher publish()+send (batches of 16 events), subscriber receive+decode, a
simulated engine's step (CPU manager, transfer jobs, one published batch per step), router
apply (handle per delivery) and score. Modes:

* ``off``: no provider, nothing observed or instrumented (the library's default);
* ``metrics``: SDK MeterProvider + every observe_* (observable counters, lag and job histograms);
* ``traces``: metrics plus every instrument_* with a TracerProvider, all spans sampled and
  handed to a BatchSpanProcessor whose exporter discards them;
* ``traces 10%``: the same with a parent-based 10% trace-id ratio sampler.

Target (issue 5): overhead <= 5% per path with the SDK on. Each cell is the best of
``--repeats`` alternating runs (µs per operation).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import zmq  # noqa: E402
from opentelemetry.sdk.metrics import MeterProvider  # noqa: E402
from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult  # noqa: E402
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased  # noqa: E402

from benchmarks._table import format_table  # noqa: E402
from consumers import KVRouter  # noqa: E402
from consumers.telemetry import instrument_router, observe_router  # noqa: E402
from kvevents import BlockStored, Delivery, DeliveryKind, KVEventBatch, PublisherSpec, Subscriber  # noqa: E402
from kvevents import ZmqEventPublisher, encode_batch  # noqa: E402
from kvevents.telemetry import instrument_publisher, instrument_subscriber, observe_publisher  # noqa: E402
from kvevents.telemetry import observe_subscriber, uninstrument  # noqa: E402
from manager import CPUOffloadingManager  # noqa: E402
from manager.engine_sim import SimEngine  # noqa: E402
from manager.telemetry import instrument_engine, observe_engine  # noqa: E402

TMP = tempfile.mkdtemp(prefix="kvtel-")
_n = 0
TOPIC = "kv@pod0@bench"


def ipc() -> tuple[str, str]:
    global _n
    _n += 1
    return f"ipc://{TMP}/{_n}.pub", f"ipc://{TMP}/{_n}.rep"


class _Discard(SpanExporter):
    def export(self, spans):
        return SpanExportResult.SUCCESS

    def shutdown(self):
        pass


class Mode:
    def __init__(self, name: str, metrics: bool, traces: bool, ratio: float = 1.0) -> None:
        self.name = name
        self.mp = MeterProvider(metric_readers=[InMemoryMetricReader()]) if metrics else None
        self.meter = self.mp.get_meter("kvevents") if metrics else None
        self.tp = None
        if traces:
            sampler = None if ratio >= 1.0 else ParentBased(TraceIdRatioBased(ratio))
            self.tp = TracerProvider(sampler=sampler) if sampler else TracerProvider()
            self.tp.add_span_processor(BatchSpanProcessor(_Discard(), max_queue_size=65536))
        self.undo: list = []

    def publisher(self, pub):
        if self.meter:
            self.undo.append(observe_publisher(pub, self.meter).close)
        if self.tp:
            instrument_publisher(pub, tracer_provider=self.tp)
            self.undo.append(lambda: uninstrument(pub))

    def subscriber(self, sub):
        if self.meter:
            self.undo.append(observe_subscriber(sub, self.meter).close)
        if self.tp:
            instrument_subscriber(sub, tracer_provider=self.tp)
            self.undo.append(lambda: uninstrument(sub))

    def engine(self, eng):
        if self.meter:
            self.undo.append(observe_engine(eng, self.meter).close)
        if self.tp:
            self.undo.append(instrument_engine(eng, tracer_provider=self.tp).close)

    def router(self, r):
        if self.meter:
            self.undo.append(observe_router(r, self.meter).close)
        if self.tp:
            self.undo.append(instrument_router(r, tracer_provider=self.tp).close)

    def done(self) -> None:
        for fn in reversed(self.undo):
            fn()
        self.undo.clear()
        if self.mp is not None:
            self.mp.force_flush()  # the scrape runs too
            self.mp.shutdown()
        if self.tp is not None:
            self.tp.shutdown()


def make_batch(i: int, n_events: int = 16) -> KVEventBatch:
    evs = [BlockStored([i * 64 + k], (i * 64 + k - 1) if k else None, list(range(k * 16, k * 16 + 16)), 16, None,
                       "GPU", None) for k in range(n_events)]
    return KVEventBatch(ts=time.time(), events=evs, data_parallel_rank=0)


def bench_publisher(mode: Mode, n: int) -> float:
    ep, rep = ipc()
    pub = ZmqEventPublisher(ep, rep, topic=TOPIC, max_queue_size=n + 10, hwm=n + 10)
    mode.publisher(pub)
    batches = [make_batch(i) for i in range(n)]
    t0 = time.perf_counter()
    for b in batches:
        pub.publish(b)
    while pub.stats()["batches_published"] < n:
        time.sleep(0.0005)
    dt = time.perf_counter() - t0
    mode.done()
    pub.shutdown()
    return dt / n * 1e6


def bench_subscriber(mode: Mode, n: int) -> float:
    ep, _ = ipc()
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.PUB)
    raw.setsockopt(zmq.SNDHWM, 0)
    raw.bind(ep)
    sub = Subscriber([PublisherSpec(ep, None, "pod0")], rcvhwm=0)
    mode.subscriber(sub)
    payloads = [encode_batch(make_batch(i)) for i in range(n)]
    deadline = time.monotonic() + 10
    while not sub.poll(10) and time.monotonic() < deadline:  # slow joiner
        raw.send_multipart((TOPIC.encode(), (0).to_bytes(8, "big"), payloads[0]))
    sub.close()
    sub = Subscriber([PublisherSpec(ep, None, "pod0")], rcvhwm=0)
    mode.undo.clear()
    mode.subscriber(sub)
    time.sleep(0.2)  # let the new SUB connect (setup only, outside the timed part)
    for i, p in enumerate(payloads):
        raw.send_multipart((TOPIC.encode(), i.to_bytes(8, "big"), p))
    t0 = time.perf_counter()
    got = 0
    while got < n and time.perf_counter() - t0 < 30:
        got += len(sub.poll(50))
    dt = time.perf_counter() - t0
    mode.done()
    sub.close()
    raw.close(0)
    return dt / max(1, got) * 1e6


def bench_engine(mode: Mode, n_req: int) -> float:
    eng = SimEngine(CPUOffloadingManager(256, enable_events=True), None, gpu_blocks=256, block_size=16,
                    use_torch=False)

    class _Null:
        data_parallel_rank = 0

        def publish(self, b):
            pass

    eng.publisher = _Null()
    mode.engine(eng)
    for i in range(n_req):
        eng.add_request(f"r{i}", [(i % 8) * 10000 + t for t in range(512)] + [i] * 64, max_new_tokens=8)
    t0 = time.perf_counter()
    steps = len(eng.run_until_idle())
    dt = time.perf_counter() - t0
    mode.done()
    eng.shutdown()
    return dt / steps * 1e6


def bench_router(mode: Mode, n: int) -> tuple[float, float]:
    r = KVRouter()
    mode.router(r)
    ds = [Delivery(DeliveryKind.BATCH, "pod0", TOPIC, i, make_batch(i, 16), time.time()) for i in range(n)]
    t0 = time.perf_counter()
    for d in ds:
        r.handle(d)
    apply_us = (time.perf_counter() - t0) / n * 1e6
    prompt = list(range(16 * 32))
    t0 = time.perf_counter()
    for _ in range(n):
        r.score(prompt)
    score_us = (time.perf_counter() - t0) / n * 1e6
    mode.done()
    return apply_us, score_us


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--n", type=int, default=None, help="batches per run (default 20000, quick 2000)")
    args = ap.parse_args()
    n = args.n or (2000 if args.quick else 20000)
    n_req = 16 if args.quick else 64
    repeats = 2 if args.quick else args.repeats
    modes = [("off", False, False, 1.0), ("metrics", True, False, 1.0), ("traces", True, True, 1.0),
             ("traces 10%", True, True, 0.1)]
    paths = ["publisher publish+send (per batch)", "subscriber receive+decode (per batch)",
             "engine step (per step)", "router apply (per batch)", "router score (per call)"]
    res: dict[tuple[str, str], list[float]] = {}
    for _ in range(repeats):
        for name, m, t, ratio in modes:
            vals = [bench_publisher(Mode(name, m, t, ratio), n), bench_subscriber(Mode(name, m, t, ratio), n),
                    bench_engine(Mode(name, m, t, ratio), n_req)]
            vals.extend(bench_router(Mode(name, m, t, ratio), n // 4))
            for p, v in zip(paths, vals):
                res.setdefault((p, name), []).append(v)
    rows = []
    for p in paths:
        off = min(res[(p, "off")])
        for name, *_ in modes:
            v = min(res[(p, name)])
            over = (v - off) / off * 100
            rows.append([p, name, v, "-" if name == "off" else f"{over:+.1f}%", "5%",
                         "-" if name == "off" else ("ok" if over <= 5 else "OVER")])
    print(format_table(f"telemetry overhead, µs per operation (best of {repeats}; n={n}, engine requests={n_req})",
                       ["path", "mode", "µs/op", "overhead", "target", "verdict"], rows))


if __name__ == "__main__":
    main()
