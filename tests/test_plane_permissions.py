"""Who may publish on a pod's subject is enforced by nats-server itself: a real server started
with the plane's users and per-subject permissions (kvevents.transport.nats.permissions). The
bridge, replicas and a reader do their whole job under them; a replica, or a bridge for other
pods, cannot put a message on a pod's subject, nor touch another replica's cover."""

from __future__ import annotations

import asyncio

import nats
import pytest

from kvevents import ZmqEventPublisher, encode_batch
from kvevents.transport.nats.bridge import Bridge, EngineSpec
from kvevents.transport.nats.permissions import auth_config, permissions
from kvevents.transport.nats.wire import plane_headers, subject_for
from kvservice.replica import Replica
from tests.plane_helpers import NATS_SERVER, NatsServer, forge, read_all, stream_state, wait_for
from tests.plane_ledger import LedgerRouter
from tests.pubsub_helpers import batch, ipc_pair

USERS = [
    {"user": "admin", "password": "pw-admin", "role": "admin"},
    {"user": "bridge-1", "password": "pw-b1", "role": "bridge", "pods": [("m", "pod-a")]},
    {"user": "bridge-2", "password": "pw-b2", "role": "bridge", "pods": [("m", "pod-b")]},
    {"user": "replica-a", "password": "pw-ra", "role": "replica", "name": "a"},
    {"user": "replica-b", "password": "pw-rb", "role": "replica", "name": "b"},
    {"user": "reader", "password": "pw-rd", "role": "reader", "name": "check"},
]


@pytest.fixture
def secured(tmp_path):
    if NATS_SERVER is None:
        pytest.fail("nats-server not found: install Debian's nats-server")
    srv = NatsServer(tmp_path / "js", users=USERS)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def _violations(srv: NatsServer) -> list[str]:
    return [line for line in srv.log.read_text().splitlines() if "Publish Violation" in line]


def _refused(srv: NatsServer, user: str, subject: str, body: bytes = b"x", headers=None) -> None:
    """``user`` tries to publish: the server refuses it (its log says so) and the stream stays as it was."""
    before = stream_state(srv.url_as("admin"))
    seen = len(_violations(srv))
    with pytest.raises(nats.errors.TimeoutError):  # nothing stored it, so no acknowledgement comes
        forge(srv.url_as(user), subject, headers, body, timeout=1)
    wait_for(lambda: len(_violations(srv)) > seen, f"the server's refusal of {user} on {subject}")
    assert f'"{subject}"' in _violations(srv)[-1] or subject in _violations(srv)[-1]
    assert stream_state(srv.url_as("admin")) == before


def test_the_plane_works_under_permissions_and_nobody_else_writes_a_pods_subject(secured) -> None:
    pub_ep, rep_ep = ipc_pair()
    batches = [batch(i, 2) for i in range(30)]
    with ZmqEventPublisher(endpoint=pub_ep, replay_endpoint=rep_ep, topic="kv@pod-a@m") as pub, \
            Bridge(secured.url_as("bridge-1"), [EngineSpec("pod-a", pub_ep, rep_ep, "m")], pack=4) as bridge:
        for b in batches:
            pub.publish(b)
        wait_for(lambda: bridge.stats["batches"] >= 30, "30 batches bridged", pump=lambda: bridge.poll(20))
        assert bridge.sender.flush(10)
        assert bridge.sender.stats["ack_failures"] == 0

    a = Replica(secured.url_as("replica-a"), "a", router_factory=LedgerRouter, snapshot_every=0.05, heartbeat=0.05,
                ttl=3)
    try:
        last = stream_state(secured.url_as("admin"))[1]
        wait_for(lambda: a.covered >= last and a.counters["purged"] > 0, "replica a covers the stream and purges",
                 pump=lambda: a.step(10))
        assert a.counters["snapshot_errors"] == a.counters["cover_errors"] == a.counters["purge_errors"] == 0
        b = Replica(secured.url_as("replica-b"), "b", router_factory=LedgerRouter, purge=False)
        try:  # a warm start from a's snapshot, read under b's own permissions
            assert b.counters["restored_seq"] == a.covered and b.router.ledger == a.router.ledger
        finally:
            b.close()

        head = plane_headers("batch", "pod-a", "kv@pod-a@m", 0, 30, 0, model="m")
        pod_a = subject_for("kvevents", "m", "pod-a")
        _refused(secured, "replica-a", pod_a, b"forged", head)  # a replica writes no pod's subject
        _refused(secured, "bridge-2", pod_a, b"forged", head)  # nor a bridge another bridge's pods
        _refused(secured, "reader", pod_a, b"forged", head)
        _refused(secured, "replica-b", "$KV.kvrouter-replicas.cover.a", b'{"seq": 0}')  # nor another's cover
    finally:
        a.close()

    got, stats = read_all(secured.url_as("reader"), durable="check")
    assert [d.payload for d in got] == [encode_batch(b) for b in batches][-len(got):]  # (a purged the front)
    assert stats["rejected"] == stats["malformed"] == 0


def test_a_role_without_what_it_needs_is_a_clear_error() -> None:
    from kvevents.errors import ConfigError
    with pytest.raises(ConfigError, match=r"\(model, pod\) pairs"):
        permissions("bridge")
    with pytest.raises(ConfigError, match="name"):
        permissions("replica")
    with pytest.raises(ConfigError, match="unknown event-plane role"):
        auth_config([{"user": "x", "password": "y", "role": "root"}])
    rules = permissions("bridge", pods=[("m", "pod.1")])
    assert "kvevents.m.pod_1" in rules["publish"]["allow"] and not any(
        s.startswith("kvevents.") and s != "kvevents.m.pod_1" for s in rules["publish"]["allow"])
    assert not any(s.startswith("kvevents.") for s in permissions("replica", name="a")["publish"]["allow"])


def test_a_client_without_credentials_is_turned_away(secured) -> None:
    async def go():
        await nats.connect(secured.url, allow_reconnect=False, connect_timeout=2, max_reconnect_attempts=0)
    with pytest.raises(Exception):
        asyncio.run(go())
