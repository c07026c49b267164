"""Liveness from evidence at the subscriber: connection state, replay answers, and idle probes
that never take a lagging subscriber's view of a ring that moved on for a restart."""

from __future__ import annotations

import time

from kvevents import DeliveryKind, HealthState, PublisherSpec, Subscriber, ZmqEventPublisher

from .pubsub_helpers import batch, collect, seqs, wait_connected


def test_a_probe_answered_past_the_anchor_on_an_unbroken_connection_is_no_restart(tmp_path):
    """The subscriber lags more than a ring behind (the cores are busy): the publisher's ring has
    moved past the last delivered batch when an idle probe asks for it. The connection never
    broke, so it is the same run: no RESET, no GAP, and the live frames on their way are
    delivered in order. (Before: a RESET, then a replay from 0 into the ring's hole.)"""
    pub_ep, rep_ep = f"ipc://{tmp_path}/p.pub", f"ipc://{tmp_path}/p.replay"
    pub = ZmqEventPublisher(pub_ep, rep_ep, topic="", buffer_steps=10)
    sub = Subscriber([PublisherSpec(pub_ep, rep_ep, "p")], tail_probe_after=None)
    try:
        start = wait_connected(pub, sub)
        for i in range(start, start + 5):
            pub.publish(batch(i))
        collect(sub, lambda g: seqs(g) and max(seqs(g)) == start + 4)
        peer = sub._peers["p"]
        assert peer.anchor_seq == start + 4 and peer.connected
        for i in range(start + 5, start + 105):  # the ring (10) moves far past the anchor
            pub.publish(batch(i))
        wait_ring = time.monotonic() + 10
        while pub.stats()["batches_published"] < start + 105 and time.monotonic() < wait_ring:
            time.sleep(0.01)  # (a poll of the publisher's counter, with a deadline)
        # an idle probe, as poll() sends one when it is due, while the lagging live frames wait unread;
        # its answer is used before them (as a poll does when they are still on their way: a poll
        # that reads them first makes the probe moot before its answer is looked at)
        assert peer.tracker.check(time.time(), probe=True)
        sub._send_request(peer)
        assert peer.dealer.poll(10_000), "the replay socket did not answer"
        got = []
        sub._on_replay(peer, peer.dealer.recv_multipart(), time.time(), got)
        got += collect(sub, lambda g: seqs(g) and max(seqs(g)) == start + 104 and not peer.tracker.recovering)
        assert [d.kind for d in got if d.kind is not DeliveryKind.BATCH] == []
        assert seqs(got) == list(range(start + 5, start + 105))
        h = sub.health()["p"]
        assert h.resets == 0 and h.unrecoverable == 0 and h.probes_moot == 1
    finally:
        sub.close()
        pub.shutdown(timeout=0.5)


def test_a_quiet_publisher_is_synced_while_its_connection_is_up_and_stale_once_it_is_gone(tmp_path):
    """No replay endpoint, nothing published for longer than stale_after: SYNCED while connected
    (and ready before its first batch); STALE only once its connection is lost (counted)."""
    pub_ep = f"ipc://{tmp_path}/q.pub"
    pub = ZmqEventPublisher(pub_ep, None, topic="")
    sub = Subscriber([PublisherSpec(pub_ep, None, "q")], stale_after=0.05)
    try:
        collect(sub, lambda g: sub.health()["q"].connected)  # subscribed, nothing published yet
        h = sub.health()["q"]
        assert h.state is HealthState.SYNCED and h.received == 0
        quiet_from = time.monotonic()
        while time.monotonic() - quiet_from < 4 * sub.stale_after:  # quiet past stale_after
            sub.poll(10)
        assert sub.health()["q"].state is HealthState.SYNCED
        pub.shutdown(timeout=0.5)
        pub = None
        collect(sub, lambda g: not sub.health()["q"].connected)
        end = time.monotonic() + 10
        while sub.health()["q"].state is not HealthState.STALE and time.monotonic() < end:
            sub.poll(10)
        h = sub.health()["q"]
        assert h.state is HealthState.STALE and h.disconnects == 1
    finally:
        sub.close()
        if pub is not None:
            pub.shutdown(timeout=0.5)



def test_the_old_runs_unread_tail_is_told_by_its_seqs_going_up_holes_included():
    """After a restart was found, frames still unread from the old connection go on up from the
    old run's seqs, with holes where a lagging subscriber's high-water mark lost some; the first
    seq that goes back is the new run's. (Before: the first hole ended the old tail, what followed
    it was taken for the new run, and the new run's seq 0 was a second RESET — seen under bursts
    on busy cores, benchmarks/chaos_bursts.py.)"""
    from kvevents.tracker import SeqTracker
    from kvevents.transport.zmq.peers import Peer

    peer = Peer("p", None, SeqTracker("p"))
    peer.old_next = 100
    assert [peer.old_leftover(s) for s in (100, 101, 105, 230, 231)] == [True] * 5
    assert peer.old_leftover(0) is False and peer.old_next == -1  # the new run: the old tail is over


def test_an_idle_probes_answer_read_after_live_traffic_made_it_moot_is_no_restart(tmp_path):
    """A quiet publisher's idle probe asks from the anchor (the last delivered batch); before its
    answer is used, the same poll reads the publisher's next burst on the live socket (the SUB is
    read before the replay DEALER), which makes the probe moot and moves the anchor on. The answer
    then carries the old anchor's batch, unchanged. Before: it was compared with the new anchor's
    payload, found "changed", and the pod RESET (a false restart: 2 RESETs for 1 restart in about
    1 run in 7 of tests/chaos/test_burst_under_load.py). Socket-free: no publisher, the poll's
    handlers called in its order."""
    import kvevents
    from kvevents.transport.zmq.frames import END_SEQ

    sub = Subscriber([PublisherSpec(f"ipc://{tmp_path}/p.pub", f"ipc://{tmp_path}/p.replay", "p")],
                     tail_probe_after=None, raw=True)
    try:
        peer, now, out = sub._peers["p"], time.time(), []
        peer.connects, peer.connected = 1, True  # the monitor's CONNECTED, read earlier
        live = lambda seq: [b"", seq.to_bytes(8, "big"), kvevents.encode_batch(batch(seq))]  # noqa: E731
        for seq in range(10):
            sub._on_live(peer, live(seq), now, out)
        assert peer.anchor_seq == 9 and not peer.tracker.recovering
        assert peer.tracker.check(now, probe=True)  # the probe poll() sends when it is due
        sub._send_request(peer)
        assert peer.checking == 9
        for seq in range(10, 15):  # the burst, drained first in the poll that holds the answer
            sub._on_live(peer, live(seq), now, out)
        assert peer.anchor_seq == 14
        answer = lambda seq: [b"", b"", seq.to_bytes(8, "big"), kvevents.encode_batch(batch(seq))]  # noqa: E731
        sub._on_replay(peer, answer(9), now, out)  # the probe's answer: the old anchor, unchanged
        for seq in range(10, 15):
            if peer.dealer is not None:
                sub._on_replay(peer, answer(seq), now, out)
        if peer.dealer is not None:
            sub._on_replay(peer, [b"", b"", END_SEQ, b""], now, out)
        for seq in range(15, 20):  # the publisher goes on
            sub._on_live(peer, live(seq), now, out)
        assert [d.kind for d in out] == [DeliveryKind.BATCH] * 20
        assert [d.seq for d in out] == list(range(20))
        h = sub.health()["p"]
        assert (h.resets, h.gaps, h.unrecoverable) == (0, 0, 0)
    finally:
        sub.close()


def test_the_reconnect_of_a_run_found_while_its_publisher_was_down_is_no_second_restart(tmp_path):
    """The publisher goes down and an idle probe goes out while it is; the next run binds the
    replay socket first and answers it (nothing at the anchor): a RESET, and the new run is
    replayed from 0. Then the SUB socket reconnects — to that same run — and its check asks from
    the new anchor, which the new run's ring (a busy publisher, a lagging subscriber) has already
    moved past. That is the run the RESET found, its ring moved on: the missing seqs are a GAP,
    not a second RESET (before: 2 RESETs for 1 restart, seen in tests/chaos/test_burst_under_load.py
    with more busy processes than cores). Socket-free: the replay answers and the monitor's
    reconnect are handed to the subscriber's own handlers."""
    import kvevents
    from kvevents.transport.zmq.frames import END_SEQ

    sub = Subscriber([PublisherSpec(f"ipc://{tmp_path}/p.pub", f"ipc://{tmp_path}/p.replay", "p")],
                     tail_probe_after=None, raw=True)
    try:
        peer, now, out = sub._peers["p"], time.time(), []
        peer.connects, peer.connected = 1, True  # the monitor's CONNECTED, read earlier
        def live(run: int, seq: int) -> list[bytes]:
            return [b"", seq.to_bytes(8, "big"), kvevents.encode_batch(batch(run * 1000 + seq))]

        answer = lambda run, seq: [b"", b"", seq.to_bytes(8, "big"), live(run, seq)[2]]  # noqa: E731
        end = [b"", b"", END_SEQ, b""]
        for seq in range(100):
            sub._on_live(peer, live(1, seq), now, out)
        peer.connected = False  # the monitor's DISCONNECTED: run 1 is gone
        assert peer.tracker.check(now, probe=True)
        sub._send_request(peer)  # the probe, from the anchor (99), waits for whoever binds next
        sub._on_replay(peer, end, now, out)  # run 2 (at seq 40 so far) has nothing at 99: a restart
        assert [d.kind for d in out].count(DeliveryKind.RESET) == 1 and peer.tracker.request is None
        for seq in range(41):  # run 2's replay from 0
            sub._on_replay(peer, answer(2, seq), now, out)
        sub._on_replay(peer, end, now, out)
        assert peer.anchor_seq == 40
        peer.connects, peer.connected = 2, True  # the SUB socket reconnects, to run 2
        sub._restarts._connect_reconnected(peer, now, out)  # as the monitor's read does
        assert peer.suspect and peer.checking == 40
        for seq in range(600, 610):  # run 2's live frames, far ahead: held
            sub._on_live(peer, live(2, seq), now, out)
        for seq in range(300, 600):  # the check's answer: run 2's ring (300) moved past 40
            if peer.dealer is not None:
                sub._on_replay(peer, answer(2, seq), now, out)
        if peer.dealer is not None:
            sub._on_replay(peer, end, now, out)
        after = out[[d.kind for d in out].index(DeliveryKind.RESET) + 1:]
        kinds = [d.kind for d in after]
        assert kinds.count(DeliveryKind.RESET) == 0, \
            [(d.kind.value, d.seq) for d in after if d.kind is not DeliveryKind.BATCH]
        gaps = [(d.seq, d.missed) for d in after if d.kind is DeliveryKind.GAP]
        assert gaps == [(41, 259)]
        assert [d.seq for d in after if d.kind is DeliveryKind.BATCH] == list(range(41)) + list(range(300, 610))
        assert all(d.payload == live(2, d.seq)[2] for d in after if d.kind is DeliveryKind.BATCH)
        assert sub.health()["p"].resets == 1
    finally:
        sub.close()
