"""Metrics read through the SDK reflect the components' own counters; Prometheus serves the catalogue names."""

from __future__ import annotations

import time
import urllib.request

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from consumers import KVRouter
from consumers.telemetry import observe_router
from kvevents import DeliveryKind, PublisherSpec, Subscriber, ZmqEventPublisher
from kvevents.telemetry import catalog, observe_publisher, observe_subscriber, setup
from manager import CPUOffloadingManager
from manager.engine_sim import SimEngine
from manager.telemetry import observe_engine
from manager.tiering import SecondaryTierFactory, TieringOffloadingManager
from tests.pubsub_helpers import batch, collect, ipc_pair, wait_connected

TOPIC = "kv@pod0@demo"


def points(reader) -> dict:
    """(name, sorted attrs) -> value (histograms: (count, sum))."""
    out = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                for p in m.data.data_points:
                    key = (m.name, tuple(sorted(p.attributes.items())))
                    out[key] = (p.count, p.sum) if hasattr(p, "bucket_counts") else p.value
    return out


@pytest.fixture
def stack(tmp_path):
    ep, rep = ipc_pair()
    pub = ZmqEventPublisher(ep, rep, topic=TOPIC)
    sub = Subscriber([PublisherSpec(ep, rep, "pod0")])
    wait_connected(pub, sub)
    fs = SecondaryTierFactory.create_secondary_tier({"type": "fs", "root": str(tmp_path / "fs")})
    mgr = TieringOffloadingManager(CPUOffloadingManager(8, enable_events=True), [fs])
    engine = SimEngine(mgr, pub, gpu_blocks=16, block_size=4, use_torch=False, sync_transfers=True)
    router = KVRouter()
    yield pub, sub, engine, router
    engine.shutdown()
    mgr.shutdown()
    sub.close()
    pub.shutdown()


def run_workload(engine, sub, router, n: int = 12) -> list:
    for i in range(n):  # more distinct prefixes than the 8-block primary holds: evictions, cascades
        engine.add_request(f"r{i}", [i * 1000 + t for t in range(17)], max_new_tokens=2)
        engine.run_until_idle()  # one at a time: each one's cascades finish and unpin its blocks

    for i in range(2):  # the first prefixes again: promotions from the fs tier
        engine.add_request(f"again{i}", [i * 1000 + t for t in range(17)], max_new_tokens=2)
    engine.run_until_idle()
    last = engine.publisher.next_seq - 1  # counting deliveries would count late wait_connected probes too
    got = collect(sub, lambda g: any(d.kind is DeliveryKind.BATCH and d.seq == last for d in g))
    for d in got:
        router.handle(d)
    return got


def sent_all(pub, timeout: float = 10.0) -> None:
    """Poll until every seq the publisher handed out is accounted for by its sender thread."""
    deadline = time.monotonic() + timeout
    while True:
        st = pub.stats()
        if st["batches_published"] + st["live_dropped"] + st["send_errors"] + st["overflow_lost"] >= pub.next_seq:
            return
        assert time.monotonic() < deadline, f"sender still owes batches: {st} next_seq={pub.next_seq}"
        time.sleep(0.001)


def test_metrics_reflect_the_counters(stack):
    pub, sub, engine, router = stack
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    meter = provider.get_meter("kvevents")
    observations = [observe_publisher(pub, meter, name="pod0"), observe_subscriber(sub, meter, lag_sample_every=1),
                    observe_engine(engine, meter, name="e0", job_sample_every=1),
                    observe_router(router, meter, refresh_interval=0)]
    got = run_workload(engine, sub, router)
    router.pick([t for t in range(17)])
    router.pick([5, 6, 7, 8, 9])
    sent_all(pub)  # a batch can reach the subscriber before the sender thread counts it as sent
    p = points(reader)
    ps = pub.stats()
    P = (("publisher", "pod0"),)
    assert p[("kvevents.publisher.batches", P)] == ps["batches_published"] > 0
    assert p[("kvevents.publisher.events", P)] == ps["events_published"]
    assert p[("kvevents.publisher.bytes", P)] == ps["bytes_published"]
    assert p[("kvevents.publisher.queue.depth", P)] == ps["queue_depth"]
    assert p[("kvevents.publisher.errors", (("kind", "send"), ("publisher", "pod0")))] == 0
    h = sub.health()["pod0"]
    assert p[("kvevents.subscriber.received", P)] == h.received
    assert p[("kvevents.subscriber.health", (("publisher", "pod0"), ("state", "SYNCED")))] == 1
    assert p[("kvevents.subscriber.health", (("publisher", "pod0"), ("state", "STALE")))] == 0
    count, total = p[("kvevents.subscriber.lag", P)]
    assert count == sum(d.kind is DeliveryKind.BATCH for d in got) and total >= 0

    cpu = engine.manager.primary
    fs = engine.manager.tiers[0]
    E = lambda tier, **kw: tuple(sorted({"engine": "e0", "tier": tier, **kw}.items()))  # noqa: E731
    assert p[("kvevents.manager.stores", E("CPU"))] == cpu.stores_completed > 0
    assert p[("kvevents.manager.evictions", E("CPU"))] == cpu.evictions
    assert p[("kvevents.manager.stores", E("STORAGE"))] == fs.stores > 0
    assert p[("kvevents.manager.loads", E("CPU"))] == engine.connector.blocks_loaded
    assert p[("kvevents.manager.blocks.used", E("CPU"))] == cpu.num_blocks - cpu.num_free_blocks
    assert p[("kvevents.manager.blocks.capacity", E("CPU"))] == 8
    assert p[("kvevents.manager.blocks.used", E("STORAGE"))] == len(fs.cached_keys())
    assert p[("kvevents.manager.cascades", E("STORAGE"))] == fs.stores
    assert p[("kvevents.manager.promotions", E("STORAGE"))] == fs.loads > 0
    assert p[("kvevents.manager.bytes", E("CPU", direction="store"))] == engine.worker.bytes_copied - \
        p[("kvevents.manager.bytes", E("CPU", direction="load"))]
    assert p[("kvevents.manager.bytes", E("STORAGE", direction="store"))] == fs.stores * fs.block_io.block_nbytes
    assert p[("kvevents.manager.job.failures", E("CPU", direction="store"))] == 0
    jobs, _ = p[("kvevents.manager.job.duration", E("CPU", direction="store"))]
    assert jobs == engine.connector.store_jobs
    for kind, key in (("store_error", "store_errors"), ("corrupt", "corrupt_files"), ("punch_error", "punch_errors")):
        assert p[("kvevents.manager.tier.faults", E("STORAGE", kind=kind))] == fs.stats()[key] == 0
    fs.corrupt_files += 2  # (as two damaged files found would)
    assert points(reader)[("kvevents.manager.tier.faults", E("STORAGE", kind="corrupt"))] == 2
    assert p[("kvevents.manager.steps", (("engine", "e0"),))] == engine.connector.steps
    assert p[("kvevents.engine.tokens", (("engine", "e0"), ("kind", "computed")))] == engine.computed_tokens

    st = router.stats
    assert p[("kvevents.router.batches", ())] == st.batches > 0
    assert p[("kvevents.router.lookups", ())] == 2
    assert p[("kvevents.router.prompt.tokens", ())] == 22
    assert p[("kvevents.router.matched.tokens", (("tier", "GPU"),))] == 16
    entries = {k[1][0][1]: v for k, v in p.items() if k[0] == "kvevents.router.entries"}
    assert sum(entries.values()) == router.entries() and entries["GPU"] > 0
    assert p[("kvevents.router.offload.unjoined", (("outcome", "held"),))] == st.pending_held

    for o in observations:
        o.close()
    assert "score" not in router.__dict__ and sub.hooks is None
    assert "get_finished" not in engine.worker.__dict__ and "submit_store" not in fs.__dict__
    hist = {m.name for m in catalog.CATALOG if m.kind == catalog.HISTOGRAM}
    left = [k for k in points(reader) if k[0] not in hist]
    assert not left, left  # nothing observed any more (histograms keep their cumulative points)
    provider.shutdown()


def test_prometheus_endpoint_serves_the_catalogue_names(stack):
    pub, sub, engine, router = stack
    handle = setup(prometheus_port=0, otlp=False, set_global=False, service_name="kvevents-test")
    try:
        meter = handle.meter()
        obs = [observe_publisher(pub, meter), observe_subscriber(sub, meter, lag_sample_every=1),
               observe_engine(engine, meter),
               observe_router(router, meter, refresh_interval=0)]
        run_workload(engine, sub, router, n=10)
        router.pick(list(range(17)))
        url = f"http://127.0.0.1:{handle.prometheus_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as resp:
            text = resp.read().decode()
        for o in obs:
            o.close()
    finally:
        handle.shutdown()
    served = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith("kvevents_")}
    # router errors are labelled by kind and appear with the first error (none in this workload);
    # a chunk extent series appears once the join has inferred one (labelled by pod and tier);
    # index operations only with RouterConfig.index_metrics (tests/test_router_index_telemetry.py)
    missing = catalog.prometheus_names(series=True) - served - {m.prometheus for m in catalog.CATALOG
                                                                if m.kind == catalog.HISTOGRAM} \
        - {"kvevents_router_errors_total", "kvevents_router_offload_chunk_extent",
           "kvevents_router_index_operations_total"}
    assert not missing, sorted(missing)
    assert served <= catalog.prometheus_names(series=True), sorted(served - catalog.prometheus_names(series=True))
    assert 'service_name="kvevents-test"' in text


def test_setup_rejects_a_bad_port_and_is_idempotent_to_shut_down():
    from kvevents import ConfigError
    with pytest.raises(ConfigError, match="prometheus_port"):
        setup(prometheus_port=-1, otlp=False, set_global=False)
    h = setup(otlp=False, set_global=False)
    assert h.tracer_provider is None and h.prometheus_port is None
    h.shutdown()
    h.shutdown()


def test_publisher_errors_and_overflow_counted():
    ep, rep = ipc_pair()
    pub = ZmqEventPublisher(ep, rep, topic="t", max_queue_size=1, drop_live=lambda s: True)
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    try:
        obs = observe_publisher(pub, provider.get_meter("kvevents"), attributes={"engine": "e9"})
        for i in range(50):
            pub.publish(batch(i))
        pub.shutdown(1.0)
        p = points(reader)
        A = (("engine", "e9"), ("publisher", "t"))
        s = pub.stats()
        assert p[("kvevents.publisher.live.dropped", A)] == s["live_dropped"] > 0
        assert p[("kvevents.publisher.overflow", A)] == s["overflow"]
        assert p[("kvevents.publisher.ring.batches", A)] == s["ring_batches"]
        obs.close()
    finally:
        provider.shutdown()
