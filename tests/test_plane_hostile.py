"""Hostile messages on the event plane, against a real nats-server (no permissions here: what the
source and the bridge check on their own; ``test_plane_permissions.py`` has the server refuse
them first). Each test names the finding of issue 24 it pins; each failed on the code before."""

from __future__ import annotations

from consumers import KVRouter
from kvevents import DeliveryKind, ZmqEventPublisher, encode_batch
from kvevents.transport.nats.bridge import Bridge, EngineSpec
from kvevents.transport.nats.sender import PlaneSender, parse_ack
from kvevents.transport.nats.wire import MSG_ID, StreamSpec, msg_id, plane_headers, subject_for
from tests.plane_helpers import forge, nats_server, read_all, wait_for  # noqa: F401
from tests.pubsub_helpers import batch, ipc_pair

BATCH, GAP = DeliveryKind.BATCH, DeliveryKind.GAP
SUBJECT = subject_for("kvevents", "m", "pod-a")


def _bridged(url: str, attack, n: int = 20, pack: int = 1):
    """Engine pod-a publishes n batches through a bridge; ``attack()`` runs after the first half
    is in the stream and before the second half is published. Returns (deliveries, source stats,
    source health, bridge sender stats, the batches)."""
    pub_ep, rep_ep = ipc_pair()
    batches = [batch(i, 2) for i in range(n)]
    with ZmqEventPublisher(endpoint=pub_ep, replay_endpoint=rep_ep, topic="kv@pod-a@m") as pub, \
            Bridge(url, [EngineSpec("pod-a", pub_ep, rep_ep, "m")], pack=pack) as bridge:
        for i, b in enumerate(batches):
            if i == n // 2:
                wait_for(lambda: bridge.stats["batches"] >= n // 2, "the first half bridged", pump=lambda: bridge.poll(20))
                assert bridge.sender.flush(10)
                attack()
            pub.publish(b)
        wait_for(lambda: bridge.stats["batches"] >= n, "every batch bridged", pump=lambda: bridge.poll(20))
        assert bridge.sender.flush(10)
        sender_stats = dict(bridge.sender.stats)
    with_health: dict = {}
    got, stats = read_all(url, health=with_health)
    return got, stats, with_health, sender_stats, batches


def _batches_of(got, pod="pod-a"):
    return [(d.seq, d.payload) for d in got if d.kind is BATCH and d.publisher == pod]


def _routes(got) -> bool:
    router = KVRouter()
    for d in got:
        router.handle(d)
    return "pod-a" in router.score(list(range(16)), model="m")


def test_a_huge_run_on_a_pods_subject_is_rejected_and_shadows_nothing(nats_server) -> None:
    """Finding 5: a message with a huge Kv-Run made every real batch after it a 'duplicate'."""
    huge = 10 ** 12
    h = plane_headers("batch", "pod-a", "kv@pod-a@m", 0, 10, huge, model="m")  # a well-formed id, even
    got, stats, health, _, batches = _bridged(nats_server.url, lambda: forge(nats_server.url, SUBJECT, h, b"\x93junk"))
    assert _batches_of(got) == [(i, encode_batch(b)) for i, b in enumerate(batches)]
    assert not [d for d in got if d.kind is not BATCH]  # no RESET, no GAP: the pod never moved
    assert stats["rejected"] == stats["rejected_run"] == 1
    assert health["pod-a"].malformed == {"rejected-run": 1} and health["pod-a"].gaps == 0
    assert _routes(got)


def test_a_forgery_under_the_engines_next_id_does_not_displace_the_real_batch(nats_server) -> None:
    """Finding 5: published first under the engine's next Nats-Msg-Id (the id the plane gave
    batch 10), JetStream kept the forgery and dropped the real batch, and no counter moved. Now
    ids carry a nonce (the next one cannot be known), and a message whose id is not the plane's
    for its headers is rejected."""
    h = plane_headers("batch", "pod-a", "kv@pod-a@m", 0, 10, 0, model="m")
    h[MSG_ID] = "pod-a:0:batch:10"  # the engine's next id as it used to be
    acks: list = []
    got, stats, health, sent, batches = _bridged(
        nats_server.url, lambda: acks.append(forge(nats_server.url, SUBJECT, h, b"\x93forged")))
    assert acks[0].get("duplicate") is None  # the forgery was stored...
    assert _batches_of(got) == [(i, encode_batch(b)) for i, b in enumerate(batches)]  # ...and displaced nothing
    assert stats["rejected_id"] == 1 and health["pod-a"].malformed == {"rejected-id": 1}
    assert sent["duplicates"] == sent["not_stored"] == 0
    assert _routes(got)


def test_one_garbage_message_at_a_pods_next_seq_does_not_take_it_out_of_routing(nats_server) -> None:
    """The weakness: garbage at a pod's next seq was applied (undecodable: the pod marked
    unreliable until its engine restarted) and the real batch at that seq dropped as a duplicate."""
    h = {"Kv-Kind": "batch", "Kv-Pod": "pod-a", "Kv-Seq": "10", "Kv-Run": "0", "Kv-Topic": "kv@pod-a@m"}
    got, stats, health, _, batches = _bridged(nats_server.url, lambda: forge(nats_server.url, SUBJECT, h, b"garbage"))
    assert _batches_of(got) == [(i, encode_batch(b)) for i, b in enumerate(batches)]
    assert stats["rejected"] == 1 and health["pod-a"].gaps == 0
    assert _routes(got)


def test_a_message_stored_first_under_our_exact_id_is_found_by_the_ack_and_reported_as_a_gap(nats_server) -> None:
    """Finding 5: whoever stores a message first under a writer's exact id makes JetStream drop
    the writer's message. The writer's acknowledgement says 'duplicate'; the sender reads the
    held message back, sees it is not its own, and puts a GAP (reason forged) for that batch."""
    spec = StreamSpec()
    h = plane_headers("batch", "pod-a", "kv@pod-a@m", 0, 0, 0, model="m")
    sender = PlaneSender(nats_server.url, spec, window=8)  # (creates the stream)
    try:
        assert forge(nats_server.url, SUBJECT, h, b"forged").get("duplicate") is None
        sender.put(SUBJECT, b"real", dict(h))
        sender.put(SUBJECT, b"real-1", plane_headers("batch", "pod-a", "kv@pod-a@m", 0, 1, 0, model="m"))
        wait_for(lambda: sender.stats["forged_reports"] >= 1, "the forgery found by the ack")
        assert sender.flush(10)
        stats = dict(sender.stats)
    finally:
        sender.close()
    assert stats["duplicates"] == stats["not_stored"] == 1 and stats["unverified_duplicates"] == 0
    got, src = read_all(nats_server.url)
    kinds = [(d.kind, d.seq, d.payload, d.reason) for d in got]
    # the forgery came first and followed, so it was delivered; the GAP says batch 0 was not the pod's
    assert kinds == [(BATCH, 0, b"forged", ""), (BATCH, 1, b"real-1", ""), (GAP, 0, None, "forged")]
    assert src["forged_reported"] == 1


def test_the_duplicate_ack_is_read_as_json(nats_server) -> None:
    """Finding 7: nats-server writes ``"duplicate": true`` with a space; the byte match missed it."""
    assert parse_ack(b'{"stream":"KVEVENTS", "seq":3, "duplicate": true}') == \
        {"stream": "KVEVENTS", "seq": 3, "duplicate": True}
    assert parse_ack(b'{"error":{"code":503}}') is None and parse_ack(b"nonsense") is None
    h = plane_headers("batch", "pod-a", "kv@pod-a@m", 0, 0, 0, model="m")
    sender = PlaneSender(nats_server.url, StreamSpec(), window=8)
    try:
        for _ in range(3):  # the same message three times: stored once, two duplicates (our own)
            sender.put(SUBJECT, b"same", dict(h))
            assert sender.flush(10)
        wait_for(lambda: sender.stats["duplicates"] >= 2, "two duplicate acks counted")
        stats = dict(sender.stats)
    finally:
        sender.close()
    assert stats["duplicates"] == 2 and stats["not_stored"] == stats["forged_reports"] == 0
    assert msg_id("p", 0, "batch", 1, "0" * 16) == "p:0:batch:1:" + "0" * 16
