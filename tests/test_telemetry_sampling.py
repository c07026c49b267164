"""Sequence-based trace sampling: the same batches traced everywhere, nothing paid for the others."""

from __future__ import annotations

import time

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from consumers import KVRouter
from consumers.telemetry import instrument_router
from kvevents import Delivery, DeliveryKind, PublisherSpec, Subscriber, ZmqEventPublisher
from kvevents.telemetry import instrument_publisher, instrument_subscriber, observe_subscriber
from kvevents.telemetry.messaging import MessageRegistry
from kvevents.telemetry.sampling import DEFAULT_SAMPLE_EVERY, ENV_VAR, resolve_sample_every, sampled
from manager import CPUOffloadingManager
from manager.engine_sim import SimEngine
from manager.telemetry import MAX_IDLE_TRACED_STEPS, StepGate, instrument_engine, instrument_manager, observe_engine
from tests.pubsub_helpers import batch, collect, ipc_pair, wait_connected

TOPIC = "kv@pod0@sampling"


class CountingProvider(TracerProvider):
    """A real SDK provider whose tracers log every span they are asked to start."""

    def __init__(self) -> None:
        super().__init__()
        self.exporter = InMemorySpanExporter()
        self.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.calls: list[str] = []

    def get_tracer(self, *args, **kwargs):
        inner = super().get_tracer(*args, **kwargs)
        calls = self.calls

        class _Tracer:
            def start_span(self, name, *a, **kw):
                calls.append(name)
                return inner.start_span(name, *a, **kw)

            def start_as_current_span(self, name, *a, **kw):
                calls.append(name)
                return inner.start_as_current_span(name, *a, **kw)

        return _Tracer()

    def spans(self, prefix: str) -> list:
        return [s for s in self.exporter.get_finished_spans() if s.name.startswith(prefix)]


@pytest.fixture
def pipeline():
    ep, rep = ipc_pair()
    pub = ZmqEventPublisher(ep, rep, topic=TOPIC)
    sub = Subscriber([PublisherSpec(ep, rep, "pod0")])
    first = wait_connected(pub, sub)
    engine = SimEngine(CPUOffloadingManager(64, enable_events=True), pub, gpu_blocks=64, block_size=4,
                       use_torch=False, sync_transfers=True)
    yield pub, sub, engine, KVRouter(), first
    engine.shutdown()
    sub.close()
    pub.shutdown()


def _run(engine, sub, router, first: int, n_batches: int) -> list[Delivery]:
    """Requests until the engine has published ``n_batches``; every batch delivered and applied."""
    i = 0
    while engine.batches_published < n_batches:
        engine.add_request(f"r{i}", [i * 1000 + t for t in range(9)], max_new_tokens=2)
        engine.run_until_idle()
        i += 1
    last = engine.publisher.next_seq - 1
    got = collect(sub, lambda g: any(d.kind is DeliveryKind.BATCH and d.seq == last for d in g))
    mine = [d for d in got if d.kind is DeliveryKind.BATCH and d.seq >= first]
    for d in mine:
        router.handle(d)
    return mine


def test_every_fourth_seq_is_traced_end_to_end_and_only_those(pipeline):
    pub, sub, engine, router, first = pipeline
    tp = CountingProvider()
    instrument_engine(engine, name="e0", tracer_provider=tp, sample_every=4)
    instrument_publisher(pub, tracer_provider=tp, sample_every=4)
    instrument_subscriber(sub, tracer_provider=tp, sample_every=4)
    instrument_router(router, tracer_provider=tp, sample_every=4)
    delivered = _run(engine, sub, router, first, 13)
    published = list(range(first, pub.next_seq))
    assert [d.seq for d in delivered] == published and len(published) >= 13
    want = {q for q in published if q % 4 == 0}
    assert len(want) >= 3

    def by_seq(prefix):
        out = {}
        for s in tp.spans(prefix):
            q = s.attributes["kvevents.seq"]
            if q >= first:  # late probe batches of wait_connected are not ours
                assert q not in out, f"two {prefix} spans for seq {q}"
                out[q] = s
        return out

    sends, recvs, procs = by_seq(f"send {TOPIC}"), by_seq(f"receive {TOPIC}"), by_seq(f"process {TOPIC}")
    assert set(sends) == set(recvs) == set(procs) == want
    steps = {s.context.span_id: s for s in tp.spans("kvevents.step")}
    for q in want:  # one complete trace per sampled batch: step -> send -> receive -> process
        send, recv, proc = sends[q], recvs[q], procs[q]
        step = steps[send.parent.span_id]
        assert step.attributes["kvevents.step.published"] is True
        assert recv.parent.span_id == send.context.span_id
        assert proc.parent.span_id == recv.context.span_id
        assert len({step.context.trace_id, send.context.trace_id, recv.context.trace_id, proc.context.trace_id}) == 1
        assert send.attributes["messaging.message.id"] == f"{TOPIC}:{q}"
    # a step is traced iff the seq it would publish is sampled: the publishing ones are exactly
    # the sends' parents; the others published nothing
    publishing = {sid for sid, s in steps.items() if s.attributes["kvevents.step.published"]}
    assert publishing == {s.parent.span_id for s in sends.values()}
    # schedule_end and transfer jobs only inside traced steps
    inner = tp.spans("kvevents.manager.schedule_end") + tp.spans("transfer ")
    assert tp.spans("transfer ") and all(s.parent.span_id in steps for s in inner)
    assert len(tp.spans("kvevents.manager.schedule_end")) == len(steps)
    total_steps = engine.steps
    assert len(steps) < total_steps  # most steps were not traced


def test_untraced_batches_make_no_opentelemetry_call(pipeline):
    pub, sub, engine, router, first = pipeline
    tp = CountingProvider()
    registry = MessageRegistry()
    every = 1 << 20  # no seq of this test is a multiple (seq 0 went out before instrumenting)
    assert first > 0
    hooks = instrument_publisher(pub, tracer_provider=tp, registry=registry, sample_every=every)
    instrument_subscriber(sub, tracer_provider=tp, sample_every=every)
    instrument_engine(engine, name="e0", tracer_provider=tp, sample_every=every)
    instrument_router(router, tracer_provider=tp, sample_every=every)
    delivered = _run(engine, sub, router, first, 6)
    assert len(delivered) >= 6
    assert tp.calls == []  # no span started, sampled-out or otherwise
    assert not hooks.pending.d and not registry.sent.d  # no context captured or registered
    for _ in range(3):
        router.pick(list(range(9)))
    assert tp.calls == ["kvevents.router.score"]  # score: call 0 of every `every` (a counter)


def test_score_spans_one_call_in_n():
    router = KVRouter()
    router.handle(Delivery(DeliveryKind.BATCH, "pod0", TOPIC, 0, batch(0), time.time()))
    tp = CountingProvider()
    instrument_router(router, tracer_provider=tp, sample_every=3)
    for _ in range(7):
        router.score(list(range(16)))
    assert len(tp.spans("kvevents.router.score")) == 3  # calls 0, 3, 6


def test_the_services_json_answer_is_sampled_like_score():
    """/v1/score's C answer through a traced scorer: the sampled call comes back None (the
    service then scores with ``score()``, which records the span); the others are the inner
    scorer's bytes, and every call advances the sampling counter."""
    router = KVRouter()
    router.handle(Delivery(DeliveryKind.BATCH, "pod0", TOPIC, 0, batch(0), time.time()))
    tp = CountingProvider()
    instrument_router(router, tracer_provider=tp, sample_every=3)
    answers = []
    for _ in range(6):
        out = router.scorer.score_json(list(range(16)))
        if out is None:
            router.score(list(range(16)))
        answers.append(out)
    if router.scorer.inner.score_json(list(range(16))) is None:  # no C table (pure Python)
        assert answers == [None] * 6
    else:
        assert [a is None for a in answers] == [True, False, False, True, False, False]
    assert len(tp.spans("kvevents.router.score")) == 2  # calls 0 and 3


def test_rare_events_are_always_traced():
    ep, rep = ipc_pair()
    drop: set[int] = set()
    pub = ZmqEventPublisher(ep, rep, topic=TOPIC, drop_live=lambda seq: seq in drop)
    sub = Subscriber([PublisherSpec(ep, rep, "pod0")])
    tp = CountingProvider()
    router = KVRouter()
    try:
        nxt = wait_connected(pub, sub)
        drop.add(nxt + 1)
        every = 1 << 20
        instrument_publisher(pub, tracer_provider=tp, sample_every=every)
        instrument_subscriber(sub, tracer_provider=tp, sample_every=every)
        instrument_router(router, tracer_provider=tp, sample_every=every)
        for i in range(3):
            pub.publish(batch(i))
        collect(sub, lambda g: sum(d.kind is DeliveryKind.BATCH for d in g) >= 3)
        collect(sub, lambda g: tp.spans("gap-recovery"), deadline=5.0)
        for kind in (DeliveryKind.GAP, DeliveryKind.RESET):
            router.handle(Delivery(kind, "pod0", TOPIC, 5, None, time.time(), missed=1))
    finally:
        sub.close()
        pub.shutdown()
    rec = tp.spans("gap-recovery pod0")
    assert len(rec) == 1 and rec[0].attributes["messaging.batch.message_count"] >= 1  # replayed, counted
    assert tp.spans(f"replay {TOPIC}")
    assert not tp.spans(f"send {TOPIC}") and not tp.spans(f"receive {TOPIC}")  # the batches: not sampled
    kinds = sorted(s.attributes["kvevents.delivery.kind"] for s in tp.spans(f"process {TOPIC}"))
    assert kinds == ["gap", "reset"]


def test_lag_histogram_records_the_sampled_seqs():
    ep, rep = ipc_pair()
    pub = ZmqEventPublisher(ep, rep, topic=TOPIC)
    sub = Subscriber([PublisherSpec(ep, rep, "pod0")])
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    try:
        wait_connected(pub, sub)
        obs = observe_subscriber(sub, provider.get_meter("kvevents"), lag_sample_every=4)
        for i in range(12):
            pub.publish(batch(i))
        last = pub.next_seq - 1
        got = collect(sub, lambda g: any(d.kind is DeliveryKind.BATCH and d.seq == last for d in g))
        want = sum(1 for d in got if d.kind is DeliveryKind.BATCH and d.seq % 4 == 0)
        points = [p for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics
                  for m in sm.metrics if m.name == "kvevents.subscriber.lag" for p in m.data.data_points]
        assert want >= 3 and sum(p.count for p in points) == want
        obs.close()
        with pytest.raises(ValueError, match="lag_sample_every"):
            observe_subscriber(sub, provider.get_meter("kvevents"), lag_sample_every=0)
    finally:
        sub.close()
        pub.shutdown()
        provider.shutdown()


def test_job_latency_records_every_nth_job_per_direction():
    engine = SimEngine(CPUOffloadingManager(64, enable_events=True), None, gpu_blocks=64, block_size=4,
                       use_torch=False, sync_transfers=True)
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    try:
        obs = observe_engine(engine, provider.get_meter("kvevents"), name="e0", job_sample_every=3)
        for i in range(8):
            engine.add_request(f"r{i}", [i * 1000 + t for t in range(9)], max_new_tokens=2)
            engine.run_until_idle()
        stores = engine.connector.store_jobs
        assert stores >= 6
        counts = {p.attributes["direction"]: p.count for rm in reader.get_metrics_data().resource_metrics
                  for sm in rm.scope_metrics for m in sm.metrics if m.name == "kvevents.manager.job.duration"
                  for p in m.data.data_points}
        assert counts["store"] == -(-stores // 3)  # jobs 0, 3, 6, ... of the direction
        obs.close()
    finally:
        engine.shutdown()
        provider.shutdown()


def test_manager_alone_traces_one_schedule_end_in_n():
    mgr = CPUOffloadingManager(16, enable_events=True)
    tp = CountingProvider()
    t = instrument_manager(mgr, tracer_provider=tp, sample_every=3)
    for _ in range(7):
        mgr.on_schedule_end()
    assert len(tp.spans("kvevents.manager.schedule_end")) == 3
    t.close()
    mgr.on_schedule_end()
    assert len(tp.calls) == 3


def test_step_gate_caps_traced_steps_that_publish_nothing():
    g = StepGate(4, driven=True)
    assert g.step_traced(0) and not g.step_traced(1) and g.step_traced(8)
    for _ in range(MAX_IDLE_TRACED_STEPS):
        assert g.step_traced(8)
        g.step_done(8, published=False)
    assert not g.step_traced(8)  # stuck at one sampled seq: no more spans
    assert g.step_traced(12)
    g.step_done(12, published=True)
    assert g.step_traced(8)


def test_sample_every_is_validated_and_read_from_the_environment(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert resolve_sample_every() == DEFAULT_SAMPLE_EVERY
    assert resolve_sample_every(1) == 1
    monkeypatch.setenv(ENV_VAR, "8")
    assert resolve_sample_every() == 8 and resolve_sample_every(2) == 2
    for bad in ("0", "x", "-3"):
        monkeypatch.setenv(ENV_VAR, bad)
        with pytest.raises(ValueError, match=ENV_VAR):
            resolve_sample_every()
    for bad in (0, -1, True, 2.0, "4"):
        with pytest.raises(ValueError, match="sample_every"):
            resolve_sample_every(bad)
    with pytest.raises(ValueError, match="sample_every"):
        instrument_router(KVRouter(), sample_every=0)
    assert [q for q in range(10) if sampled(q, 4)] == [0, 4, 8]
