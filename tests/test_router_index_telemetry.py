"""The index's telemetry decorator (issue 9): ``RouterConfig(index_metrics=True)`` puts an
InstrumentedIndex in front of the backend, counts what goes through the Index role, exports it
as ``kvevents.router.index.operations{op}``, and leaves the native ingest and score on their C
paths (the router asks the backend behind the decorators for its C table once, issue 25)."""

from __future__ import annotations

import functools

import pytest

import consumers.keys as keys_mod
from consumers import KVRouter
from consumers.index import accelerator
from consumers.instrumented import InstrumentedIndex
from kvevents import encode_batch

from .test_router_fastpath import _stream, state


def _routers(index: str):
    return KVRouter(model="m", block_size=2, index=index), \
        KVRouter(model="m", block_size=2, index=index, index_metrics=True)


@pytest.mark.skipif(keys_mod._FAST is None, reason="the C extension is not in use")
def test_the_native_ingest_stays_on_the_c_path_behind_the_wrapper():
    plain, watched = _routers("native")
    assert isinstance(watched.index, InstrumentedIndex) and accelerator(watched.index) is not None
    assert watched.ingestor.native and isinstance(watched.apply_payload, functools.partial)
    gpu, off, rest = _stream()
    for r in (plain, watched):
        r.apply_payload("p", encode_batch(gpu))
    # the GPU batch went into the C table directly: nothing through the role, all of it indexed
    assert watched.index.calls["store"] == 0 and watched.index.stats()["entries"] == plain.index.stats()["entries"] == 32
    for r in (plain, watched):
        for b in (off, rest):
            r.apply_payload("p", encode_batch(b))
    assert state(watched) == state(plain)
    # the first offload batch's chunk extent was inferred on the Python path, which joined it
    # through the role; the next offloads and the removals went into the C table again
    assert (watched.index.calls["store"], watched.index.keys["store"]) == (1, 8)
    assert watched.index.calls["remove"] == 0
    # the score walked the C table: the router's lookups count it, not the role's matches
    assert watched.score(list(range(100, 164))) is not None and watched.index.calls["match"] == 0
    assert watched.stats.lookups == 1


@pytest.mark.parametrize("index", ["python"] + (["native"] if keys_mod._FAST is not None else []))
def test_calls_through_the_role_are_counted_and_exported(index):
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from consumers.telemetry import observe_router

    plain, watched = _routers(index)
    reader = InMemoryMetricReader()
    obs = observe_router(watched, MeterProvider(metric_readers=[reader]).get_meter("t"), refresh_interval=0)
    for b in _stream():
        plain.apply("p", b)
        watched.apply("p", b)  # (decoded: the Python path, every update through the role)
    watched.score([1, 2])
    plain.score([1, 2])
    watched.reset_pod("p")
    got = {}
    for rm_ in reader.get_metrics_data().resource_metrics:
        for sm in rm_.scope_metrics:
            for m in sm.metrics:
                if m.name == "kvevents.router.index.operations":
                    got.update({p.attributes["op"]: p.value for p in m.data.data_points})
    obs.close()
    calls = watched.index.calls
    assert calls["store"] >= 4 and calls["remove"] >= 1 and calls["match"] == (index == "python")
    assert calls["clear"] == 1 and watched.index.keys["store"] >= 32
    assert got == calls
    plain.reset_pod("p")
    assert state(watched) == state(plain)  # the wrapper changes no answer


def test_a_router_without_index_metrics_has_no_wrapper_and_no_series():
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from consumers.telemetry import observe_router

    r = KVRouter(model="m", block_size=2)
    assert not isinstance(r.index, InstrumentedIndex)
    reader = InMemoryMetricReader()
    obs = observe_router(r, MeterProvider(metric_readers=[reader]).get_meter("t"))
    names = {m.name for rm_ in reader.get_metrics_data().resource_metrics for sm in rm_.scope_metrics
             for m in sm.metrics}
    obs.close()
    assert "kvevents.router.index.operations" not in names and "kvevents.router.batches" in names


@pytest.mark.skipif(keys_mod._FAST is None, reason="the C extension is not in use")
def test_scoring_stays_in_c_behind_the_decorator(monkeypatch):
    from consumers.nativeindex import NativeBlockIndex

    plain, watched = _routers("native")
    for b in _stream():
        plain.apply("p", b)
        watched.apply("p", b)

    def python_walk(*_a, **_k):  # the role's Python match: never reached while scoring in C
        raise AssertionError("scored through the Python walk")

    prompt = list(range(100, 164))
    with monkeypatch.context() as m:
        m.setattr(NativeBlockIndex, "match", python_walk)
        assert watched.score(prompt) == plain.score(prompt)
        assert watched.pick(prompt) == plain.pick(prompt)
    # both walks ran in C, past the decorator: the router's lookups count them
    assert watched.index.calls["match"] == 0 and watched.stats.lookups == 2
    # explain (not a hot path) walks through the role in Python, and is counted there
    assert watched.explain(prompt) == plain.explain(prompt)
    assert watched.index.calls["match"] >= 1 and watched.index.keys["match"] >= 32


@pytest.mark.parametrize("index", ["python"] + (["native"] if keys_mod._FAST is not None else []))
def test_traced_index_spans_the_heavy_operations_while_instrumented(index):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from consumers.instrumented import TracedIndex
    from consumers.telemetry import instrument_router

    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    r = KVRouter(model="m", block_size=2, index=index, index_tracing=True, index_metrics=True)
    assert isinstance(r.index, TracedIndex) and r.index.tracer is None
    gpu, off, rest = _stream()
    r.apply("p", gpu)
    r.reset_pod("p")  # not traced yet: no tracer
    assert exporter.get_finished_spans() == ()
    traced = instrument_router(r, tracer_provider=tp, sample_every=1)
    r.apply("p", gpu)
    held = r.index.stats()["entries"]
    r.reset_pod("p")
    clears = [s for s in exporter.get_finished_spans() if s.name == "kvevents.router.index.clear"]
    assert len(clears) == 1 and clears[0].attributes["kvevents.index.entries"] == held > 0
    assert r.index.next.calls["clear"] >= 1  # the instrumented decorator behind it still counts
    traced.close()
    assert r.index.tracer is None
    n = len(exporter.get_finished_spans())
    r.apply("p", gpu)
    r.reset_pod("p")
    assert len(exporter.get_finished_spans()) == n
