"""The windows in which a publisher restart used to go unseen in connect mode (issue 10 item 2's
last splice in the kill -9 run), each made deterministic: the restarted publisher's replay
socket answers a request the subscriber sent while it was down, before (or without) the SUB
socket's reconnect."""

from __future__ import annotations

import kvevents
from kvevents import DeliveryKind, Subscriber, ZmqEventPublisher

from ..pubsub_helpers import batch, collect, ipc_pair, seqs, wait_connected

BATCH, RESET, GAP = DeliveryKind.BATCH, DeliveryKind.RESET, DeliveryKind.GAP


def _old_run(sub, ep, rep) -> int:
    """Run 1 delivers 10 batches and stops; returns its last seq."""
    pub = ZmqEventPublisher(ep, rep)
    try:
        start = wait_connected(pub, sub)
        for i in range(10):
            pub.publish(batch(i))
        collect(sub, lambda g: start + 9 in seqs(g))
    finally:
        pub.shutdown()
    return start + 9


def _new_run(ep, rep, first: int) -> ZmqEventPublisher:
    """Run 2, already past run 1's seq: its first batch is ``first``."""
    pub = ZmqEventPublisher(ep, rep)
    pub.publish_raw(kvevents.encode_batch(batch(2000)), seq=first)
    for i in range(5):
        pub.publish(batch(2001 + i))
    return pub


def test_an_idle_probe_answered_by_the_next_run_is_a_reset_not_a_healed_gap() -> None:
    """The publisher goes down; the subscriber's idle probe waits in its DEALER; the next run binds
    the replay endpoint and answers it. Here the SUB never reconnects (the new run publishes
    elsewhere), so only the probe's answer can tell: it starts at the last delivered batch, whose
    payload the new run does not have. Before: its batches were delivered as the old run's tail."""
    ep, rep = ipc_pair()
    sub = Subscriber([(ep, rep, "p")], tail_probe_after=0.02, replay_timeout=60.0, stale_after=3600.0)
    pub = None
    try:
        last = _old_run(sub, ep, rep)
        collect(sub, lambda g: sub.health()["p"].probes >= 1)  # a probe is out, to nobody
        pub = _new_run(ipc_pair()[0], rep, last + 5)
        got = collect(sub, lambda g: RESET in [d.kind for d in g] and len(seqs(g)) >= 6)
    finally:
        sub.close()
        if pub is not None:
            pub.shutdown()
    kinds = [d.kind for d in got]
    before = [d for d in got[:kinds.index(RESET)] if d.kind is not RESET]
    assert not before, f"the new run taken for the old one's tail: {[(d.kind.value, d.seq) for d in before][:5]}"
    after = got[kinds.index(RESET) + 1:]
    assert after[0].kind is GAP and (after[0].seq, after[0].missed) == (0, last + 5)
    assert [d.seq for d in after[1:7]] == list(range(last + 5, last + 11))
    assert [d.batch for d in after[1:7]] == [batch(2000 + i) for i in range(6)]
    assert sub.health()["p"].resets == 1


def test_a_reconnect_while_a_probe_is_out_keeps_the_new_runs_batches_held() -> None:
    """An idle probe is out when the SUB reconnects to the next run, whose replay socket is not
    up: the reconnect's check takes the probe's place, so the new run's live batches stay held
    and, the check going unanswered, are a RESET (unverified). Before: the first live batch
    cancelled the probe, and with it the check, and the new run was spliced on after a GAP."""
    ep, rep = ipc_pair()
    sub = Subscriber([(ep, rep, "p")], tail_probe_after=0.02, replay_timeout=1.0, stale_after=3600.0)
    pub = None
    try:
        last = _old_run(sub, ep, rep)
        collect(sub, lambda g: sub.health()["p"].probes >= 1)
        pub = ZmqEventPublisher(ep)  # no replay socket (yet)
        first = [last + 5]
        pub.publish_raw(kvevents.encode_batch(batch(2000)), seq=first[0])
        got = collect(sub, lambda g: RESET in [d.kind for d in g] and len(seqs(g)) >= 3,
                      pump=lambda: pub.publish(batch(2001)))
    finally:
        sub.close()
        if pub is not None:
            pub.shutdown()
    kinds = [d.kind for d in got]
    before = [d for d in got[:kinds.index(RESET)]]
    assert not before, f"the new run spliced onto the old one: {[(d.kind.value, d.seq) for d in before][:5]}, {sub.health()['p']}"
    after = got[kinds.index(RESET) + 1:]
    assert after[0].kind is GAP and after[0].seq == 0
    assert all(d.batch.ts >= batch(2000).ts for d in after if d.kind is BATCH)
    h = sub.health()["p"]
    assert (h.resets, h.unverified_resets) == (1, 1) and h.reconnects >= 1


def test_old_runs_batches_held_for_an_unfinished_replay_are_not_delivered_as_the_next_runs() -> None:
    """Run 1 leaves a gap whose replay it never answers (it dies), with later live batches held;
    run 2 comes up past run 1's last delivered seq but below those held seqs. The reconnect check
    finds the restart: RESET, run 2 from 0 — and the held batches, run 1's, go with run 1's state.
    Before: they were kept as run 2's and delivered after its replay (a splice, then a second RESET)."""
    import zmq

    ep, rep = ipc_pair()
    ctx = zmq.Context.instance()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    for s in (pub, router):
        s.setsockopt(zmq.LINGER, 0)
    pub.bind(ep)
    router.bind(rep)
    old = lambda seq: [b"", seq.to_bytes(8, "big"), kvevents.encode_batch(batch(seq))]  # noqa: E731
    sub = Subscriber([(ep, rep, "p")], tail_probe_after=None, replay_timeout=60.0)
    new = None
    try:
        nxt = iter(range(10**6))
        got = collect(sub, lambda g: bool(seqs(g)), pump=lambda: pub.send_multipart(old(next(nxt))))
        last = next(nxt) + 9
        for seq in range(last - 9, last + 1):
            pub.send_multipart(old(seq))
        got += collect(sub, lambda g: last in seqs(g))
        for seq in (500, 501):  # the seqs after `last` missing: a replay is asked, these two held
            pub.send_multipart(old(seq))
        collect(sub, lambda g: router.poll(0))
        assert int.from_bytes(router.recv_multipart()[2], "big") == last + 1
        pub.close(0)  # run 1 dies without answering
        router.close(0)
        quiet = [True]  # run 2's first batches go to its ring only: the reconnect check finds it
        new = ZmqEventPublisher(ep, rep, drop_live=lambda seq: quiet[0])
        new.publish_raw(kvevents.encode_batch(batch(2000)), seq=100)
        for i in range(5):
            new.publish(batch(2001 + i))
        got += collect(sub, lambda g: RESET in [d.kind for d in g])
        quiet[0] = False
        got += collect(sub, lambda g: len(seqs(g)) >= 30, pump=lambda: new.publish(batch(2010)))
    finally:
        sub.close()
        for s in (pub, router):
            s.close(0)
        if new is not None:
            new.shutdown()
    kinds = [d.kind for d in got]
    after = got[kinds.index(RESET) + 1:]
    assert kinds.count(RESET) == 1, [(d.kind.value, d.seq) for d in got if d.kind is not BATCH][:10]
    assert after[0].kind is GAP and (after[0].seq, after[0].missed) == (0, 100)
    delivered = [d for d in after if d.kind is BATCH]
    assert all(d.batch.ts >= batch(2000).ts for d in delivered), \
        f"run 1's batches delivered as run 2's: {[d.seq for d in delivered if d.batch.ts < batch(2000).ts]}"
    assert [d.seq for d in delivered] == list(range(100, 100 + len(delivered)))


def test_the_old_connections_unread_batches_after_a_reconnect_go_with_the_old_run() -> None:
    """The subscriber does not poll while the publisher dies and the next run comes up (as the
    kill -9 run's loop does while it starts the next process): the old run's last batches still
    sit unread in the SUB socket when the reconnect is seen, and are read after it. The next run
    is behind the old one. They come before the new connection's and continue the old run's seqs
    one by one (the descriptor cannot tell: the new connection reuses the old one's number): the
    RESET ends the old run and its late batches with it. Before: they were held as the new run's and delivered after
    its replay (a splice), then its live seq went back (a second RESET)."""
    ep, rep = ipc_pair()
    sub = Subscriber([(ep, rep, "p")], tail_probe_after=None, replay_timeout=60.0)
    old = ZmqEventPublisher(ep, rep)
    new = None
    try:
        start = wait_connected(old, sub)
        for i in range(10):
            old.publish(batch(i))
        got = collect(sub, lambda g: start + 9 in seqs(g))
        for i in range(10, 30):  # not polled: these stay in the SUB socket
            old.publish(batch(i))
        old.shutdown()
        quiet = [True]
        new = ZmqEventPublisher(ep, rep, drop_live=lambda seq: quiet[0])
        for i in range(6):  # run 2: seqs 0..5, behind run 1 (its ring only, for now)
            new.publish(batch(2000 + i))
        assert sub._peers["p"].monitor.poll(10_000), "the SUB socket never reconnected"
        got += collect(sub, lambda g: RESET in [d.kind for d in g])
        quiet[0] = False
        got += collect(sub, lambda g: len([d for d in g if d.kind is BATCH]) >= 20,
                       pump=lambda: new.publish(batch(2010)))
    finally:
        sub.close()
        old.shutdown()
        if new is not None:
            new.shutdown()
    kinds = [d.kind for d in got]
    assert kinds.count(RESET) == 1, [(d.kind.value, d.seq) for d in got if d.kind is not BATCH][:10]
    after = [d for d in got[kinds.index(RESET) + 1:] if d.kind is BATCH]
    assert all(d.batch.ts >= batch(2000).ts for d in after), \
        f"run 1's batches delivered as run 2's: {[d.seq for d in after if d.batch.ts < batch(2000).ts][:10]}"
    assert [d.seq for d in after] == list(range(len(after)))


def test_a_reconnect_no_poll_reported_still_comes_before_the_new_runs_frames() -> None:
    """Every poll's readiness snapshot predates the SUB socket's monitor reporting the reconnect
    (a starved subscriber thread: the new run's frames are queued by the time the socket is
    drained), here forced by a poller that never reports the monitor. Before: the frames were used
    first, as a gap that the new run's replay healed (a splice), and the reconnect was never seen.

    The monitor is taken out of the poller, not filtered out of its answers: it also reports the
    old connection's loss, and a filtered-out readable monitor made every poll return at once with
    nothing, so the pump published ~100,000 batches a second through the ~100 ms reconnect interval
    and the new run's ring (10,000) had evicted its start before the replay from 0 asked for it."""
    ep, rep = ipc_pair()
    sub = Subscriber([(ep, rep, "p")], tail_probe_after=None, replay_timeout=60.0)
    for peer in sub._peers.values():
        sub._poller.unregister(peer.monitor)  # read only by the SUB socket's drain (RestartDetector.read_live)
    pub = None
    try:
        last = _old_run(sub, ep, rep)
        pub = _new_run(ep, rep, last + 5)
        got = collect(sub, lambda g: RESET in [d.kind for d in g] and len(seqs(g)) >= 6,
                      pump=lambda: pub.publish(batch(2100)))
    finally:
        sub.close()
        if pub is not None:
            pub.shutdown()
    kinds = [d.kind for d in got]
    assert RESET in kinds, f"the new run spliced onto the old one: {[(d.kind.value, d.seq) for d in got][:8]}"
    before = [d for d in got[:kinds.index(RESET)] if d.kind is not RESET]
    assert not before, f"the new run spliced onto the old one: {[(d.kind.value, d.seq) for d in before][:5]}"
    after = got[kinds.index(RESET) + 1:]
    assert pub.stats()["ring_evicted"] == 0, "the new run's ring evicted its start: the test flooded it"
    assert after[0].kind is GAP and (after[0].seq, after[0].missed) == (0, last + 5)
    assert [d.batch for d in after[1:7]] == [batch(2000 + i) for i in range(6)]
    assert sub.health()["p"].reconnects == 1


def test_the_new_runs_live_frames_continuing_the_old_runs_seq_are_delivered_after_the_reset() -> None:
    """After a restart is found, live frames continuing the old run's seqs one by one are the old
    connection's unread tail — but only while that tail can still be there. Here the old run was
    read to the end before the reconnect, and the new run's first live frame after the RESET
    happens to be exactly the old run's next seq. Before: it was dropped as the old run's, and so
    was every frame after it (each continuing the last): the new run was never delivered live,
    silently (seen as "10 of 27 batches arrived" in the loaded kill -9 loop)."""
    import zmq

    ep, rep = ipc_pair()
    ctx = zmq.Context.instance()
    socks = []

    def sock(kind, where):
        s = ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        s.bind(where)
        socks.append(s)
        return s

    frame = lambda run, seq: [b"", seq.to_bytes(8, "big"), kvevents.encode_batch(batch(run * 1000 + seq))]  # noqa: E731
    sub = Subscriber([(ep, rep, "p")], tail_probe_after=None, replay_timeout=60.0)
    try:
        pub, router = sock(zmq.PUB, ep), sock(zmq.ROUTER, rep)
        nxt = iter(range(10**6))
        got = collect(sub, lambda g: bool(seqs(g)), pump=lambda: pub.send_multipart(frame(1, next(nxt))))
        last = next(nxt) + 4
        for seq in range(last - 4, last + 1):
            pub.send_multipart(frame(1, seq))
        got += collect(sub, lambda g: last in seqs(g))
        pub.close(0)
        router.close(0)
        pub, router = sock(zmq.XPUB, ep), sock(zmq.ROUTER, rep)
        got += collect(sub, lambda g: pub.poll(0))  # the SUB reconnected and subscribed again
        assert pub.recv() == b"\x01"
        got += collect(sub, lambda g: router.poll(0))  # the reconnect check, from the last delivered batch
        ident, _, start = router.recv_multipart()
        assert int.from_bytes(start, "big") == last
        router.send_multipart([ident, b"", b""] + frame(2, last)[1:])  # another payload under that seq
        got += collect(sub, lambda g: RESET in [d.kind for d in g] and router.poll(0))
        ident, _, start = router.recv_multipart()  # the new run from 0
        assert int.from_bytes(start, "big") == 0
        for seq in range(last + 1):
            router.send_multipart([ident, b"", b""] + frame(2, seq)[1:])
        router.send_multipart([ident, b"", b"", b"\xff" * 8, b""])
        got += collect(sub, lambda g: last in seqs(g))
        for seq in range(last + 1, last + 6):  # live again: the first is the old run's next seq
            pub.send_multipart(frame(2, seq))
        got += collect(sub, lambda g: last + 5 in seqs(g), deadline=5.0)
    finally:
        sub.close()
        for s in socks:
            s.close(0)
    kinds = [d.kind for d in got]
    after = [d for d in got[kinds.index(RESET) + 1:] if d.kind is BATCH]
    assert [d.seq for d in after] == list(range(last + 6))
    assert all(d.batch == batch(2000 + d.seq) for d in after)
    assert sub.health()["p"].old_conn_dropped == 0
