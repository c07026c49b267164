"""The Index role's contract, run against every registered backend (INDEX_BACKENDS).

A backend that is registered but cannot be built here (the native one without its C
extension) is skipped with the reason; every other one must give the answers below."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opentelemetry.sdk.trace import TracerProvider

from consumers import INDEX_BACKENDS, Index, KVRouter
from consumers.instrumented import InstrumentedIndex, TracedIndex
from kvevents.errors import ConfigError


def _make(name: str, max_entries: int = 1 << 20) -> Index:
    name, _, wrapper = name.partition("+")
    try:
        idx = INDEX_BACKENDS.get(name).create(max_entries, max_tiers=3)
    except ConfigError as exc:
        pytest.skip(f"index backend {name!r} not available: {exc}")
    if wrapper == "instrumented":
        return InstrumentedIndex(idx)
    if wrapper == "traced":  # with a live tracer, so that every span path runs
        return TracedIndex(idx, TracerProvider().get_tracer("contract"))
    return idx


# every backend, and each behind each telemetry wrapper (the role's wrappers must answer as the
# backend they wrap)
@pytest.fixture(params=[*INDEX_BACKENDS.names(), *(f"{n}+{w}" for w in ("instrumented", "traced")
                                                      for n in INDEX_BACKENDS.names())])
def backend(request):
    return request.param


def test_chains_masks_and_parents(backend):
    idx = _make(backend)
    g, c = idx.bit(0, 1), idx.bit(1, 1)
    idx.add_chain([10, 11, 12], g, None)
    idx.add_chain([13], g, 12)
    idx.add([11, 12], c)
    assert [idx.mask(k) for k in (10, 11, 12, 13, 99)] == [g, g | c, g | c, g, None]
    assert idx.walk_back(13, 10) == [10, 11, 12, 13]
    assert idx.walk_back(13, 2) == [12, 13]
    assert idx.keys_between(13, 10, 5) == [11, 12, 13] and idx.keys_between(13, 99, 5) is None
    assert idx.entries == 6 and len(idx) == 4
    assert idx.lane_counts(3) == [4, 2, 0]
    # oldest first: storing a key moves it to the newest end
    assert list(idx.items()) == [(10, g, None), (13, g, 12), (11, g | c, 10), (12, g | c, 11)]


def test_remove_clear_and_grow(backend):
    idx = _make(backend)
    a, b = idx.bit(0, 0), idx.bit(0, 1)
    idx.add_chain([1, 2, 3], a, None)
    idx.add_chain([1, 2], b, None)
    assert idx.remove([2, 3, 42], a) == 2
    assert idx.mask(2) == b and idx.mask(3) == 0
    assert idx.clear_slot(1) == 2 and idx.entries == 1
    idx.grow(idx.cap * 2)
    assert idx.mask(1) == idx.bit(0, 0) and idx.entries == 1
    assert idx.stats()["entries"] == 1 and idx.stats()["keys"] == 3


def test_match_walks_tiers_heaviest_first(backend):
    idx = _make(backend)
    idx.add_chain([1, 2], idx.bit(0, 0), None)
    idx.add([3], idx.bit(1, 0))
    segments, ends = idx.match([1, 2, 3, 4], [idx.lane(0), idx.lane(1)], 1)
    assert segments == {0: [(0, 0), (1, 2)]} and ends == {0: 3}


def test_budget_evicts_the_oldest(backend):
    idx = _make(backend, max_entries=64)
    for k in range(200):
        idx.add([k], idx.bit(0, 0))
    assert idx.entries <= 64 and idx.evicted_keys > 0
    assert idx.mask(199) is not None and idx.mask(0) is None
    assert idx.stats()["evicted_entries"] == idx.evicted_entries


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(st.tuples(st.sampled_from(["chain", "add", "remove"]), st.lists(st.integers(0, 30), min_size=1,
                                                                                      max_size=4, unique=True),
                              st.integers(0, 2), st.integers(0, 3)), max_size=25))
def test_items_and_load_round_trip(backend, ops):
    idx = _make(backend)
    for op, keys, tier, slot in ops:
        bit = idx.bit(tier, slot)
        if op == "chain":
            idx.add_chain(keys, bit, None)
        elif op == "add":
            idx.add(keys, bit)
        else:
            idx.remove(keys, bit)
    items = list(idx.items())
    other = _make(backend)
    other.load(items)
    assert list(other.items()) == items and other.entries == idx.entries and len(other) == len(idx)


def test_router_config_picks_the_backend(backend):
    _make(backend)  # (skips where it cannot be built)
    name, _, wrapper = backend.partition("+")
    r = KVRouter(model="m", index=name, index_metrics=wrapper == "instrumented", index_tracing=wrapper == "traced")
    inner = r.index.inner if wrapper else r.index
    assert type(inner) is INDEX_BACKENDS.get(name)
    assert isinstance(r.index, InstrumentedIndex) == (wrapper == "instrumented")
    assert isinstance(r.index, TracedIndex) == (wrapper == "traced")
    with pytest.raises(ConfigError, match="unknown index backend 'nope'"):
        KVRouter(model="m", index="nope")
