"""The JetStream source's per-pod order checks on packed messages, against a real nats-server:
a packed message whose batches all lie past the pod's last seq is delivered whole (the fast
path); one that overlaps what was delivered has its old batches counted as duplicates and the
rest delivered; one that jumps with no GAP control message and no stream hole before it cannot
come from the pod's writer (ours put a GAP first): rejected, counted, nothing changes; after the
GAP control message the same batches follow. Nothing delivered twice, nothing lost without a
GAP."""

from __future__ import annotations

from kvevents import DeliveryKind
from kvevents.transport.nats.sender import PlaneSender
from kvevents.transport.nats.source import JetStreamSource
from kvevents.transport.nats.wire import COUNT, StreamSpec, pack_parts, plane_headers, subject_for
from tests.plane_helpers import nats_server, wait_for  # noqa: F401

BATCH, GAP = DeliveryKind.BATCH, DeliveryKind.GAP
SPEC = StreamSpec()


def _gap(pod: str, first: int, missed: int, run: int = 0):
    return subject_for(SPEC.prefix, "m", pod), b"", plane_headers("gap", pod, f"kv@{pod}@m", 0, first, run, missed)


def _packed(pod: str, first: int, count: int, run: int = 0):
    h = plane_headers("batch", pod, f"kv@{pod}@m", 0, first, run)
    bodies = [b"p%d-%d" % (run, s) for s in range(first, first + count)]
    if count > 1:
        h[COUNT] = str(count)
        return subject_for(SPEC.prefix, "m", pod), pack_parts(bodies), h
    return subject_for(SPEC.prefix, "m", pod), bodies[0], h


def test_packed_messages_overlapping_or_jumping_are_checked_batch_by_batch(nats_server) -> None:
    sender = PlaneSender(nats_server.url, SPEC, window=64)
    try:
        # A: 0-3, then 2-5 (2 and 3 again), then 8-9 and 9 (jumps: rejected), then the GAP control
        # message for 6-7, then 8-9 (now they follow), then 9 alone again; B: 0-1 interleaved, then 1-2
        sender.put_many([_packed("A", 0, 4), _packed("B", 0, 2), _packed("A", 2, 4), _packed("A", 8, 2),
                         _packed("B", 1, 2), _packed("A", 9, 1), _gap("A", 6, 2), _packed("A", 8, 2),
                         _packed("A", 9, 1)])
        assert sender.flush(30)
    finally:
        sender.close()
    with JetStreamSource(nats_server.url, durable="order", stream=SPEC) as src:
        got: list = []
        wait_for(lambda: src.position >= 9, "reading the nine messages", pump=lambda: got.extend(src.poll(50)))
        stats = src.stats()
        health = src.health()
    a = [(d.kind, d.seq, d.payload, d.missed) for d in got if d.publisher == "A"]
    assert a == [(BATCH, s, b"p0-%d" % s, 0) for s in range(6)] + [(GAP, 6, None, 2)] + \
        [(BATCH, s, b"p0-%d" % s, 0) for s in (8, 9)]
    b = [(d.kind, d.seq, d.payload) for d in got if d.publisher == "B"]
    assert b == [(BATCH, s, b"p0-%d" % s) for s in range(3)]
    assert all(d.topic == f"kv@{d.publisher}@m" for d in got)
    assert stats["duplicates"] == 2 + 1 + 1  # A 2, 3; A 9; B 1
    assert stats["rejected"] == stats["rejected_seq"] == 2 and health["A"].malformed == {"rejected-seq": 2}
    assert stats["stream_gaps"] == 0 and stats["malformed"] == 0
    assert health["A"].last_seq == 9 and health["A"].gaps == 1 and health["A"].unrecoverable == 2
    assert health["B"].last_seq == 2 and health["B"].gaps == 0
