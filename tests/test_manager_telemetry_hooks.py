"""The manager's telemetry observes through public hooks: no method of the engine, the
manager, the worker or a tier is replaced, and closing takes every observer out again; spans
nest (step > schedule_end > tier jobs) and an engine step that raises ends its span in error."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from manager import CPUOffloadingSpec
from manager.engine_sim import SimEngine
from manager.telemetry import instrument_engine, observe_engine


def _engine() -> SimEngine:
    spec = CPUOffloadingSpec(4, secondary_tiers=[{"type": "example"}])
    return SimEngine(spec, None, gpu_blocks=12, block_size=4, use_torch=False, sync_transfers=True)


def _work(e: SimEngine) -> None:
    for i in range(6):
        e.add_request(f"w{i}", [i] * 8 + [99], max_new_tokens=1)
    e.run_until_idle()
    for i in range(6):
        e.add_request(f"r{i}", [i] * 8 + [98], max_new_tokens=1)
    e.run_until_idle()


def test_hooks_not_patches_and_close_removes_every_observer() -> None:
    e = _engine()
    m, tier = e.manager, e.manager.secondary_tiers[0]
    before = {id(o): dict(vars(o)) for o in (e, m, e.worker, tier)}
    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    mp = MeterProvider(metric_readers=[reader])
    obs = observe_engine(e, mp.get_meter("t"), name="e0", job_sample_every=1)
    traced = instrument_engine(e, name="e0", tracer_provider=tp, sample_every=1)
    try:
        for o in (e, m, e.worker, tier):  # no method installed on the instance
            assert not any(callable(v) for k, v in vars(o).items() if k not in before[id(o)]), type(o)
        assert len(e.step_observers) == 1 and len(m.schedule_end_observers) == 1
        assert len(e.worker.job_observers) == 1 and len(m.job_observers[0]) == 1  # one probe, shared
        _work(e)
        spans = exporter.get_finished_spans()
        by_id = {s.context.span_id: s for s in spans}
        tier_jobs = [s for s in spans if s.name.startswith("transfer") and s.attributes["kvevents.tier"] != "CPU"]
        assert tier_jobs, "the tier's jobs were seen through the tiering manager's hook"
        ends = [s for s in spans if s.name == "kvevents.manager.schedule_end"]
        assert ends and all(by_id[s.parent.span_id].name == "kvevents.step" for s in ends)
        data = reader.get_metrics_data()
        names = {m.name for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
        assert {"kvevents.manager.promotions", "kvevents.manager.blocks.used"} <= names
    finally:
        traced.close()
        obs.close()
    assert e.step_observers == () and m.schedule_end_observers == ()
    assert e.worker.job_observers == () and m.job_observers == [()]
    n = len(exporter.get_finished_spans())
    e.add_request("after", [1] * 9, max_new_tokens=1)
    e.run_until_idle()
    assert len(exporter.get_finished_spans()) == n  # nothing traced once closed
    e.shutdown()


def test_a_step_that_raises_ends_its_span_in_error() -> None:
    e = _engine()
    exporter = InMemorySpanExporter()
    tp = TracerProvider()
    tp.add_span_processor(SimpleSpanProcessor(exporter))
    traced = instrument_engine(e, name="e0", tracer_provider=tp, sample_every=1)
    e.add_request("a", [1] * 9, max_new_tokens=1)

    def boom(so):  # type: ignore[no-untyped-def]
        raise RuntimeError("scheduler broke")

    e.connector.build_connector_meta = boom  # the failure to observe (test-only patch)
    with pytest.raises(RuntimeError, match="scheduler broke"):
        e.step()
    (span,) = [s for s in exporter.get_finished_spans() if s.name == "kvevents.step"]
    assert span.status.status_code is StatusCode.ERROR and "scheduler broke" in span.status.description
    traced.close()
    e.shutdown()


def test_telemetry_reads_no_private_attribute() -> None:
    import inspect
    import re

    import manager.telemetry as mt

    src = inspect.getsource(mt)
    assert "__dict__" not in src
    assert not re.search(r"""getattr\([^,]+,\s*["']_""", src)  # no getattr(obj, "_private")
    assert not re.search(r"\b(mgr|manager|engine|worker|tier|t|primary)\._[a-z]", src)
