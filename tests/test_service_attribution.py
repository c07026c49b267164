"""The service's ingest is thin (issue 25): its source comes from ``open_source``, the router is
told once which pod (and model) each publisher is, no delivery's topic is rewritten, and a batch
the router could not index is found from that delivery's own outcome."""

from __future__ import annotations

import logging

from consumers import feed
from kvevents import Delivery, DeliveryKind, Subscriber
from kvservice.config import from_dict
from kvservice.ingest import Fleet

from .router_helpers import batch, gpu, toks
from .service_helpers import MODEL


def _store(h: int):
    return batch(gpu([h], None, toks(h)))


def test_a_configured_pod_on_vllms_default_topic_is_indexed_and_its_topic_left_alone(tmp_path):
    cfg = from_dict({"router": {"model": MODEL}, "subscriber": {"late_join": False},
                     "pods": [{"name": "a", "endpoint": f"ipc://{tmp_path}/a.pub", "model": "llama"},
                              {"name": "b", "endpoint": "tcp://127.0.0.1:1", "data_parallel_size": 2}]}).validate()
    fleet = Fleet(cfg)
    try:
        assert isinstance(fleet.sub, Subscriber)  # tcp:// and ipc:// pods in one subscriber
        assert fleet.router.endpoints.attributed == {"a": ("a", "llama"), "b": ("b", MODEL), "b#dp1": ("b", MODEL)}
        d = Delivery(DeliveryKind.BATCH, "a", "", 0, _store(1))
        fleet.take(d)
        assert d.topic == ""  # (the old service rewrote it to kv@a@llama for the feed to parse)
        assert fleet.router.score(toks(1), model="llama")["a"].matched_tokens == 16
        d = Delivery(DeliveryKind.BATCH, "b#dp1", "kv@evil@other", 0, batch(gpu([2], None, toks(2)), rank=1))
        fleet.take(d)
        assert d.topic == "kv@evil@other" and fleet.router.pods() == ["a", "b"]
        assert fleet.unattributed == {} and fleet.router.stats.errors == {}
    finally:
        fleet.stop()


def test_bind_mode_tells_the_router_a_new_publisher_once_and_keeps_the_pins(tmp_path, caplog):
    cfg = from_dict({"router": {"model": MODEL}, "subscriber": {"bind": f"ipc://{tmp_path}/in", "late_join": False},
                     "pods": [{"name": "named", "topic": "kv-named"}]}).validate()
    caplog.set_level(logging.INFO, logger="kvservice")
    fleet = Fleet(cfg)
    try:
        for seq in range(3):
            d = Delivery(DeliveryKind.BATCH, "kv@x@llama", "kv@x@llama", seq, _store(seq + 1))
            fleet.take(d)
            assert d.topic == "kv@x@llama"
        assert fleet.router.endpoints.attributed["kv@x@llama"] == ("x", "llama")
        assert fleet.router.endpoints.pod_model["x"] == "llama" and fleet.pods["x"].publishers == ["kv@x@llama"]
        told = [r for r in caplog.records if "attributed to pod" in r.getMessage()]
        assert len(told) == 1 and "'x', model 'llama'" in told[0].getMessage()
        # a publisher whose topic claims the configured pod (pinned to its own topic): refused and
        # counted per batch by the router, never attributed
        for seq in range(2):
            fleet.take(Delivery(DeliveryKind.BATCH, "named", "named", seq, _store(10 + seq)))
        assert fleet.router.stats.errors == {"pod_claim_refused": 2} and "named" not in fleet.router.endpoints.attributed
        assert fleet.pods["named"].publishers == ["kv-named"] and fleet.router.pods() == ["named", "x"]
    finally:
        fleet.stop()


class _Says:
    """A feed that reports an outcome and moves no counter (the router's ``feed`` slot, the one
    telemetry wraps)."""

    def __init__(self, outcome: str) -> None:
        self.outcome = outcome

    def handle(self, router, delivery) -> str:
        return self.outcome


def test_a_batch_the_router_could_not_index_is_found_from_its_outcome(tmp_path):
    cfg = from_dict({"router": {"model": MODEL}, "subscriber": {"late_join": False},
                     "pods": [{"name": "a", "endpoint": f"ipc://{tmp_path}/a.pub"}]}).validate()
    fleet = Fleet(cfg)
    try:
        fleet.router.feed = _Says(feed.BAD)
        fleet.take(Delivery(DeliveryKind.BATCH, "a", "", 0, _store(1)))
        fleet.take(Delivery(DeliveryKind.BATCH, "a", "", 1, _store(2)))
        u = fleet.unattributed["a"]
        assert u.batches == 2 and "could not index pod 'a'" in u.reason
        fleet.router.feed = _Says(feed.APPLIED)
        fleet.take(Delivery(DeliveryKind.BATCH, "a", "", 2, _store(3)))
        assert fleet.unattributed["a"].batches == 2
    finally:
        fleet.stop()


def test_the_event_source_is_what_the_config_says():
    plane = from_dict({"subscriber": {"event_plane": "tls://127.0.0.1:4222", "replica_name": "r1"},
                       "pods": [{"name": "a", "model": MODEL}]})
    assert plane.event_source() == (["tls://127.0.0.1:4222"], {"kind": "nats", "durable": "r1", "stale_after": 10.0})
    bind = from_dict({"router": {"model": MODEL}, "subscriber": {"bind": "tcp://127.0.0.1:5557"},
                      "pods": [{"name": "a", "topic": "t", "replay_endpoint": "tcp://10.0.0.5:5558"}]})
    urls, opts = bind.event_source()
    assert urls == ["tcp://127.0.0.1:5557"] and opts["bind"] is True and opts["replay_endpoints"] == {"t": "tcp://10.0.0.5:5558"}
