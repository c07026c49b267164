"""The tracing proof: one batch from the manager's step through publisher and subscriber to the router."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from consumers import KVRouter
from consumers.telemetry import instrument_router
from kvevents import DeliveryKind, PublisherSpec, Subscriber, ZmqEventPublisher
from kvevents.telemetry import instrument_publisher, instrument_subscriber, uninstrument
from manager import CPUOffloadingManager
from manager.engine_sim import SimEngine
from manager.telemetry import instrument_engine
from tests.pubsub_helpers import collect, collect_until, ipc_pair, wait_connected

TOPIC = "kv@pod0@demo"


@pytest.fixture
def pipeline():
    ep, rep = ipc_pair()
    pub = ZmqEventPublisher(ep, rep, topic=TOPIC)
    sub = Subscriber([PublisherSpec(ep, rep, "pod0")])
    wait_connected(pub, sub)
    engine = SimEngine(CPUOffloadingManager(64, enable_events=True), pub, gpu_blocks=64, block_size=4,
                       use_torch=False, sync_transfers=True)
    router = KVRouter()
    yield pub, sub, engine, router
    engine.shutdown()
    sub.close()
    pub.shutdown()


def _drive(engine, sub, router, req: str, tokens: list[int], exporter=None) -> list:
    engine.add_request(req, tokens, max_new_tokens=2)
    engine.run_until_idle()
    last = engine.publisher.next_seq - 1  # not a count: late wait_connected probes would count too
    got = collect(sub, lambda g: any(d.kind is DeliveryKind.BATCH and d.seq == last for d in g))
    for d in got:
        router.handle(d)
    if exporter is not None:
        # the publisher's thread ends a send span just after the bytes leave: a subscriber can
        # have the batch first, so wait (poll, with a deadline) for the last send span to end
        assert collect_until(lambda: any(
            sp.name.startswith("send ") and sp.attributes.get("kvevents.seq") == last
            for sp in exporter.get_finished_spans())), "the last send span never ended"
    return got


def test_one_batch_from_step_to_router(pipeline):
    pub, sub, engine, router = pipeline
    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    t_engine = instrument_engine(engine, name="e0", tracer_provider=tp, sample_every=1)
    instrument_publisher(pub, tracer_provider=tp, sample_every=1)
    instrument_subscriber(sub, tracer_provider=tp, sample_every=1)
    t_router = instrument_router(router, tracer_provider=tp, sample_every=1)

    tokens = list(range(17))
    _drive(engine, sub, router, "r0", tokens, exporter)
    assert router.pick(tokens) == "pod0"
    spans = exporter.get_finished_spans()
    by_id = {s.context.span_id: s for s in spans}

    # the step that published, its send span, the receive and the router's process span
    steps = [s for s in spans if s.name == "kvevents.step" and s.attributes["kvevents.step.published"]]
    assert steps, [s.name for s in spans]
    step = steps[0]
    assert step.attributes["kvevents.engine"] == "e0"
    assert step.attributes["kvevents.step.store_jobs"] >= 1
    assert "kvevents.step.jobs_flushed" in step.attributes
    sends = [s for s in spans if s.name == f"send {TOPIC}" and s.parent and s.parent.span_id == step.context.span_id]
    assert len(sends) == 1, (
        [(s.name, s.context.span_id, s.parent and s.parent.span_id, dict(s.attributes)) for s in spans
         if s.name.startswith(("send", "kvevents.step"))])
    send = sends[0]
    assert send.kind is SpanKind.PRODUCER
    a = send.attributes
    assert a["messaging.system"] == "zeromq"
    assert a["messaging.operation.type"] == "send" and a["messaging.operation.name"] == "send"
    assert a["messaging.destination.name"] == TOPIC
    mid = a["messaging.message.id"]
    assert mid == f"{TOPIC}:{a['kvevents.seq']}"
    assert a["messaging.batch.message_count"] == step.attributes["kvevents.step.gpu_events"] + \
        step.attributes["kvevents.step.offload_events"]
    assert a["messaging.message.body.size"] > 0

    recv = [s for s in spans if s.name == f"receive {TOPIC}" and s.attributes["messaging.message.id"] == mid]
    assert len(recv) == 1
    recv = recv[0]
    assert recv.kind is SpanKind.CONSUMER
    assert recv.parent.span_id == send.context.span_id
    assert recv.context.trace_id == step.context.trace_id
    assert recv.attributes["messaging.operation.type"] == "receive"
    assert recv.attributes["messaging.batch.message_count"] == a["messaging.batch.message_count"]
    assert recv.attributes["messaging.message.body.size"] == a["messaging.message.body.size"]
    assert [link.context.span_id for link in recv.links] == [send.context.span_id]

    proc = [s for s in spans if s.name == f"process {TOPIC}" and s.attributes["messaging.message.id"] == mid]
    assert len(proc) == 1
    proc = proc[0]
    assert proc.kind is SpanKind.CONSUMER
    assert proc.parent.span_id == recv.context.span_id
    assert proc.context.trace_id == step.context.trace_id
    assert proc.attributes["messaging.operation.type"] == "process"
    assert proc.attributes["kvevents.delivery.kind"] == "batch"

    # inside the steps: on_schedule_end and the transfer jobs
    step_ids = {s.context.span_id for s in spans if s.name == "kvevents.step"}
    sched = [s for s in spans if s.name == "kvevents.manager.schedule_end"]
    assert sched and all(s.parent.span_id in step_ids for s in sched)
    jobs = [s for s in spans if s.name.startswith("transfer ")]
    stores = [s for s in jobs if s.attributes["kvevents.transfer.direction"] == "store"]
    assert stores and all(s.parent.span_id in step_ids for s in jobs)
    j = stores[0].attributes
    assert j["kvevents.tier"] == "CPU" and j["kvevents.transfer.success"] is True
    assert j["kvevents.transfer.blocks"] > 0 and j["kvevents.transfer.bytes"] == j["kvevents.transfer.blocks"] * \
        engine.worker.bytes_per_block

    score = [s for s in spans if s.name == "kvevents.router.score"]
    assert len(score) == 1
    assert score[0].attributes["kvevents.router.best_pod"] == "pod0"
    assert score[0].attributes["kvevents.router.matched_tokens"] == 16
    assert score[0].attributes["kvevents.router.prompt_tokens"] == 17
    assert all(s.context.span_id in by_id for s in spans)

    # once uninstrumented, the same pipeline makes no span
    t_engine.close()
    uninstrument(pub)
    uninstrument(sub)
    t_router.close()
    assert pub.hooks is None and sub.hooks is None
    assert "step" not in engine.__dict__ and "score" not in router.__dict__
    exporter.clear()
    _drive(engine, sub, router, "r1", list(range(100, 121)))
    router.pick(list(range(100, 121)))
    assert exporter.get_finished_spans() == ()


def test_gap_recovery_and_replay_spans():
    ep, rep = ipc_pair()
    drop = {5}
    pub = ZmqEventPublisher(ep, rep, topic=TOPIC, drop_live=lambda seq: seq in drop)
    sub = Subscriber([PublisherSpec(ep, rep, "pod0")])
    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    try:
        nxt = wait_connected(pub, sub)
        drop.clear()
        drop.add(nxt + 1)
        instrument_publisher(pub, tracer_provider=tp, sample_every=1)
        instrument_subscriber(sub, tracer_provider=tp, sample_every=1)
        from tests.pubsub_helpers import batch
        for i in range(3):
            pub.publish(batch(i))
        got = collect(sub, lambda g: sum(d.kind is DeliveryKind.BATCH for d in g) >= 3)
        assert [d.seq for d in got if d.kind is DeliveryKind.BATCH][:3] == [nxt, nxt + 1, nxt + 2]
        collect(sub, lambda g: any(s.name.startswith("gap-recovery") for s in exporter.get_finished_spans()),
                deadline=5.0)
    finally:
        sub.close()
        pub.shutdown()
    spans = exporter.get_finished_spans()
    rec = [s for s in spans if s.name == "gap-recovery pod0"][0]
    assert rec.attributes["kvevents.outcome"] == "completed"
    assert rec.attributes["kvevents.replay.start_seq"] == nxt + 1
    assert rec.attributes["messaging.batch.message_count"] >= 1
    replay = [s for s in spans if s.name == f"replay {TOPIC}"]
    assert replay and replay[0].attributes["messaging.batch.message_count"] >= 1
    dropped = [s for s in spans if s.name == f"send {TOPIC}" and s.attributes["kvevents.outcome"] == "dropped"]
    assert len(dropped) == 1
    replayed = [s for s in spans if s.name == f"receive {TOPIC}" and s.attributes["kvevents.replayed"]]
    assert replayed and replayed[0].parent.span_id == dropped[0].context.span_id
