"""Pods are bounded and can be pinned (issue 10 item 10): the pod comes from the topic, so one
publisher cycling ``kv@pod-N@m`` used to create a pod per topic (50k pods took score() from
0.2 ms to 554 ms). Now at most ``max_pods`` are held, a pinned publisher cannot claim other
pods, no publisher can claim a pinned pod, and every refusal is counted."""

from __future__ import annotations

import pytest

from consumers import KVRouter, PodRefused, RouterConfig
from kvevents import encode_batch
from kvevents.delivery import Delivery, DeliveryKind
from kvevents.errors import ConfigError

from .router_helpers import batch, gpu, toks


def _store(h: int):
    return batch(gpu([h], None, toks(h)))


def test_a_publisher_cycling_topics_creates_at_most_max_pods():
    r = KVRouter(RouterConfig(model="m", max_pods=8))
    for n in range(300):
        r.handle(Delivery(DeliveryKind.BATCH, "tcp://attacker", f"kv@pod-{n}@m", n, _store(n)))
    assert len(r.pods()) == 8 and r.pods() == sorted(f"pod-{n}" for n in range(8))
    c = r.counters()
    assert c["pods"] == 8 and c["pods_refused"] == 292 and c["errors"]["too_many_pods"] == 292
    assert c["batches"] == 8 and r.entries() == 8  # a refused batch applied nothing
    assert len(r.score(toks(0))) == 8


def test_the_default_bounds_pods_too_and_raw_payloads_are_refused_alike():
    r = KVRouter(RouterConfig(model="m"))
    limit = r.config.max_pods
    for n in range(limit + 50):
        r.handle(Delivery(DeliveryKind.BATCH, "tcp://x", f"kv@p{n}@m", n, None, payload=encode_batch(_store(n))))
    assert len(r.pods()) == limit and r.counters()["pods_refused"] == 50


def test_apply_refuses_one_pod_too_many_with_a_typed_error_and_a_count():
    r = KVRouter(RouterConfig(model="m", max_pods=1))
    r.apply("a", _store(1))
    with pytest.raises(PodRefused, match="max_pods=1"):
        r.apply("b", _store(2))
    r.remove_pod("a")  # room again
    r.apply("b", _store(2))
    assert r.pods() == ["b"] and r.stats.pods_refused == 1


def test_pinned_publishers_keep_their_pod_and_nobody_claims_a_pinned_pod():
    r = KVRouter(RouterConfig(model="m", publisher_pods={"tcp://a": "pod-a"}))
    # the pinned publisher's topic names another pod: its batch still goes to its own pod
    r.handle(Delivery(DeliveryKind.BATCH, "tcp://a", "kv@pod-b@m", 0, _store(1)))
    assert r.pods() == ["pod-a"]
    # another publisher's topic claims the pinned pod: refused, counted, nothing applied
    r.handle(Delivery(DeliveryKind.BATCH, "tcp://evil", "kv@pod-a@m", 0, _store(2)))
    r.handle(Delivery(DeliveryKind.RESET, "tcp://evil", "kv@pod-a@m", 0))
    assert r.pods() == ["pod-a"] and r.entries() == 1 and r.stats.resets == 0
    assert r.counters()["pods_refused"] == 2 and r.stats.errors["pod_claim_refused"] == 2
    # an unpinned publisher with a pod of its own is fine
    r.handle(Delivery(DeliveryKind.BATCH, "tcp://c", "kv@pod-c@m", 0, _store(3)))
    assert r.pods() == ["pod-a", "pod-c"]


def test_pinned_only_refuses_every_unpinned_publisher():
    r = KVRouter(RouterConfig(model="m", publisher_pods={"tcp://a": "pod-a"}, pinned_only=True))
    r.handle(Delivery(DeliveryKind.BATCH, "tcp://b", "kv@pod-b@m", 0, _store(1)))
    r.handle(Delivery(DeliveryKind.BATCH, "tcp://a", "kv@pod-a@m", 0, _store(2)))
    assert r.pods() == ["pod-a"] and r.stats.errors["unpinned_publisher"] == 1


def test_max_pods_is_checked():
    with pytest.raises(ConfigError, match="max_pods"):
        RouterConfig(max_pods=0)
