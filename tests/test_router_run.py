"""KVRouter driven by deliveries (fake subscriber) and by the vLLM 0.33 capture."""

from __future__ import annotations

import json

import pytest

from consumers import KVRouter, RouterConfig
from kvevents import decode_batch
from kvevents.delivery import Delivery, DeliveryKind, HealthState, PublisherHealth

from .router_helpers import batch, gpu, off, rm, toks

TOPIC_A = "kv@pod-a@demo"
TOPIC_B = "kv@pod-b@demo"


class FakeSubscriber:
    def __init__(self, deliveries, states=None):
        self._d = list(deliveries)
        self.states = states or {}
        self.health_calls = 0

    def __iter__(self):
        return iter(self._d)

    def health(self):
        self.health_calls += 1
        return {p: PublisherHealth(p, state=s) for p, s in self.states.items()}


def d_batch(pub, topic, seq, b):
    return Delivery(DeliveryKind.BATCH, pub, topic, seq, b)


def test_run_batches_resets_gaps_and_health():
    deliveries = [
        d_batch("tcp://a", TOPIC_A, 0, batch(gpu([1, 2], None, toks(0, 2)))),
        d_batch("tcp://b", TOPIC_B, 0, batch(gpu([1, 2, 3], None, toks(0, 3)))),
        d_batch("tcp://b", TOPIC_B, 1, batch(off([1, 2, 3], "CPU"), rm([3], "GPU"))),
    ]
    sub = FakeSubscriber(deliveries, {"tcp://a": HealthState.SYNCED, "tcp://b": HealthState.RECOVERING})
    r = KVRouter(RouterConfig(health_every=2))
    assert r.run(sub) == 3
    assert sub.health_calls >= 2
    s = r.score(toks(0, 3))
    assert s["pod-a"].matched_tokens == 32 and s["pod-a"].state == "SYNCED"
    assert s["pod-b"].tokens_by_tier == {"GPU": 32, "CPU": 16}
    assert s["pod-b"].state == "RECOVERING" and s["pod-b"].factor == 0.5
    assert s["pod-b"].total == pytest.approx(0.5 * (32 + 16 * 0.8) / 48)
    # STALE is excluded by default
    sub.states["tcp://b"] = HealthState.STALE
    r.refresh_health(sub)
    assert set(r.score(toks(0, 3))) == {"pod-a"}
    sub.states["tcp://b"] = HealthState.SYNCED
    r.refresh_health(sub)
    assert r.score(toks(0, 3))["pod-b"].state == "SYNCED"

    # a gap makes pod-a unreliable (routed, discounted); its publisher restarting (RESET) clears and resyncs it
    r.run(FakeSubscriber([Delivery(DeliveryKind.GAP, "tcp://a", TOPIC_A, 5, missed=3)]))
    assert r.score(toks(0, 3))["pod-a"].state == "UNRELIABLE" and r.stats.gaps == 1
    r.run(FakeSubscriber([Delivery(DeliveryKind.RESET, "tcp://a", TOPIC_A, 0),
                          d_batch("tcp://a", TOPIC_A, 0, batch(gpu([7], None, toks(0))))]))
    s = r.score(toks(0, 3))["pod-a"]
    assert s.state == "SYNCED" and s.matched_tokens == 16 and r.stats.resets == 1


def test_run_publisher_mapping_and_plain_iterables():
    r = KVRouter(RouterConfig(model="demo", publisher_pods={"tcp://x": "pod-x"}))
    n = r.run(iter([d_batch("tcp://x", "", 0, batch(gpu([1], None, toks(0)))),
                    d_batch("tcp://y", "other-topic", 0, batch(gpu([1], None, toks(0)))),
                    Delivery(DeliveryKind.BATCH, "tcp://y", "", 1, None)]))
    assert n == 3
    assert r.pods() == ["pod-x", "tcp://y"]
    assert r.stats.errors == {"empty_delivery": 1}


def test_raw_deliveries_are_applied_from_their_payloads_and_malformed_ones_mark_the_pod():
    from kvevents import encode_batch

    b0 = batch(gpu([1, 2], None, toks(0, 2)))
    b1 = batch(off([1, 2], "CPU"), rm([2], "GPU"))
    decoded, raw = KVRouter(RouterConfig()), KVRouter(RouterConfig())
    decoded.run(FakeSubscriber([d_batch("tcp://a", TOPIC_A, 0, b0), d_batch("tcp://a", TOPIC_A, 1, b1)]))
    raw.run(FakeSubscriber([Delivery(DeliveryKind.BATCH, "tcp://a", TOPIC_A, i, None, payload=encode_batch(b))
                            for i, b in enumerate((b0, b1))]))
    assert {p: s.tokens_by_tier for p, s in raw.score(toks(0, 2)).items()} == \
        {p: s.tokens_by_tier for p, s in decoded.score(toks(0, 2)).items()} == {"pod-a": {"GPU": 16, "CPU": 16}}
    assert raw.stats.as_dict() == decoded.stats.as_dict()
    raw.run(FakeSubscriber([Delivery(DeliveryKind.BATCH, "tcp://a", TOPIC_A, 2, None, payload=b"\x93\xc1")]))
    assert raw.stats.errors == {"malformed_payload": 1} and raw.stats.gaps == 1
    s = raw.score(toks(0, 2))["pod-a"]  # routed still, its score discounted while it re-learns
    assert s.state == "UNRELIABLE" and s.factor == 0.5 and raw.explain(toks(0, 2))["pod-a"][0].state == "UNRELIABLE"


def test_run_stops_on_event():
    import threading

    stop = threading.Event()
    stop.set()
    r = KVRouter(model="demo")
    ds = [d_batch("p", "", i, batch()) for i in range(5)]
    assert r.run(ds, stop=stop) == 1


def _capture(conformance_dir):
    pub, replay = [], []
    for line in (conformance_dir / "vllm-0.33.0-live-pub-replay.jsonl").read_text().splitlines():
        o = json.loads(line)
        frames = [bytes.fromhex(f) for f in o["frames"]]
        if o["socket"] == "pub":
            pub.append((frames[0].decode(), int.from_bytes(frames[1], "big"), decode_batch(frames[2])))
        elif len(frames) == 4 and frames[3]:
            replay.append((frames[1].decode(), int.from_bytes(frames[2], "big"), decode_batch(frames[3])))
    return pub, replay


def test_vllm_capture_through_the_router(conformance_dir):
    pub, replay = _capture(conformance_dir)
    assert len(pub) == 30 and len(replay) == 10
    r = KVRouter()
    r.run(FakeSubscriber([d_batch("vllm", t, seq, b) for t, seq, b in pub]))
    assert r.pods() == ["pod-a"]
    c = r.counters()
    assert c["blocks_stored"] == 120 and c["offload_blocks"] == 12 and c["blocks_removed"] == 12
    assert c["orphan_blocks"] == 0 and c["pending"] == 0 and c["errors"] == {}
    # every batch stores 4 blocks of tokens 0..63 chained on the last; batch 4 removes its blocks
    # 2 and 3 from GPU (their first two went to CPU as well), so the prefix ends at block 18
    prompt = list(range(64)) * 30
    s = r.score(prompt)["pod-a"]
    assert s.tokens_by_tier == {"GPU": 288} and s.matched_tokens == 288
    assert s.total == pytest.approx(288 / len(prompt))
    ex = r.explain(prompt)["pod-a"][0]
    assert ex.ended_at_block == 18 and "block 18" in ex.reason
    # a prompt that leaves the cached prefix after 100 tokens matches 6 full blocks
    assert r.score(list(range(64)) + list(range(36)) + [99999] * 60)["pod-a"].matched_tokens == 96
    assert r.pick(prompt) == "pod-a"
    # the CPU copies are there: once GPU evicts blocks 16 and 17 as well, CPU continues
    r.apply("pod-a", pub[4][2].__class__(ts=0.0, events=[rm([4000, 4001], "GPU")]))
    s = r.score(prompt)["pod-a"]
    assert s.tokens_by_tier == {"GPU": 256, "CPU": 32}
    # replaying the replayed tail again is idempotent for presence
    before = r.entries()
    for _t, _seq, b in replay:
        r.apply("pod-a", b, model="demo-model")
    assert r.entries() == before


def test_run_reads_health_while_a_pod_is_silent() -> None:
    """With a polling subscriber, a pod that goes STALE is excluded without any delivery arriving."""
    import threading

    from consumers import KVRouter
    from kvevents.delivery import Delivery, DeliveryKind, HealthState, PublisherHealth
    from tests.router_helpers import batch, gpu, toks

    router = KVRouter()
    stop = threading.Event()
    state = {"p": HealthState.SYNCED}
    tokens = toks(0, 2)

    class FakeSub:
        def __init__(self) -> None:
            self.pending = [Delivery(DeliveryKind.BATCH, "p", "kv@pod-a@m", 0, batch(gpu([11, 12], None, tokens)), 0.0)]
            self.polls = 0

        def poll(self, timeout_ms: int):
            self.polls += 1
            out, self.pending = self.pending, []
            if self.polls == 3:
                state["p"] = HealthState.STALE  # silent from now on
            if self.polls == 2:
                assert router.score(tokens, model="m")["pod-a"].total > 0
            if self.polls >= 3 and not any(sc.total > 0 for sc in router.score(tokens, model="m").values()):
                stop.set()
            if self.polls > 10_000:
                stop.set()
            return out

        def health(self):
            return {"p": PublisherHealth("p", state=state["p"])}

    sub = FakeSub()
    assert router.run(sub, stop=stop, health_interval=0.0) == 1
    assert sub.polls < 10_000, "the STALE pod was never excluded"


def test_feed_run_hooks_step_health_round_pace_and_errors(monkeypatch) -> None:
    """The one loop a service runs too: its own step per delivery and health round, a paced
    trickle, and an exception handed to ``on_error`` (the loop goes on) or, without it, raised."""
    import types

    from consumers import feed

    sleeps: list[float] = []
    monkeypatch.setattr(feed, "time", types.SimpleNamespace(monotonic=lambda: 100.0, sleep=sleeps.append))
    events: list = []

    class Polled:  # polls of these many deliveries, then it ends
        def __init__(self, script) -> None:
            self.script, self.ended = list(script), False

        def poll(self, timeout_ms: int):
            assert timeout_ms == feed.POLL_MS
            n = self.script.pop(0)
            self.ended = not self.script
            return [d_batch("p", "", i, batch()) for i in range(n)]

    def take(d) -> None:
        if d.seq == 1 and 1 not in events:
            events.append(1)
            raise RuntimeError("one bad step")
        events.append(d.seq)

    r = KVRouter(model="m")
    errors: list = []
    n = feed.run(r, Polled([3, feed.PACE_BELOW, 2, 0]), health_interval=60.0, take=take,
                 health_round=lambda: events.append("health"), pace=0.004, on_error=errors.append)
    assert n == 3 + feed.PACE_BELOW + 2
    # the 1st poll's round ended where its step raised (seq 1: seq 2 not taken, no health round);
    # the health round after the 2nd poll, none until the end; one pause: after the trickle of 2
    # (not after the backlog, the health round or the empty poll)
    assert events == [0, 1] + list(range(feed.PACE_BELOW)) + ["health", 0, 1, "health"]
    assert [str(e) for e in errors] == ["one bad step"] and sleeps == [pytest.approx(0.004)]
    assert r.pods() == [], "the router was fed only through the step given"
    events.clear()
    with pytest.raises(RuntimeError, match="one bad step"):
        feed.run(r, Polled([2]), take=take)
