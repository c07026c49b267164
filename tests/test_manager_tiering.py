"""Tiering: the factory, the example tier, and TieringOffloadingManager's lifecycle."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

from kvevents import ConfigError
from manager import (
    CPUOffloadingManager,
    LookupResult,
    NumpyBlockIO,
    OffloadPolicy,
    ReqContext,
    RequestOffloadingContext,
    make_offload_key,
)
from manager.tiering import (
    ExampleSecondaryTierManager,
    JobMetadata,
    JobResult,
    SecondaryTierFactory,
    SecondaryTierManager,
    TieringOffloadingManager,
)


def K(i: int) -> bytes:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def make(num_blocks: int = 8, *tier_kw: dict, io: bool = True):  # type: ignore[no-untyped-def]
    block_io = NumpyBlockIO.allocate(num_blocks, 16) if io else None
    primary = CPUOffloadingManager(num_blocks, "lru", enable_events=True)
    tiers = [
        SecondaryTierFactory.create_secondary_tier({"type": "example", "medium": f"T{i}", **kw})
        for i, kw in enumerate(tier_kw or ({},))
    ]
    return TieringOffloadingManager(primary, tiers, block_io=block_io), primary, tiers, block_io


def store(m: TieringOffloadingManager, ctx: ReqContext, keys: list[bytes]) -> None:
    out = m.prepare_store(keys, ctx)
    assert out is not None
    m.complete_store(out.keys_to_store, ctx)


# -- factory ---------------------------------------------------------------------------


def test_factory_creates_example_with_custom_param() -> None:
    tier = SecondaryTierFactory.create_secondary_tier({"type": "example", "custom_param": 42})
    assert isinstance(tier, ExampleSecondaryTierManager)
    assert tier.tier_type == "example" and tier.custom_param == 42
    assert not hasattr(tier, "get_tier_type")


def test_factory_errors() -> None:
    with pytest.raises(ConfigError, match="no 'type'.*example, fs"):
        SecondaryTierFactory.create_secondary_tier({"custom_param": 1})
    with pytest.raises(ConfigError, match="unknown secondary tier type 'tape'.*example, fs"):
        SecondaryTierFactory.create_secondary_tier({"type": "tape"})
    with pytest.raises(ConfigError, match="must be a dict"):
        SecondaryTierFactory.create_secondary_tier("example")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="already registered"):
        SecondaryTierFactory.register_tier("example", "x.y", "Z")
    SecondaryTierFactory.register_tier("t_badmod", "no_such_module_xyz", "Tier")
    with pytest.raises(ConfigError, match="cannot import module 'no_such_module_xyz'.*supported types"):
        SecondaryTierFactory.create_secondary_tier({"type": "t_badmod"})
    SecondaryTierFactory.register_tier("t_noclass", "manager.tiering.example", "NoSuchClass")
    with pytest.raises(ConfigError, match="has no class 'NoSuchClass'"):
        SecondaryTierFactory.create_secondary_tier({"type": "t_noclass"})
    SecondaryTierFactory.register_tier("t_notier", "manager.cpu", "CPUOffloadingManager")
    with pytest.raises(ConfigError, match="is not a SecondaryTierManager"):
        SecondaryTierFactory.create_secondary_tier({"type": "t_notier"})
    with pytest.raises(ConfigError, match="bad arguments"):
        SecondaryTierFactory.create_secondary_tier({"type": "example", "bogus": 1})


def test_factory_lazy_out_of_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    SecondaryTierFactory.register_tier("t_oot", "oot_tier_mod", "MyTier")
    assert "oot_tier_mod" not in sys.modules  # registering imports nothing
    mod = types.ModuleType("oot_tier_mod")

    class MyTier(ExampleSecondaryTierManager):
        pass

    mod.MyTier = MyTier  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "oot_tier_mod", mod)
    tier = SecondaryTierFactory.create_secondary_tier({"type": "t_oot"})
    assert isinstance(tier, MyTier) and tier.tier_type == "t_oot"


# -- example tier ------------------------------------------------------------------------


def test_example_tier_failed_load_result() -> None:
    tier = ExampleSecondaryTierManager()
    tier.submit_store(JobMetadata(1, [K(1)], np.array([0], dtype=np.int64), False))
    tier.submit_load(JobMetadata(2, [K(1), K(2)], np.array([0, 1], dtype=np.int64), True))
    tier.submit_load(JobMetadata(3, [K(1)], np.array([0], dtype=np.int64), True))
    assert tier.get_finished_jobs() == [JobResult(1, True), JobResult(2, False), JobResult(3, True)]
    assert tier.get_finished_jobs() == []


# -- TieringOffloadingManager ------------------------------------------------------------


def test_completed_primary_store_cascades_with_bytes() -> None:
    m, primary, (tier,), io = make()
    ctx = ReqContext("a")
    m.on_new_request(ctx)
    out = m.prepare_store([K(1), K(2)], ctx)
    assert out is not None
    for k, b in zip(out.keys_to_store, out.store_spec.block_ids.tolist()):
        io.write_block(b, (k * 2)[:16])
    assert tier.cached_keys() == set()  # not before the store completes
    m.complete_store(out.keys_to_store, ctx)
    assert tier.cached_keys() == {K(1), K(2)}
    assert tier.store[K(1)] == (K(1) * 2)[:16]
    assert primary.ref_count(K(1)) == 1  # pinned until the job's result is processed
    m.on_schedule_end()  # this step's gate was used by prepare_store: processed next step
    assert primary.ref_count(K(1)) == 1
    m.on_schedule_end()  # catch-all poll of a step with no other call
    assert primary.ref_count(K(1)) == 0
    assert not m.has_pending_work()


def test_promotion_reserves_queues_and_flushes_in_on_schedule_end() -> None:
    m, primary, (tier,), io = make()
    tier.store[K(1)] = b"1" * 16
    tier.store[K(2)] = b"2" * 16
    ctx = ReqContext("a")
    m.on_new_request(ctx)
    assert m.lookup(K(1), ctx) is LookupResult.RETRY
    assert m.lookup(K(2), ctx) is LookupResult.RETRY
    assert primary.ref_count(K(1)) == -1  # slot reserved at once
    assert m.lookup(K(1), ctx) is LookupResult.RETRY  # in flight: no second promotion
    assert m.promotions_started == 2 and tier.get_finished_jobs() == []  # not submitted yet
    m.on_schedule_end()  # one job for the (tier, request) queue
    assert len(m._jobs) == 1 and m.has_pending_work()
    m.on_schedule_end()  # result processed
    assert m.lookup(K(1), ctx) is LookupResult.HIT
    assert bytes(io.read_block(primary.block_id(K(2)))) == b"2" * 16  # type: ignore[arg-type]
    stored = [(e.keys, e.medium) for e in m.take_events() if not e.removed]
    assert (sorted([K(1), K(2)]), "CPU") in [(sorted(k), med) for k, med in stored]


def test_failed_promotion_frees_the_slot() -> None:
    m, primary, (tier,), _ = make()
    tier.store[K(1)] = None
    ctx = ReqContext("a")
    assert m.lookup(K(1), ctx) is LookupResult.RETRY
    del tier.store[K(1)]  # gone before the job runs: failed JobResult
    m.on_schedule_end()
    m.on_schedule_end()
    assert m.promotions_failed == 1 and primary.block_id(K(1)) is None
    assert m.lookup(K(1), ctx) is LookupResult.MISS
    assert not m.has_pending_work()


def test_take_events_never_changes_job_state() -> None:
    m, primary, (tier,), _ = make()
    tier.store[K(9)] = None
    ctx = ReqContext("a")
    m.lookup(K(9), ctx)
    out = m.prepare_store([K(1)], ctx)
    assert out is not None
    m.complete_store([K(1)], ctx)

    def snapshot():  # type: ignore[no-untyped-def]
        return (
            dict(m._jobs),
            dict(m._promoting),
            {k: list(q.keys) for k, q in m._promo_queues.items()},
            primary.ref_count(K(1)),
            primary.ref_count(K(9)),
            m.has_pending_work(),
            m._processed_this_step,
        )

    before = snapshot()
    for _ in range(3):
        m.take_events()
    assert snapshot() == before
    # The lifecycle work happens in on_schedule_end only.
    m.on_schedule_end()
    assert snapshot() != before


def test_finished_jobs_processed_once_per_step() -> None:
    m, primary, (tier,), _ = make()
    ctx = ReqContext("a")
    m.lookup(K(50), ctx)  # opens the gate for this step (nothing to process)
    store(m, ctx, [K(1)])  # cascade job finishes at once in the example tier
    m.lookup(K(51), ctx)
    m.prepare_store([K(2)], ctx)
    assert primary.ref_count(K(1)) == 1  # gate already used this step: result not processed yet
    m.on_schedule_end()  # gate used: still not processed; gate reset
    assert primary.ref_count(K(1)) == 1
    m.lookup(K(52), ctx)  # first call of the new step processes it
    assert primary.ref_count(K(1)) == 0


def test_on_new_request_tracks_only_request_level_tiers() -> None:
    m, _, tiers, _ = make(8, {}, {"request_level": True}, {})
    ctx = ReqContext("a")
    assert m.on_new_request(ctx).policy is OffloadPolicy.REQUEST_LEVEL
    assert m.request_level_tiers("a") == [1]
    m2, _, _, _ = make(8, {}, {})
    assert m2.on_new_request(ReqContext("b")).policy is OffloadPolicy.BLOCK_LEVEL
    assert m2.request_level_tiers("b") == []
    m.on_request_finished(ctx)
    assert m.request_level_tiers("a") == []


def test_primary_resident_blocks_cascade_to_request_level_tiers() -> None:
    m, primary, (bl, rl), _ = make(8, {}, {"request_level": True})
    a = ReqContext("a")
    m.on_new_request(a)
    store(m, a, [K(1), K(2)])  # both tiers get them
    m.on_request_finished(a)
    m.on_schedule_end()
    rl.remove([K(1), K(2)])
    bl.remove([K(1), K(2)])
    b = ReqContext("b")
    assert m.on_new_request(b).policy is OffloadPolicy.REQUEST_LEVEL
    out = m.prepare_store([K(1), K(2), K(3)], b)  # K1, K2 are prefix hits in the primary
    assert out is not None and out.keys_to_store == [K(3)]
    assert rl.cached_keys() == {K(1), K(2)}  # cascaded from the primary right away
    assert bl.cached_keys() == set()  # a BLOCK_LEVEL tier does not get prefix hits
    m.complete_store([K(3)], b)
    assert rl.cached_keys() == {K(1), K(2), K(3)} and bl.cached_keys() == {K(3)}


def test_on_request_finished_waits_for_pending_primary_stores() -> None:
    m, _, (tier,), _ = make()
    ctx = ReqContext("a")
    m.on_new_request(ctx)
    out = m.prepare_store([K(1), K(2)], ctx)
    assert out is not None
    m.on_request_finished(ctx)
    assert tier.finished_requests == []  # stores still pending
    m.complete_store([K(1)], ctx)
    m.on_schedule_end()
    assert tier.finished_requests == []
    m.complete_store([K(2)], ctx)
    assert tier.finished_requests == ["a"]  # reached, after the stores (and their cascades)
    assert tier.cached_keys() == {K(1), K(2)}


def test_on_request_finished_waits_for_queued_promotions() -> None:
    m, _, (tier,), _ = make()
    tier.store[K(1)] = None
    ctx = ReqContext("a")
    m.lookup(K(1), ctx)
    m.on_request_finished(ctx)
    assert tier.finished_requests == []
    m.on_schedule_end()  # promotion submitted, then the finish is delivered
    assert tier.finished_requests == ["a"]


class _RecordingTier(ExampleSecondaryTierManager):
    calls: list[str]

    def __init__(self, tier_type: str = "rec", **kw):  # type: ignore[no-untyped-def]
        super().__init__(tier_type, **kw)
        self.calls = []

    def get_finished_jobs(self) -> list[JobResult]:
        self.calls.append("get_finished_jobs")
        return super().get_finished_jobs()

    def submit_load(self, job: JobMetadata) -> None:
        self.calls.append("submit_load")
        super().submit_load(job)

    def on_schedule_end(self) -> None:
        self.calls.append("on_schedule_end")


def test_on_schedule_end_order() -> None:
    tier = _RecordingTier()
    tier.store[K(1)] = None
    m = TieringOffloadingManager(CPUOffloadingManager(4), [tier])
    ctx = ReqContext("a")
    m.lookup(K(1), ctx)  # processes (gate) and queues a promotion
    tier.calls.clear()
    m._processed_this_step = False  # as if a new step began without any call yet
    m.on_schedule_end()
    assert tier.calls == ["get_finished_jobs", "submit_load", "on_schedule_end"]
    assert m._processed_this_step is False


class _ContextTier(_RecordingTier):
    def on_schedule_end(self, context=None) -> None:
        self.calls.append(("on_schedule_end", context))


def test_on_schedule_end_passes_the_step_context_to_tiers_that_take_it() -> None:
    """vLLM 0.33's hook is on_schedule_end(context); ours accepts it and hands it on, while a
    tier written with no argument (_RecordingTier) is still called without one."""
    new_style, old_style = _ContextTier(), _RecordingTier()
    m = TieringOffloadingManager(CPUOffloadingManager(4), [new_style, old_style])
    step = object()
    m.on_schedule_end(step)
    m.on_schedule_end()
    assert [c for c in new_style.calls if c != "get_finished_jobs"] == [("on_schedule_end", step),
                                                                       ("on_schedule_end", None)]
    assert old_style.calls.count("on_schedule_end") == 2


def test_store_rejected_when_primary_full() -> None:
    m, primary, _, _ = make(2)
    ctx = ReqContext("a")
    out = m.prepare_store([K(1), K(2)], ctx)
    assert out is not None
    assert m.prepare_store([K(3)], ctx) is None


def test_secondary_tier_abc_requires_methods() -> None:
    class Half(SecondaryTierManager):
        def lookup(self, key, ctx=None):  # type: ignore[no-untyped-def]
            return LookupResult.MISS

    with pytest.raises(TypeError):
        Half("half")  # type: ignore[abstract]
    assert RequestOffloadingContext().policy is OffloadPolicy.BLOCK_LEVEL


class _CachingAsyncTier(SecondaryTierManager):
    """An asynchronous tier shaped like vllm-kvblockd's: a key's first lookup answers RETRY and
    queues a query, answered at the step's end from what the tier holds then, and the answer
    is cached until every request that asked finishes. Store jobs land when the test says."""

    def __init__(self) -> None:
        super().__init__("caching")
        self.blobs: dict[bytes, bytes] = {}
        self.answers: dict[bytes, bool | None] = {}
        self.askers: dict[bytes, set[str]] = {}
        self.unowned_lookups = 0  # lookups with no request: answers no request's end clears
        self._in_flight: list[JobMetadata] = []
        self._finished: list[JobResult] = []

    def lookup(self, key, req_context=None):  # type: ignore[no-untyped-def]
        if req_context is None:
            self.unowned_lookups += 1
        self.askers.setdefault(key, set()).add(req_context.req_id if req_context else "")
        answer = self.answers.setdefault(key, None)
        if answer is None:
            return LookupResult.RETRY
        return LookupResult.HIT if answer else LookupResult.MISS

    def on_schedule_end(self) -> None:
        for key, answer in self.answers.items():
            if answer is None:
                self.answers[key] = key in self.blobs

    def on_request_finished(self, req_context: ReqContext) -> None:
        for key in [k for k, reqs in self.askers.items() if req_context.req_id in reqs]:
            self.askers[key].discard(req_context.req_id)
            if not self.askers[key]:
                del self.askers[key], self.answers[key]

    def submit_store(self, job: JobMetadata) -> None:
        self._in_flight.append(job)

    def land_stores(self) -> None:
        for job in self._in_flight:
            for key, b in zip(job.keys, job.block_ids.tolist()):
                self.blobs[key] = bytes(self.block_io.read_block(b))
            self._finished.append(JobResult(job.job_id, True))
        self._in_flight = []

    def submit_load(self, job: JobMetadata) -> None:
        for key, b in zip(job.keys, job.block_ids.tolist()):
            self.block_io.write_block(b, self.blobs[key])
        self._finished.append(JobResult(job.job_id, True))

    def get_finished_jobs(self) -> list[JobResult]:
        out, self._finished = self._finished, []
        return out

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()


def test_a_tier_with_cached_async_lookups_serves_what_was_stored_into_it() -> None:
    """Issue 22 (the kvblockd round trip that failed about 3 runs in 8): storing into a tier
    must not ask the tier's lookup (asked with no request, an asynchronous tier caches its answer
    for good; taken before the store landed it is a MISS, and the block never came back)."""
    tier = _CachingAsyncTier()
    io = NumpyBlockIO.allocate(2, 16)
    m = TieringOffloadingManager(CPUOffloadingManager(2, "lru"), [tier], block_io=io)
    ctx = ReqContext("a")
    m.on_new_request(ctx)
    for i in range(3):  # the third store evicts K(0) from the 2-block primary
        out = m.prepare_store([K(i)], ctx)
        assert out is not None
        io.write_block(int(out.store_spec.block_ids[0]), bytes([i + 1]) * 16)
        m.complete_store([K(i)], ctx)
        m.on_schedule_end()  # the step ends before the tier's store lands
        tier.land_stores()
        m.on_schedule_end()  # the store's result: K(i) unpinned in the primary
    assert tier.unowned_lookups == 0
    assert m.primary.lookup(K(0), ctx) is LookupResult.MISS and K(0) in tier.blobs
    seen = []
    for _ in range(4):
        seen.append(m.lookup(K(0), ctx))
        if seen[-1] is LookupResult.HIT:
            break
        m.on_schedule_end()
    # RETRY (the tier's query), RETRY (its HIT: the promotion starts), HIT
    assert seen == [LookupResult.RETRY, LookupResult.RETRY, LookupResult.HIT], (seen, m.stats())
    assert m.promotions_started == 1
    spec = m.prepare_load([K(0)], ctx)
    assert io.read_block(int(spec.block_ids[0])).tobytes() == bytes([1]) * 16


class _PartialLoadTier(ExampleSecondaryTierManager):
    """Loads only the keys in ``loadable``; a job with others fails naming what it loaded."""

    def __init__(self, loadable: set[bytes]) -> None:
        super().__init__("partial")
        self.loadable = loadable

    def submit_load(self, job: JobMetadata) -> None:
        done = tuple(k for k in job.keys if k in self.loadable)
        if len(done) == len(job.keys):
            super().submit_load(job)
        else:
            self._finished.append(JobResult(job.job_id, False, done or None))


@pytest.mark.parametrize(("loadable", "kept"), [({0, 2}, [0, 2]), (set(), []), ({0, 1, 2}, [0, 1, 2])])
def test_a_partly_failed_promotion_keeps_the_blocks_that_were_loaded(loadable: set[int], kept: list[int]) -> None:
    """vLLM's JobResult.successful_keys: a failed load job's keys that were loaded stay in the
    primary (HITs); the others are freed (MISS)."""
    tier = _PartialLoadTier({K(i) for i in loadable})
    other = ExampleSecondaryTierManager("other")
    m = TieringOffloadingManager(CPUOffloadingManager(4), [tier, other])
    for i in range(3):
        tier.store[K(i)] = None
    ctx = ReqContext("a")
    assert [m.lookup(K(i), ctx) for i in range(3)] == [LookupResult.RETRY] * 3  # promotions queued
    m.on_schedule_end()  # one load job of 3 keys
    m.on_schedule_end()  # its result
    assert [i for i in range(3) if m.primary.lookup(K(i), ctx) is LookupResult.HIT] == kept
    assert [i for i in range(3) if m.primary.lookup(K(i), ctx) is LookupResult.MISS] == [
        i for i in range(3) if i not in kept]
    assert sorted(other.store) == [K(i) for i in kept]  # what was kept cascades to the other tier
    s = m.stats()
    assert (s["promotions_failed"], s["promotions_partial"]) == (int(len(kept) < 3), int(0 < len(kept) < 3))
