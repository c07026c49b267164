"""One place attributes a publisher to a pod: ``KVRouter.attribute`` (issue 25), and the feed
says what it did with each delivery (its outcome), so a caller never diffs a counter."""

from __future__ import annotations

import pytest

from consumers import KVRouter, PodRefused, RouterConfig, RouterInputError
from consumers.feed import APPLIED, BAD, EMPTY, MALFORMED, OUTCOMES, REFUSED, UNKNOWN
from kvevents import encode_batch
from kvevents.delivery import Delivery, DeliveryKind

from .router_helpers import batch, gpu, toks


def _store(h: int):
    return batch(gpu([h], None, toks(h)))


def test_handle_returns_what_it_did_with_each_delivery():
    r = KVRouter(RouterConfig(model="m", max_pods=2, publisher_pods={"tcp://a": "a"}))
    B, R, G = DeliveryKind.BATCH, DeliveryKind.RESET, DeliveryKind.GAP
    assert r.handle(Delivery(B, "tcp://a", "", 0, _store(1))) == APPLIED
    assert r.handle(Delivery(B, "tcp://a", "", 1, None, payload=encode_batch(_store(2)))) == APPLIED
    assert r.handle(Delivery(B, "tcp://a", "", 2, None, payload=b"\xc1 not msgpack")) == MALFORMED
    assert r.handle(Delivery(B, "tcp://a", "", 3, None)) == EMPTY
    assert r.handle(Delivery(G, "tcp://a", "", 4, missed=2)) == APPLIED
    assert r.handle(Delivery(R, "tcp://a", "", 0)) == APPLIED
    assert r.handle(Delivery(B, "tcp://evil", "kv@a@m", 0, _store(3))) == REFUSED  # claims a pinned pod
    assert r.handle(Delivery(B, "tcp://b", "kv@b@m", 0, _store(4))) == APPLIED
    assert r.handle(Delivery(B, "tcp://c", "kv@c@m", 0, _store(5))) == REFUSED  # past max_pods
    assert r.handle(Delivery("odd", "tcp://a", "", 0)) == UNKNOWN  # type: ignore[arg-type]
    no_model = KVRouter(RouterConfig())
    assert no_model.handle(Delivery(B, "tcp://x", "", 0, _store(6))) == BAD  # no model anywhere
    assert no_model.stats.errors == {"bad_delivery": 1}
    assert r.stats.errors == {"malformed_payload": 1, "empty_delivery": 1, "pod_claim_refused": 1,
                              "too_many_pods": 1, "unknown_delivery": 1}
    assert {APPLIED, BAD, EMPTY, MALFORMED, REFUSED, UNKNOWN} == OUTCOMES


def test_an_attributed_publisher_goes_to_its_pod_and_model_whatever_its_topic_says():
    r = KVRouter(RouterConfig(model="default"))
    r.attribute("tcp://10.0.0.5:5557", "pod-a", "llama")
    d = Delivery(DeliveryKind.BATCH, "tcp://10.0.0.5:5557", "kv@pod-z@other", 0, _store(1))
    assert r.handle(d) == APPLIED
    assert d.topic == "kv@pod-z@other"  # read, never rewritten
    assert r.pods() == ["pod-a"] and r.endpoints.pod_model == {"pod-a": "llama"}
    assert r.score(toks(1), model="llama")["pod-a"].matched_tokens == 16
    # told no model: the topic's, else the default
    r.attribute("p2", "pod-b")
    r.handle(Delivery(DeliveryKind.BATCH, "p2", "kv@whatever@mistral", 0, _store(2)))
    r.attribute("p3", "pod-c")
    r.handle(Delivery(DeliveryKind.BATCH, "p3", "", 0, _store(3)))
    assert r.endpoints.pod_model == {"pod-a": "llama", "pod-b": "mistral", "pod-c": "default"}


def test_attribution_survives_a_restore():
    r = KVRouter(RouterConfig(model="m"))
    r.attribute("ident", "pod-a", "m")
    r.handle(Delivery(DeliveryKind.BATCH, "ident", "", 0, _store(1)))
    data = r.snapshot()
    r.restore(data)
    r.handle(Delivery(DeliveryKind.BATCH, "ident", "", 1, _store(2)))
    assert r.pods() == ["pod-a"] and r.entries() == 2


def test_attribution_keeps_the_pins():
    r = KVRouter(RouterConfig(model="m", publisher_pods={"tcp://a": "pod-a"}))
    r.attribute("tcp://a", "pod-a", "m")  # its own pod: fine
    with pytest.raises(RouterInputError, match="pinned to pod 'pod-a'"):
        r.attribute("tcp://a", "pod-b", "m")
    with pytest.raises(PodRefused, match="pinned to publisher 'tcp://a'"):
        r.attribute("tcp://evil", "pod-a", "m")  # claims a pinned pod: refused, counted, not kept
    assert r.stats.errors == {"pod_claim_refused": 1} and "tcp://evil" not in r.endpoints.attributed
    strict = KVRouter(RouterConfig(model="m", publisher_pods={"tcp://a": "pod-a"}, pinned_only=True))
    with pytest.raises(PodRefused, match="pinned_only"):
        strict.attribute("tcp://b", "pod-b", "m")
    with pytest.raises(RouterInputError, match="non-empty str"):
        r.attribute("x", "", "m")
