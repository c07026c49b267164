"""One healing logic: SeqTracker, used by the subscriber, the recorder, recordings and SeqHealer."""

from __future__ import annotations

import threading
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from consumers.recordtools import SeqHealer
from kvevents import DeliveryKind, ZmqEventPublisher
from kvevents.recorder import Recorder
from kvevents.recording import RecordingWriter, read_recording
from kvevents.recordstream import iter_deliveries
from kvevents.tracker import SeqTracker

from .pubsub_helpers import batch, ipc_pair

BATCH, RESET, GAP = DeliveryKind.BATCH, DeliveryKind.RESET, DeliveryKind.GAP


@settings(max_examples=200, deadline=None)
@given(st.permutations(list(range(12))), st.lists(st.integers(0, 11), max_size=8), st.randoms())
def test_any_arrival_order_of_one_run_heals_to_the_run_in_order(order, dups, rnd):
    """Every seq of one run, in any order, with duplicates anywhere after their first arrival:
    delivered once each, in order, with no GAP and no RESET."""
    arrivals = [(s, False) for s in order]
    for d in dups:  # a duplicate of seq d, flagged replayed or not, somewhere after d's first arrival
        first = arrivals.index((d, False))
        arrivals.insert(rnd.randint(first + 1, len(arrivals)), (d, rnd.random() < 0.5))
    healer = SeqHealer(from_zero=True)
    batches = {s: batch(s) for s in range(12)}
    out = []
    for seq, replayed in arrivals:
        out += healer.push("p", seq, batches[seq], replayed=replayed)
    out += healer.finish()
    assert [(d.kind, d.seq) for d in out] == [(BATCH, s) for s in range(12)]
    assert [d.batch for d in out] == [batches[s] for s in range(12)]
    assert healer.duplicates == len(dups)


def test_a_fill_inside_a_hole_releases_the_held_run_and_ends_the_recovery():
    t = SeqTracker("p", can_replay=True)
    assert [d.seq for d in t.on_live(0, batch(0), 0.0)] == [0]
    assert t.on_live(3, batch(3), 0.0) == [] and t.recovering and t.request == 1
    assert t.on_fill(2, batch(2), 0.0) == []  # held: 1 still missing
    assert t.on_fill(2, batch(2), 0.0) == [] and t.on_fill(0, batch(0), 0.0) == []  # held already / delivered
    got = t.on_fill(1, batch(1), 0.0, replayed=True)
    assert [(d.seq, d.replayed) for d in got] == [(1, True), (2, True), (3, False)]
    assert not t.recovering and t.expected == 4 and t.health.replay_requests == 1
    assert t.on_fill(5, batch(5), 0.0) == []  # no hole open: not a fill


def test_rejoin_asks_again_only_while_nothing_was_delivered():
    t = SeqTracker("p", can_replay=True, late_join=True, replay_timeout=1.0, now=0.0)
    assert t.request == 0 and t.health.replay_requests == 1
    assert t.rejoin(0.5) is False  # a request is outstanding
    assert t.tick(1.5) == [] and not t.recovering and t.health.replay_timeouts == 1
    t.request = None
    assert t.rejoin(2.0) is True and t.request == 0 and t.late and t.health.replay_requests == 2
    assert [d.seq for d in t.on_replay(0, batch(0), 2.1) + t.on_replay_end(2.1)] == [0]
    assert t.rejoin(3.0) is False  # something was delivered: the stream has a start
    assert SeqTracker("q").rejoin(0.0) is False  # no replay socket


def test_the_recorder_backfills_a_publisher_that_came_up_after_it(tmp_path):
    """The recorder's first request goes unanswered (nothing listens yet): it asks again (an
    answer with an empty ring says the stream starts at seq 0, so the first live seq past 0
    asks for the rest), and batches published before the recorder's SUB joined are recorded
    from a replay answer."""
    ep, rep = ipc_pair()
    path = tmp_path / "late.kvrec"
    writer = RecordingWriter(path, meta={"backfill": True})
    recorder = Recorder(writer, [ep], replay_endpoints=[rep], backfill=True, replay_timeout=0.2)
    src = recorder.sources[ep]
    deadline = time.monotonic() + 30
    while src.replay_timeouts == 0 and time.monotonic() < deadline:
        recorder.poll_once(20)
    assert src.replay_timeouts >= 1 and src.high is None
    held = threading.Event()
    pub = ZmqEventPublisher(ep, rep, topic="kv@pod@m", drop_live=lambda seq: seq < 3 or not held.is_set())
    try:
        for i in range(3):
            pub.publish(batch(i))  # kept off the live socket: only a replay can bring them
        held.set()
        n = 3
        while src.last_seq is None and time.monotonic() < deadline:  # until the SUB has joined (slow joiner)
            pub.publish(batch(n))
            n += 1
            recorder.poll_once(20)
        while ((src.high or 0) < n - 1 or src.outstanding is not None) and time.monotonic() < deadline:
            recorder.poll_once(20)  # live seqs the SUB missed before it joined come by replay
    finally:
        recorder.close()
        writer.close()
        pub.shutdown()
    assert src.last_seq is not None and src.replay_requests >= 2
    records, _ = read_recording(path)
    ds = list(iter_deliveries(records, late_join=True))
    assert [(d.kind, d.seq) for d in ds] == [(BATCH, s) for s in range(src.high + 1)] and src.high >= 3
