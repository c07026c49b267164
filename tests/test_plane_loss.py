"""Loss in the middle of the stream, against a real nats-server: the stream's own limits drop
messages a slow reader has not read yet. Nothing may be lost silently: every batch a pod
published is either delivered or covered by a GAP for that pod, counted in stats and health."""

from __future__ import annotations

from kvevents import DeliveryKind
from kvevents.transport.nats.sender import PlaneSender
from kvevents.transport.nats.source import JetStreamSource
from kvevents.transport.nats.wire import StreamSpec, plane_headers, subject_for
from tests.plane_helpers import nats_server, stream_state, wait_for  # noqa: F401

BATCH, GAP = DeliveryKind.BATCH, DeliveryKind.GAP
SPEC = StreamSpec(max_msgs=30)  # keeps the newest 30 messages: older ones go while a reader is behind


def _put(sender: PlaneSender, pod: str, seqs) -> None:
    sender.put_many([(subject_for(SPEC.prefix, "m", pod), b"x%d" % s, plane_headers("batch", pod, f"kv@{pod}@m", 0, s, 0))
                     for s in seqs])


def _read_until(src: JetStreamSource, last: int, out: list) -> None:
    wait_for(lambda: src.position >= last and not src.in_doubt, f"reading up to stream seq {last}",
             pump=lambda: out.extend(src.poll(50)))


def _accounted(ds: list, pod: str) -> tuple[set[int], list]:
    """(seqs delivered as batches, the GAP deliveries) of one pod; no seq twice."""
    seqs = [d.seq for d in ds if d.publisher == pod and d.kind is BATCH]
    assert len(seqs) == len(set(seqs)), f"{pod}: a batch delivered twice"
    return set(seqs), [d for d in ds if d.publisher == pod and d.kind is GAP]


def test_messages_dropped_by_the_stream_limits_while_a_reader_is_behind_are_gaps(nats_server) -> None:
    sender = PlaneSender(nats_server.url, SPEC, window=4096)
    try:
        for s in range(10):  # A0 B0 A1 B1 ... : stream seqs 1..20
            _put(sender, "A", [s])
            _put(sender, "B", [s])
        assert sender.flush(30)
        # a slow reader: it holds at most one fetch of 5 ahead of what was polled
        src = JetStreamSource(nats_server.url, durable="slow", stream=SPEC, start_seq=1, fetch_batch=5, max_queued=5)
        out: list = []
        try:
            _read_until(src, 20, out)
            _put(sender, "A", range(10, 20))  # seqs 21..30: at most 5 of them reach the reader's queue
            _put(sender, "B", range(10, 15))  # 31..35: B's last batches, never read, then dropped
            _put(sender, "A", range(20, 70))  # 36..85: the stream keeps 56..85
            assert sender.flush(30)
            assert stream_state(nats_server.url) == (30, 85)
            _read_until(src, 85, out)
            stats, health = src.stats(), src.health()
        finally:
            src.close()
    finally:
        sender.close()

    assert stats["stream_holes"] >= 1
    assert stats["messages"] + stats["stream_lost"] == 85  # every stream seq read or counted lost
    a, a_gaps = _accounted(out, "A")
    assert a_gaps and all(g.missed > 0 and g.reason == "lost" for g in a_gaps)  # A goes on: its gap is exact
    covered = set(a)
    for g in a_gaps:
        covered |= set(range(g.seq, g.seq + g.missed))
    assert covered == set(range(70)) and len(a) + sum(g.missed for g in a_gaps) == 70
    b, b_gaps = _accounted(out, "B")
    assert b == set(range(10))  # its tail (10..14) lies in the hole, and B never published again
    assert [(g.seq, g.reason) for g in b_gaps] == [(10, "stream-hole")]
    assert stats["hole_gaps"] == 1
    assert health["A"].gaps == len(a_gaps) and health["B"].gaps == 1
    assert health["A"].unrecoverable == 70 - len(a)


def test_a_warm_start_checks_its_first_message_of_each_pod_against_the_snapshot(nats_server) -> None:
    sender = PlaneSender(nats_server.url, SPEC, window=4096)
    try:
        _put(sender, "A", range(10))  # stream seqs 1..10
        _put(sender, "B", range(5))  # 11..15
        assert sender.flush(30)
        out: list = []
        with JetStreamSource(nats_server.url, durable="r", stream=SPEC, start_seq=1) as src:
            _read_until(src, 15, out)
            covered, pods = src.position, src.positions()
        assert pods == {"A": (0, 9, "kv@A@m"), "B": (0, 4, "kv@B@m")}
        _put(sender, "A", range(10, 50))  # 16..55: the stream keeps 26..55, 16..25 (A10..A19) are gone
        assert sender.flush(30)
        out = []
        # the replica restarts from its snapshot: it reads from covered + 1 with the pods it covered
        with JetStreamSource(nats_server.url, durable="r", stream=SPEC, start_seq=covered + 1, pods=pods) as src:
            _read_until(src, 55, out)
            stats = src.stats()
    finally:
        sender.close()
    assert stats["stream_holes"] == 1 and stats["stream_lost"] == 10
    gaps = [(d.publisher, d.seq, d.missed, d.reason) for d in out if d.kind is GAP]
    # A's first message after the snapshot is A20: A10..A19 are lost, exactly; B showed nothing
    # after the hole, so whether it lost its tail there is unknowable: a GAP, not silence
    assert gaps == [("A", 10, 10, "lost"), ("B", 5, 0, "stream-hole")]
    assert [d.seq for d in out if d.kind is BATCH] == list(range(20, 50))


def test_no_hole_no_gap_and_a_narrower_filter_does_not_count_holes(nats_server) -> None:
    sender = PlaneSender(nats_server.url, StreamSpec(), window=4096)
    try:
        for s in range(20):
            _put(sender, "A" if s % 2 else "B", [s // 2])
        assert sender.flush(30)
        for filt in (None, subject_for("kvevents", "m", "A")):
            out: list = []
            with JetStreamSource(nats_server.url, durable="f", start_seq=1, filter_subject=filt) as src:
                wait_for(lambda: len([d for d in out if d.kind is BATCH]) >= (10 if filt else 20), "reading",
                         pump=lambda: out.extend(src.poll(50)))
                stats = src.stats()
            assert not [d for d in out if d.kind is GAP]
            assert stats["stream_holes"] == stats["hole_gaps"] == 0
    finally:
        sender.close()


def test_a_snapshot_carries_the_pod_positions_it_covers(nats_server) -> None:
    import asyncio

    import nats

    from kvevents.transport.nats.wire import StreamSpec
    from kvservice.planestore import PlaneStore

    async def go():
        nc = await nats.connect(nats_server.url)
        try:
            await StreamSpec().ensure(nc.jetstream())
            store = PlaneStore(nc.jetstream(), storage="memory")
            await store.open()
            await store.save("r1", b"snap", 0, {"A": (0, 9, "kv@A@m"), "B": (2, 4, "kv@B@m")})
            got = await store.load("r1")
            await store.save("r2", b"old", 0)  # a snapshot that names no positions
            return got, await store.load("r2")
        finally:
            await nc.close()
    (data, seq, pods), (old, _, none) = asyncio.run(go())
    assert data == b"snap" and seq == 0 and pods == {"A": (0, 9, "kv@A@m"), "B": (2, 4, "kv@B@m")}
    assert old == b"old" and none == {}


def test_a_pod_silent_across_two_holes_gets_one_tail_gap() -> None:
    """The stream may be trimmed while a slow reader reads, so it meets two holes in a row (the
    first settles at the stream end it last knew). A pod that showed nothing across both has one
    possible tail loss to report, not two; a pod that showed something in between gets its own."""
    import time as _time

    src = JetStreamSource.__new__(JetStreamSource)  # the per-pod bookkeeping alone, no connection
    from kvevents.transport.nats.pods import PodChecks

    src._doubt, src.stream_last = None, 20
    src._stats = {"stream_holes": 0, "stream_lost": 0}
    src._checks = PodChecks(src._stats)
    src._pods = src._checks.pods
    now = _time.time()
    for pod, q in (("B", 20), ("A", 19)):
        st = src._checks.pod(pod, now)
        st.run, st.last_seq, st.stream_seq = 0, 9, q
    out: list = []
    src._hole(21, 40)
    src._settle_doubt(now, out)
    src._pods["A"].last_seq, src._pods["A"].stream_seq = 12, 41  # A shows up between the holes
    src._hole(42, 56)
    src._settle_doubt(now, out)
    got = [(d.publisher, d.seq, d.reason) for d in out]
    assert got == [("B", 10, "stream-hole"), ("A", 10, "stream-hole"), ("A", 13, "stream-hole")]
    assert src._stats["hole_gaps"] == 3 and src._stats["stream_holes"] == 2
