"""Request lifecycle guards: secondary tiers hear ``on_request_finished`` exactly once per
request they were told about; a repeat or an unknown id is counted and goes no further (or
raises RequestLifecycleError in strict mode), in the tiering manager and in the connector."""

from __future__ import annotations

import pytest

from manager import CPUOffloadingManager, ReqContext, RequestLifecycleError, make_offload_key
from manager.connector import OffloadingConnectorScheduler
from manager.connector_types import EngineRequest
from manager.lifecycle import RequestLifecycle
from manager.tiering import ExampleSecondaryTierManager, TieringOffloadingManager


def K(i: int) -> bytes:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def make(strict: bool = False):  # type: ignore[no-untyped-def]
    tiers = [ExampleSecondaryTierManager(), ExampleSecondaryTierManager(medium="T2")]
    return TieringOffloadingManager(CPUOffloadingManager(8), tiers, strict=strict), tiers


def test_a_request_finished_twice_reaches_the_tiers_once() -> None:
    m, tiers = make()
    a = ReqContext("a")
    m.on_new_request(a)
    m.on_request_finished(a)
    m.on_request_finished(a)
    m.on_schedule_end()
    m.on_request_finished(ReqContext("a"))  # a new ReqContext object with the same id: still a repeat
    assert [t.finished_requests for t in tiers] == [["a"], ["a"]]
    st = m.stats()
    assert st["finish_repeats"] == 2 and st["finish_unknown"] == 0 and st["requests_live"] == 0


def test_a_repeat_while_stores_are_pending_is_not_delivered_twice() -> None:
    m, tiers = make()
    a = ReqContext("a")
    m.on_new_request(a)
    out = m.prepare_store([K(1)], a)
    assert out is not None
    m.on_request_finished(a)
    m.on_request_finished(a)  # the first is still waiting for the store
    m.complete_store([K(1)], a)
    m.on_schedule_end()
    assert [t.finished_requests for t in tiers] == [["a"], ["a"]]
    assert m.stats()["finish_repeats"] == 1


def test_an_unknown_request_is_not_passed_on() -> None:
    m, tiers = make()
    m.on_request_finished(ReqContext("ghost"))
    m.on_schedule_end()
    assert [t.finished_requests for t in tiers] == [[], []]
    assert m.stats()["finish_unknown"] == 1 and m.stats()["finish_repeats"] == 0


def test_strict_mode_raises_a_typed_error_naming_the_request() -> None:
    m, tiers = make(strict=True)
    a = ReqContext("a")
    m.on_new_request(a)
    m.on_request_finished(a)
    with pytest.raises(RequestLifecycleError, match="'a' finished twice"):
        m.on_request_finished(a)
    with pytest.raises(RequestLifecycleError, match="'zz' finished but never announced"):
        m.on_request_finished(ReqContext("zz"))
    assert isinstance(RequestLifecycleError("x"), ValueError)
    assert [t.finished_requests for t in tiers] == [["a"], ["a"]]


def test_an_id_reused_after_it_finished_is_a_new_request() -> None:
    m, tiers = make()
    for _ in range(2):
        a = ReqContext("a")
        m.on_new_request(a)
        m.on_request_finished(a)
    assert tiers[0].finished_requests == ["a", "a"]
    assert m.stats()["finish_repeats"] == 0


def test_the_recent_window_is_bounded_and_counts_what_it_forgets() -> None:
    lc = RequestLifecycle("t", recent_limit=2)
    for i in range(3):
        lc.started(str(i))
        assert lc.finished(str(i))
    assert len(lc.recent) == 2 and lc.recent_dropped == 1
    assert not lc.finished("0") and lc.finish_unknown == 1  # forgotten: reads as unknown
    assert not lc.finished("2") and lc.finish_repeats == 1


class _Recording(CPUOffloadingManager):
    def __init__(self) -> None:
        super().__init__(8)
        self.finished: list[str] = []

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.finished.append(req_context.req_id)
        super().on_request_finished(req_context)


def test_connector_finishing_twice_or_unknown_is_counted_and_ignored() -> None:
    m = _Recording()
    c = OffloadingConnectorScheduler(m, 4, 4)
    req = EngineRequest("r", [b"\x01" * 32], 4)
    c.on_new_request(req)
    assert c.request_finished("r") is False
    assert c.request_finished("r") is False
    assert c.request_finished("nobody") is False
    assert m.finished == ["r"]
    st = c.stats()
    assert st["finish_repeats"] == 1 and st["finish_unknown"] == 1


def test_connector_repeat_before_release_and_strict_mode() -> None:
    m = _Recording()
    c = OffloadingConnectorScheduler(m, 4, 4, strict=True)
    req = EngineRequest("r", [b"\x01" * 32, b"\x02" * 32], 8)
    c.on_new_request(req)
    c.update_state_after_alloc(req, [0, 1], 0)
    from manager.connector_types import NewRequestData, SchedulerOutput

    so = SchedulerOutput(scheduled_new_reqs=[NewRequestData(req, [0, 1], 0)], num_scheduled_tokens={"r": 8})
    meta = c.build_connector_meta(so)
    assert meta.store_jobs  # a store job still reads its blocks
    assert c.request_finished("r") is True
    with pytest.raises(RequestLifecycleError, match="'r' finished twice"):
        c.request_finished("r")
    c.update_connector_output([j.job_id for j in meta.store_jobs])
    assert m.finished == ["r"]
    with pytest.raises(RequestLifecycleError, match="'r' finished twice"):
        c.request_finished("r")
    with pytest.raises(RequestLifecycleError, match="never announced"):
        c.request_finished("q")


def test_ignored_finishes_show_up_as_a_metric() -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from manager import CPUOffloadingSpec
    from manager.engine_sim import SimEngine
    from manager.telemetry import observe_engine

    e = SimEngine(CPUOffloadingSpec(8, secondary_tiers=[{"type": "example"}]), None, gpu_blocks=8, block_size=4,
                  use_torch=False)
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    obs = observe_engine(e, provider.get_meter("t"), name="e0")
    try:
        e.connector.request_finished("ghost")  # unknown to the connector
        e.manager.on_new_request(ReqContext("m"))
        e.manager.on_request_finished(ReqContext("m"))
        e.manager.on_request_finished(ReqContext("m"))  # a repeat the tiering manager itself ignores
        points = {p.attributes["reason"]: p.value for rm in reader.get_metrics_data().resource_metrics
                  for sm in rm.scope_metrics for m in sm.metrics if m.name == "kvevents.manager.requests.ignored"
                  for p in m.data.data_points}
        assert points == {"repeat": 1, "unknown": 1}
    finally:
        obs.close()
        provider.shutdown()
        e.shutdown()
