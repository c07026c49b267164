"""The CPU tier's store admission by repeat offers (store_threshold / max_tracker_size), and a
failed store's never_stored removal narrowed at the drain."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from kvevents import ConfigError
from manager import CPUOffloadingManager, LookupResult, OffloadingEvent, ReqContext, make_offload_key
from manager.admission import RepeatOfferAdmission
from manager.spec_cpu import CPUOffloadingSpec
from manager.telemetry import observe_manager
from manager.tiering import ExampleSecondaryTierManager, TieringOffloadingManager
from manager.wire import offload_events_to_kv_events

CTX = ReqContext("r")


def K(i: int) -> bytes:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def offer(m: CPUOffloadingManager, keys: list[bytes], ctx: ReqContext = CTX) -> list[bytes]:
    """Offer ``keys`` for store; complete what was admitted; the admitted keys."""
    out = m.prepare_store(keys, ctx)
    assert out is not None
    if out.keys_to_store:
        m.complete_store(out.keys_to_store, ctx)
    return out.keys_to_store


def test_without_a_threshold_every_offered_key_is_stored() -> None:
    for threshold in (0, 1):
        m = CPUOffloadingManager(4, store_threshold=threshold)
        assert m.admission is None
        assert offer(m, [K(1), K(2)]) == [K(1), K(2)] and m.stats()["stores_not_admitted"] == 0


def test_a_key_is_stored_on_its_threshold_th_offer_and_lookups_do_not_count() -> None:
    m = CPUOffloadingManager(4, store_threshold=3, max_tracker_size=8)
    for _ in range(5):
        assert m.lookup(K(1), CTX) is LookupResult.MISS
    assert m.lookup_prefix([K(1), K(2)], CTX) == 0
    assert m.admission is not None and len(m.admission) == 0
    assert offer(m, [K(1), K(2)]) == []
    assert offer(m, [K(1), K(2), K(1)]) == []  # a key twice in one offer counts once
    assert dict(m.admission.counts) == {K(1): 2, K(2): 2} and m.stores_not_admitted == 4
    assert offer(m, [K(2), K(1)]) == [K(2), K(1)]  # the offer's order
    assert m.lookup(K(1), CTX) is LookupResult.HIT and m.stats()["stores_not_admitted"] == 4
    # resident keys are neither candidates nor skipped
    assert offer(m, [K(1), K(2)]) == [] and m.stores_not_admitted == 4


def test_the_table_forgets_its_least_recently_offered_key() -> None:
    m = CPUOffloadingManager(4, store_threshold=2, max_tracker_size=2)
    offer(m, [K(1)])
    offer(m, [K(2)])
    offer(m, [K(3)])  # K(1) is the least recently offered: forgotten
    assert m.admission is not None and list(m.admission.counts) == [K(2), K(3)]
    assert offer(m, [K(1)]) == []  # counted from 1 again
    assert offer(m, [K(3)]) == [K(3)]


def test_an_offer_larger_than_the_table_is_stored_over_successive_offers() -> None:
    m = CPUOffloadingManager(8, store_threshold=2, max_tracker_size=3)
    keys = [K(i) for i in range(7)]
    stored: list[bytes] = []
    for _ in range(8):
        stored += offer(m, [k for k in keys if k not in stored])
        if len(stored) == len(keys):
            break
    assert sorted(stored) == sorted(keys)


def test_a_resident_key_aged_out_of_the_table_stays_cached_and_uncounted_as_skipped() -> None:
    m = CPUOffloadingManager(2, store_threshold=2, max_tracker_size=2)
    offer(m, [K(1), K(2)])
    assert offer(m, [K(1), K(2)]) == [K(1), K(2)]
    offer(m, [K(3), K(4)])  # fills the table: K(1), K(2) forgotten, nothing stored
    assert m.admission is not None and K(1) not in m.admission.counts
    skipped = m.stores_not_admitted
    assert offer(m, [K(1)]) == [] and m.stores_not_admitted == skipped  # resident: not a candidate
    assert m.cached_keys() == {K(1), K(2)}


def test_the_counts_view_is_read_only() -> None:
    m = CPUOffloadingManager(2, store_threshold=2)
    offer(m, [K(1)])
    assert m.admission is not None
    with pytest.raises(TypeError):
        m.admission.counts[K(1)] = 5  # type: ignore[index]


@pytest.mark.parametrize(("kw", "msg"), [
    ({"store_threshold": -1}, "store_threshold must be an int >= 0, got -1"),
    ({"store_threshold": 2.0}, "store_threshold must be an int >= 0, got 2.0"),
    ({"store_threshold": True}, "store_threshold must be an int >= 0, got True"),
    ({"store_threshold": 2, "max_tracker_size": 0}, "max_tracker_size must be an int >= 1, got 0"),
])
def test_bad_admission_settings_name_the_key(kw: dict, msg: str) -> None:
    with pytest.raises(ConfigError, match=f"^CPUOffloadingManager: {msg}$"):
        CPUOffloadingManager(4, **kw)
    with pytest.raises(ConfigError, match="store_threshold must be >= 2"):
        RepeatOfferAdmission(1, 8)


def test_not_admitted_blocks_show_in_metrics() -> None:
    m = CPUOffloadingManager(4, store_threshold=2)
    reader = InMemoryMetricReader()
    obs = observe_manager(m, meter=MeterProvider(metric_readers=[reader]).get_meter("t"), engine="e0")
    offer(m, [K(1), K(2), K(3)])
    offer(m, [K(1)])
    got = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                for p in metric.data.data_points:
                    got[(metric.name, tuple(sorted(p.attributes.items())))] = p.value
    assert got[("kvevents.manager.stores.not_admitted", (("engine", "e0"), ("tier", "CPU")))] == 3
    obs.close()


def test_a_failed_stores_removal_leaves_out_keys_stored_again_before_the_drain() -> None:
    m = CPUOffloadingManager(4, enable_events=True)
    assert m.prepare_store([K(1), K(2), K(3)], CTX) is not None
    m.complete_store([K(1), K(2), K(3)], CTX, success=False)
    assert offer(m, [K(2)]) == [K(2)]  # a retry takes K(2) again before anyone drained
    assert m.take_events() == [
        OffloadingEvent([K(1), K(3)], "CPU", True, never_stored=True),
        OffloadingEvent([K(2)], "CPU", False),
    ]
    # every key retried: the removal is not handed out at all
    assert m.prepare_store([K(4)], CTX) is not None
    m.complete_store([K(4)], CTX, success=False)
    assert m.prepare_store([K(4)], CTX) is not None  # written again (not completed yet)
    assert m.take_events() == [] and m.take_events() == []


def test_never_stored_removals_follow_the_event_factory() -> None:
    m = CPUOffloadingManager(2, enable_events=True)
    made = []

    def factory(keys: list, medium: str, removed: bool, never_stored: bool = False):
        made.append((list(keys), removed, never_stored))
        return None if never_stored else ("ev", tuple(keys), removed)

    m.event_factory = factory
    assert m.prepare_store([K(1)], CTX) is not None
    m.complete_store([K(1)], CTX, success=False)  # the factory has no use for it: nothing kept
    assert offer(m, [K(2)]) == [K(2)]
    assert m.take_events() == [("ev", (K(2),), False)]
    assert made == [([K(1)], True, True), ([K(2)], False, False)]
    assert offload_events_to_kv_events([OffloadingEvent([K(1)], "CPU", True, True)]) == []


def test_the_cpu_spec_builds_its_tier_with_the_admission_settings() -> None:
    m = CPUOffloadingSpec(4, store_threshold=2, max_tracker_size=16).get_manager()
    assert isinstance(m, CPUOffloadingManager) and m.admission is not None
    assert (m.admission.threshold, m.admission.capacity) == (2, 16)
    assert CPUOffloadingSpec(4).get_manager().admission is None
    with pytest.raises(ConfigError, match="^CPUOffloadingSpec: max_tracker_size must be an int >= 1, got 0$"):
        CPUOffloadingSpec(4, store_threshold=2, max_tracker_size=0)
    with pytest.raises(ConfigError, match="store_threshold >= 2 cannot be used with secondary_tiers"):
        CPUOffloadingSpec(4, store_threshold=2, secondary_tiers=[{"type": "example"}])
    with pytest.raises(ConfigError, match="^TieringOffloadingManager: a primary with store_threshold >= 2 cannot"):
        TieringOffloadingManager(CPUOffloadingManager(4, store_threshold=2), [ExampleSecondaryTierManager()])
    assert TieringOffloadingManager(CPUOffloadingManager(4, store_threshold=2), []).primary.admission is not None
