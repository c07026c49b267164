"""``kvevents router --event-plane nats://...``: the service reads the fleet from the JetStream
event plane (a real nats-server) instead of ZeroMQ; pods are learned from the plane's topics."""

from __future__ import annotations

import pytest

from consumers import KVRouter

from kvevents import EventPublisherFactory, KVEventsConfig
from kvevents.errors import ConfigError
from kvservice.config import from_dict
from kvservice.ingest import Fleet
from tests.plane_helpers import nats_server, wait_for  # noqa: F401
from tests.pubsub_helpers import batch


def test_service_reads_the_event_plane(nats_server) -> None:
    pub = EventPublisherFactory.create(KVEventsConfig(enable_kv_cache_events=True, publisher="nats",
                                                      endpoint=nats_server.url, topic="kv@pod-n@m"))
    for i in range(20):
        pub.publish(batch(i))
    assert pub.shutdown(10).clean
    cfg = from_dict({"subscriber": {"event_plane": nats_server.url}}).validate()
    fleet = Fleet(cfg)
    fleet.start()
    try:
        wait_for(lambda: fleet.deliveries >= 20, "20 deliveries from the plane")
        direct = KVRouter()
        for i in range(20):
            direct.apply("pod-n", batch(i), model="m")
        with fleet.lock:
            assert fleet.router.entries() == direct.entries()  # the same index as direct ingest
            assert fleet.router.score(list(range(16)), model="m") == direct.score(list(range(16)), model="m")
        assert [p["name"] for p in fleet.pods_view()["pods"]] == ["pod-n"]
        assert fleet.pods_view()["unattributed"] == []
    finally:
        fleet.stop()


def test_event_plane_and_bind_are_alternatives() -> None:
    with pytest.raises(ConfigError, match="alternatives"):
        from_dict({"subscriber": {"event_plane": "nats://127.0.0.1:4222", "bind": "tcp://127.0.0.1:5557"}}).validate()
    with pytest.raises(ConfigError, match="nats://"):
        from_dict({"subscriber": {"event_plane": "tcp://127.0.0.1:4222"}}).validate()
