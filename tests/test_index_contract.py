"""The Index role's contract, in routing terms, run against every registered backend
(INDEX_BACKENDS) and each behind each telemetry decorator.

Only the role's verbs are used (store, remove, clear, match, lineage, stats, snapshot,
restore): whatever a backend keeps inside — bit masks in C or in a dict, sets of holders —
it must give the answers below. A backend that is registered but cannot be built here (the
native one without its C extension) is skipped with the reason."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from opentelemetry.sdk.trace import TracerProvider

from consumers import INDEX_BACKENDS, Index, KVRouter
from consumers.index import IndexImage, innermost
from consumers.instrumented import InstrumentedIndex, TracedIndex
from kvevents.errors import ConfigError

TIERS = 3


def _make(name: str, max_entries: int = 1 << 20) -> Index:
    name, _, wrapper = name.partition("+")
    try:
        idx = INDEX_BACKENDS.get(name).create(max_entries, max_tiers=TIERS)
    except ConfigError as exc:
        pytest.skip(f"index backend {name!r} not available: {exc}")
    if wrapper == "instrumented":
        return InstrumentedIndex(idx)
    if wrapper == "traced":  # with a live tracer, so that every span path runs
        return TracedIndex(idx, TracerProvider().get_tracer("contract"))
    return idx


def _buildable() -> list[str]:
    out = []
    for name in INDEX_BACKENDS.names():
        try:
            INDEX_BACKENDS.get(name).create(64, max_tiers=TIERS)
        except ConfigError:
            continue
        out.append(name)
    return out


# every backend, and each behind each telemetry decorator (a decorator answers as what it decorates)
@pytest.fixture(params=[*INDEX_BACKENDS.names(), *(f"{n}+{w}" for w in ("instrumented", "traced")
                                                      for n in INDEX_BACKENDS.names())])
def backend(request):
    return request.param


def held(idx: Index, key: int, endpoints=range(8)) -> set[tuple[int, int]]:
    """(endpoint, tier) pairs holding ``key``, asked through match()."""
    return {(e, t) for t in range(TIERS) for e in idx.match([key], [t], list(endpoints))[0]}


def records(image: IndexImage) -> list[tuple[int, list[tuple[int, int]], int | None]]:
    """A snapshot's records with holders as sorted (endpoint, tier) pairs (width-free)."""
    w = image.width
    return [(k, sorted((b % w, b // w) for b in range(m.bit_length()) if m >> b & 1), p) for k, m, p in image.records]


def test_store_chains_and_lineage(backend):
    idx = _make(backend)
    idx.store(1, 0, [10, 11, 12])
    idx.store(1, 0, [13], 12)
    idx.store(1, 1, [11, 12], chain=False)
    assert [held(idx, k) for k in (10, 11, 12, 13, 99)] == [{(1, 0)}, {(1, 0), (1, 1)}, {(1, 0), (1, 1)}, {(1, 0)},
                                                           set()]
    assert idx.lineage(13, 10) == [10, 11, 12, 13] and idx.lineage(13, 2) == [12, 13]
    assert idx.lineage(13, 10, stop=11) == [12, 13] and idx.lineage(99, 5) == [99]
    assert idx.keys_between(13, 10, 5) == [11, 12, 13] and idx.keys_between(13, 99, 5) is None
    assert idx.keys_between(13, 10, 2) is None
    st_ = idx.stats()
    assert (st_["entries"], st_["keys"], len(idx)) == (6, 4, 4)
    assert idx.stats("tiers")["by_tier"] == [4, 2, 0]
    assert idx.stats("endpoints")["by_endpoint"] == {1: [4, 2, 0]}
    assert idx.stats("bytes")["bytes"] > 0
    with pytest.raises(ValueError, match="unknown detail"):
        idx.stats("everything")
    # least recently stored first: storing a key moves it to the newest end
    assert records(idx.snapshot()) == [(10, [(1, 0)], None), (13, [(1, 0)], 12), (11, [(1, 0), (1, 1)], 10),
                                       (12, [(1, 0), (1, 1)], 11)]


def test_remove_and_clear(backend):
    idx = _make(backend)
    idx.store(0, 0, [1, 2, 3])
    idx.store(1, 0, [1, 2])
    assert idx.remove(0, 0, [2, 3, 42]) == 2
    assert held(idx, 2) == {(1, 0)} and held(idx, 3) == set()
    assert idx.remove(0, 2, [1]) == 0 and idx.remove(5, 0, [1]) == 0  # nothing held there
    assert idx.clear(1) == 2 and idx.stats()["entries"] == 1 and held(idx, 1) == {(0, 0)}
    assert idx.clear(7) == 0
    assert idx.stats()["keys"] == 3  # a key nobody holds keeps its link (it may count as a key)
    assert idx.lineage(3, 5) == [1, 2, 3]


def test_any_endpoint_number(backend):
    """Endpoints are the router's numbers, not a layout the caller must size first."""
    idx = _make(backend)
    idx.store(2, 0, [1, 2])
    idx.store(300, 2, [1, 2])
    assert held(idx, 2, endpoints=[2, 300]) == {(2, 0), (300, 2)}
    segments, ends = idx.match([1, 2, 3], [0, 2], [2, 300])
    assert segments == {2: [(0, 0)], 300: [(1, 0)]} and ends == {2: 2, 300: 2}
    image = idx.snapshot()
    image = image._replace(records=list(image.records))
    for name in _buildable():  # a wide image into a fresh (narrow) index of every backend
        other = _make(name)
        other.restore(image)
        assert held(other, 2, endpoints=[2, 300]) == {(2, 0), (300, 2)} and records(other.snapshot()) == records(image)
    with pytest.raises(ValueError):
        idx.store(1, TIERS + 5, [1])


def test_match_walks_tiers_heaviest_first(backend):
    idx = _make(backend)
    idx.store(0, 0, [1, 2])
    idx.store(0, 1, [3], chain=False)
    idx.store(0, 0, [4], chain=False)  # above the tier the match moved down to: not taken back
    idx.store(1, 1, [1, 2, 3, 4])
    segments, ends = idx.match([1, 2, 3, 4, 5], [0, 1], [0, 1, 2])
    assert segments == {0: [(0, 0), (1, 2)], 1: [(1, 0)]} and ends == {0: 3, 1: 4}
    assert idx.match([1, 2], [1, 0], [0]) == ({0: [(1, 0)]}, {0: 2})  # stage order is the caller's
    assert idx.match([], [0], [0]) == ({}, {}) and idx.match([1], [0], []) == ({}, {})


def _spec_match(state: dict[int, set], keys, tiers, endpoints):
    """The match as the role's docstring states it, over the stored pairs."""
    segments, ends = {}, {}
    for e in endpoints:
        stage, seg = 0, []
        for j, k in enumerate(keys):
            while stage < len(tiers) and (e, tiers[stage]) not in state.get(k, ()):
                stage += 1
            if stage == len(tiers):
                break
            if not seg or seg[-1][0] != stage:
                seg.append((stage, j))
        else:
            j = len(keys)
        if seg:
            segments[e], ends[e] = seg, j
    return segments, ends


_OPS = st.lists(st.tuples(st.sampled_from(["chain", "join", "remove", "clear"]),
                          st.lists(st.integers(0, 20), min_size=1, max_size=4, unique=True),
                          st.integers(0, TIERS - 1), st.integers(0, 3)), max_size=30)


def _run(idx: Index, ops) -> dict[int, set]:
    state: dict[int, set] = {}
    for op, keys, tier, ep in ops:
        if op == "chain":
            idx.store(ep, tier, keys)
        elif op == "join":
            idx.store(ep, tier, keys, chain=False)
        elif op == "remove":
            idx.remove(ep, tier, keys)
        else:
            idx.clear(ep)
        for k in keys if op != "clear" else list(state):
            s = state.setdefault(k, set())
            if op in ("chain", "join"):
                s.add((ep, tier))
            elif op == "remove":
                s.discard((ep, tier))
            else:
                s.difference_update({p for p in s if p[0] == ep})
    return state


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS, prompt=st.lists(st.integers(0, 20), max_size=8),
       tiers=st.permutations(range(TIERS)), n_tiers=st.integers(1, TIERS))
def test_match_is_the_staged_walk(backend, ops, prompt, tiers, n_tiers):
    idx = _make(backend)
    state = _run(idx, ops)
    stages = list(tiers)[:n_tiers]
    assert idx.match(prompt, stages, range(4)) == _spec_match(state, prompt, stages, range(4))
    assert idx.stats()["entries"] == sum(map(len, state.values()))


def test_budget_evicts_the_least_recently_stored(backend):
    idx = _make(backend, max_entries=64)
    for k in range(200):
        idx.store(0, 0, [k], chain=False)
    st_ = idx.stats()
    assert st_["entries"] <= 64 and st_["evicted_keys"] > 0 and st_["evicted_entries"] == st_["evicted_keys"]
    assert held(idx, 199) == {(0, 0)} and held(idx, 0) == set()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS)
def test_snapshot_restores_into_every_backend(backend, ops):
    """Same verbs, same content: every backend's snapshot (records oldest first) is the same,
    and restores into every other backend."""
    idx = _make(backend, max_entries=40)  # small: evictions happen
    _run(idx, ops)
    image = idx.snapshot()
    image = image._replace(records=list(image.records))  # (records may be an iterator: read once)
    want = records(image)
    for name in _buildable():
        same = _make(name, max_entries=40)
        _run(same, ops)
        assert records(same.snapshot()) == want, name
        other = _make(name)
        other.restore(image)
        assert records(other.snapshot()) == want, name
        assert other.stats()["entries"] == idx.stats()["entries"] and len(other) == len(idx)
        assert other.stats()["evicted_keys"] == idx.stats()["evicted_keys"]


def test_router_config_picks_the_backend(backend):
    _make(backend)  # (skips where it cannot be built)
    name, _, wrapper = backend.partition("+")
    r = KVRouter(model="m", index=name, index_metrics=wrapper == "instrumented", index_tracing=wrapper == "traced")
    assert type(innermost(r.index)) is INDEX_BACKENDS.get(name)
    assert isinstance(r.index, InstrumentedIndex) == (wrapper == "instrumented")
    assert isinstance(r.index, TracedIndex) == (wrapper == "traced")
    with pytest.raises(ConfigError, match="unknown index backend 'nope'"):
        KVRouter(model="m", index="nope")


def test_no_backend_subclasses_another():
    classes = [INDEX_BACKENDS.get(n) for n in INDEX_BACKENDS.names()]
    assert len(classes) >= 2
    for a in classes:
        for b in classes:
            assert a is b or not issubclass(a, b), (a, b)


def test_the_c_paths_follow_the_native_table_through_grow_and_restore():
    """The router hands the native table to the C ingest and score once; a grow (past 64
    endpoints) and a restore (a new table) must reach them: C answers as the Python walk does."""
    from consumers.keys import _FAST
    from kvevents import BlockStored, KVEventBatch, encode_batch

    if _FAST is None:
        pytest.skip("the C extension is not in use")
    routers = [KVRouter(model="m", block_size=2, index=name, index_metrics=True) for name in ("native", "reference")]
    prompt = list(range(8))
    for i in range(70):  # 70 pods: past the first 64-endpoint layout
        n = 1 + i % 4  # (canonical blocks, GPU and CPU: what the C ingest applies itself)
        ev = BlockStored([1000 + 10 * i + j for j in range(n)], None, prompt[: 2 * n], 2, None, ("GPU", "CPU")[i % 2],
                         None)
        for r in routers:
            r.apply_payload(f"p{i}", encode_batch(KVEventBatch(0.0, [ev])))
    native, ref = routers
    assert native.ingestor.native and not ref.ingestor.native
    assert native.index.calls["store"] == 0 and ref.index.calls["store"] == 70  # C wrote every block
    want = {p: s.tokens_by_tier for p, s in ref.score(prompt).items()}
    assert len(want) == 70 and want["p69"] == {"CPU": 4}
    assert {p: s.tokens_by_tier for p, s in native.score(prompt).items()} == want
    back = KVRouter(model="m", block_size=2, index="native")
    back.restore(native.snapshot())
    assert {p: s.tokens_by_tier for p, s in back.score(prompt).items()} == want
    assert back.scorer.score_json(prompt) is not None  # (the C answer ran)
