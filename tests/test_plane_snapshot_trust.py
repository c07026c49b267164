"""A replica restores only a snapshot of the stream it reads, with positions it can check
(finding 6 of issue 24), against a real nats-server: the stream's identity and every position
live inside the snapshot's checksummed body; another stream, another config or damaged
positions make it cold-start and say why (counter, log, ``status()['cold_start_reason']``)."""

from __future__ import annotations

import json

import pytest

from kvservice.planestore import SnapshotRefused, open_envelope, seal, stream_identity
from kvservice.replica import Replica
from tests.plane_helpers import nats_server, on_jetstream, wait_for  # noqa: F401
from tests.plane_ledger import LedgerRouter
from tests.pubsub_helpers import batch
from tests.test_plane_replica import _publish, _publisher

IDENT = stream_identity("KVEVENTS", ["kvevents.>"], "2026-11-27 10:00:00+00:00")


def _replica(url: str, name: str, **kw) -> Replica:
    return Replica(url, name, router_factory=LedgerRouter, snapshot_every=0.05, heartbeat=0.05, ttl=3, purge=False,
                   **kw)


def _read_to_end(rep: Replica, last: int) -> None:
    wait_for(lambda: rep.source.acked >= last, f"replica {rep.name} at stream seq {last}", pump=lambda: rep.step(10))


def _saved(url: str, upto: int) -> None:
    a = _replica(url, "a")
    try:
        wait_for(lambda: a.covered >= upto, "a snapshot saved", pump=lambda: a.step(10))
    finally:
        a.close()


def _reference(url: str, last: int) -> LedgerRouter:
    """The index a replica must serve: a cold read of the whole stream."""
    ref = _replica(url, "ref")
    try:
        assert ref.counters["cold_starts"] == 0 or ref.cold_start_reason
        _read_to_end(ref, last)
        return ref.router
    finally:
        ref.close()


def test_a_stream_deleted_and_recreated_is_not_served_from_the_old_snapshot(nats_server, caplog) -> None:
    url = nats_server.url
    _publish(url, "pod-1", 0, 40)
    _saved(url, 40)
    on_jetstream(url, lambda js: js.delete_stream("KVEVENTS"))  # the snapshot bucket stays
    _publish(url, "pod-2", 1000, 60)  # a new stream, seqs 1..60 again
    b = _replica(url, "b")
    try:
        assert b.counters["snapshots_refused"] == b.counters["refused_another_stream"] == 1
        assert b.counters["cold_starts"] == 1 and b.counters["restored_seq"] == 0
        assert "another-stream" in b.status()["cold_start_reason"]
        assert any("another-stream" in r.message for r in caplog.records)
        _read_to_end(b, 60)
        assert b.router.ledger.keys() == {"kv@pod-2@m"} and len(b.router.ledger["kv@pod-2@m"]) == 60
        assert b.router.ledger == _reference(url, 60).ledger
    finally:
        b.close()


def test_damaged_positions_in_the_description_are_not_trusted(nats_server) -> None:
    url = nats_server.url
    pub = _publisher(url, "pod-1")  # one engine run throughout
    try:
        for i in range(50):
            pub.publish(batch(i, 2))
        assert pub.sender.flush(30)
        _saved(url, 50)

        async def damage(js):  # the object's description claims pod-1 is 183 batches further on
            from nats.js import api
            obs = await js.object_store("kvrouter-snapshots")
            data = (await obs.get("a")).data
            desc = {"stream_seq": 50, "pods": {"kv@pod-1@m": [0, 49 + 183, "kv@pod-1@m"]}}
            await obs.put("a", data, meta=api.ObjectMeta(name="a", description=json.dumps(desc)))
        on_jetstream(url, damage)
        for i in range(50, 250):
            pub.publish(batch(i, 2))
        assert pub.sender.flush(30) and pub.counts["overflow"] == 0
    finally:
        pub.shutdown(10)
    c = _replica(url, "c")
    try:
        assert c.counters["restored_seq"] == 50 and c.cold_start_reason is None
        _read_to_end(c, 250)
        assert c.source.stats()["duplicates"] == 0
        assert len(c.router.ledger["kv@pod-1@m"]) == 250
        assert c.router.ledger == _reference(url, 250).ledger
    finally:
        c.close()


def test_a_damaged_body_is_refused_and_the_replica_cold_starts_saying_why(nats_server) -> None:
    url = nats_server.url
    _publish(url, "pod-1", 0, 50)
    _saved(url, 50)

    async def damage(js):  # a position inside the body changed, same length: only the checksum sees it
        from nats.js import api
        obs = await js.object_store("kvrouter-snapshots")
        data = (await obs.get("a")).data
        assert b'"stream_seq": 50' in data
        await obs.put("a", data.replace(b'"stream_seq": 50', b'"stream_seq": 20'),
                      meta=api.ObjectMeta(name="a", description=json.dumps({"stream_seq": 50})))
    on_jetstream(url, damage)
    c = _replica(url, "c")
    try:
        assert c.counters["refused_checksum"] == 1 and c.counters["cold_starts"] == 1
        assert "checksum" in c.status()["cold_start_reason"]
        _read_to_end(c, 50)
        assert len(c.router.ledger["kv@pod-1@m"]) == 50
    finally:
        c.close()


@pytest.mark.parametrize("identity,last,reason", [
    ({**IDENT, "created": "2026-11-27 11:00:00+00:00"}, 100, "another-stream"),
    ({**IDENT, "stream": "OTHER"}, 100, "another-stream"),
    (stream_identity("KVEVENTS", ["kv2.>"], IDENT["created"]), 100, "another-config"),
    (IDENT, 41, "positions"),  # it covers seq 42: the stream has never reached it
])
def test_the_envelope_names_why_it_does_not_belong(identity, last, reason) -> None:
    sealed = seal(IDENT, 42, {"p": (1, 7, "kv@p@m")}, b"router")
    assert open_envelope(sealed, IDENT, 100) == (b"router", 42, {"p": (1, 7, "kv@p@m")})
    with pytest.raises(SnapshotRefused) as e:
        open_envelope(sealed, identity, last)
    assert e.value.reason == reason
    for bad, why in ((b"router", "format"), (sealed[:-1] + bytes([sealed[-1] ^ 1]), "checksum"),
                     (seal(IDENT, 42, {"p": (-3, 7, "t")}, b""), "positions")):
        with pytest.raises(SnapshotRefused) as e:
            open_envelope(bad, IDENT, 100)
        assert e.value.reason == why
