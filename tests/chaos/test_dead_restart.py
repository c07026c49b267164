"""A publisher that restarts, publishes a backlog and dies before the subscriber reads any of it
(connect mode; issue 10, the restart found last). Its replay socket is gone with it, so the
reconnect's fingerprint check can never be answered. What the subscriber can still read must be
delivered after the RESET where it can be told from the old run, and reported as a GAP where it
cannot: never nothing, never a splice.

Before: with a replay endpoint the new run's first frame (its seq going backwards) was a RESET,
then its second was taken for another unverified reconnect, held, and dropped uncounted with a
second RESET (1 of 2,000 batches delivered, no GAP); without one, every frame read before the
socket ran dry was dropped (counted, but all of the new run, and no GAP)."""

from __future__ import annotations

import time

import pytest
import zmq

from kvevents import DeliveryKind, Subscriber, ZmqEventPublisher

from ..pubsub_helpers import collect, ipc_pair
from .bindsim import ConnectSim, run_batch
from .kill9 import judge, run_of

BATCH, RESET, GAP = DeliveryKind.BATCH, DeliveryKind.RESET, DeliveryKind.GAP
RUN1 = 10_000  #: run 1's first seq: far above where run 2 starts when it is "behind"
BACKLOG = 300


def _after_reset(got) -> list:
    kinds = [d.kind for d in got]
    assert kinds.count(RESET) == 1, [(d.kind.value, d.seq, d.missed) for d in got if d.kind is not BATCH]
    return got[kinds.index(RESET) + 1:]


def _covered(after) -> set[int]:
    out: set[int] = set()
    for d in after:
        out.update(range(d.seq, d.seq + d.missed) if d.kind is GAP else (d.seq,))
    return out


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "no-replay"])
@pytest.mark.parametrize("where", ["behind", "past"])
def test_a_restarted_publisher_that_dies_before_its_backlog_is_read(replay: bool, where: str) -> None:
    ep, rep = ipc_pair()
    rep_ep = rep if replay else None
    sub = Subscriber([(ep, rep_ep, "p")], tail_probe_after=None, replay_timeout=0.3, stale_after=3600.0)
    nxt = [RUN1]

    def send(pub, run: int) -> None:
        pub.publish_raw(run_batch(run, nxt[0]), seq=nxt[0])
        nxt[0] += 1

    old = ZmqEventPublisher(ep, rep_ep)
    new = None
    try:
        got = collect(sub, lambda g: any(d.kind is BATCH for d in g), pump=lambda: send(old, 1))
        got += collect(sub, lambda g: nxt[0] - 1 in [d.seq for d in got + g])  # run 1 read to its end
        old.shutdown()
        last1 = nxt[0] - 1
        # run 2, "behind" run 1 (from 0: its seq goes backwards) or "past" it (nothing in its
        # seqs tells it from run 1's tail): the subscriber does not poll while it comes up,
        # publishes and dies; the SUB socket only queues what arrives
        nxt[0] = 0 if where == "behind" else last1 + 500
        new = ZmqEventPublisher(ep, rep_ep)
        sock = sub._peers["p"].sub
        end = time.monotonic() + 10
        while not sock.poll(20) and time.monotonic() < end:  # (the slow joiner: until frames get through)
            send(new, 2)
        assert sock.poll(0), "run 2's frames never reached the SUB socket"
        for _ in range(BACKLOG):
            send(new, 2)
        last2 = nxt[0] - 1
        new._pub.setsockopt(zmq.LINGER, 5000)  # what it sent reaches the subscriber after it is gone
        new.shutdown()

        def done(g) -> bool:
            return last2 in _covered(g[[d.kind for d in g].index(RESET) + 1:]) if RESET in [d.kind for d in g] else False

        got += collect(sub, lambda g: done(got + g))
    finally:
        sub.close()
        old.shutdown()
        if new is not None:
            new.shutdown()
    r = judge(got)
    assert r["splices"] == 0 and r["disorder"] == 0, r
    after = _after_reset(got)
    assert _covered(after) == set(range(last2 + 1)), "run 2's seqs neither delivered nor reported lost"
    batches = [d for d in after if d.kind is BATCH]
    assert all(run_of(d) == 2 for d in batches)
    h = sub.health()["p"]
    if where == "behind" or replay:  # readable and placeable: delivered, whatever came before is a GAP
        assert batches and batches[-1].seq == last2, [(d.kind.value, d.seq, d.missed) for d in after][:4]
        assert [d.seq for d in batches] == list(range(batches[0].seq, last2 + 1))
        assert [d.kind for d in after[:1]] == ([GAP] if batches[0].seq else [BATCH])
    elif batches:  # past, no replay, and the new connection was seen before its frames were read
        # (the socket monitor's connect event came first): a new connection is a new run, so run 2
        # is delivered whole after a GAP for what came before it
        assert batches[-1].seq == last2 and [d.seq for d in batches] == list(range(batches[0].seq, last2 + 1))
        assert [d.kind for d in after[:1]] == [GAP]
    else:  # past, no replay, frames read before the monitor's events: run 1's tail or run 2's start,
        # no way to tell: dropped, counted, a GAP
        assert [(d.kind, d.seq, d.missed) for d in after] == [(GAP, 0, last2 + 1)]
        assert h.old_conn_dropped >= BACKLOG
    assert h.resets == 1 and h.reconnects == 1, h
    assert h.old_conn_dropped == (0 if where == "behind" or replay else h.old_conn_dropped)


def _sim(replay: bool):
    ep, rep = ipc_pair()  # nothing ever binds ``rep``: the replay socket of a dead publisher
    sub = Subscriber([(ep, rep if replay else None, "p")], tail_probe_after=None, replay_timeout=0.05,
                     stale_after=3600.0)
    return sub, ConnectSim(sub, "p")


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "no-replay"])
def test_a_dead_new_run_continuing_the_old_runs_seq_exactly_is_a_reset_and_a_gap(replay: bool) -> None:
    """Scripted: run 2's frames continue run 1's seqs one by one (30, 31, ...): they cannot be told
    from run 1's unread tail. Dropped (counted) — and, since no replay answers and no later frame
    places the new run, reported as a GAP over their seqs. Before: dropped with no GAP (with a
    replay endpoint not even counted)."""
    sub, sim = _sim(replay)
    try:
        sim.pipe.send("", 1, *range(30))
        got = sim.poll_all()
        assert [d.seq for d in got] == list(range(30))
        sim.reconnect()
        sim.pipe.send("", 2, *range(30, 40))
        got += collect(sub, lambda g: GAP in [d.kind for d in got + g])
    finally:
        sim.close()
    after = _after_reset(got)
    assert [(d.kind, d.seq, d.missed) for d in after] == [(GAP, 0, 40)]
    h = sub.health()["p"]
    assert (h.resets, h.unverified_resets, h.old_conn_dropped, h.unrecoverable) == (1, 1, 10, 40), h


def test_an_old_tail_then_the_new_runs_first_frame_is_one_reset_and_no_gap() -> None:
    """Scripted, no replay endpoint: run 1's last frames are unread at the reconnect (dropped: they
    cannot be told from a new run's), then run 2's arrive from 0 once the socket ran dry. The new
    run places itself: delivered from 0 after the one RESET, and the dropped tail is no GAP even
    once the deadline for placing it has passed."""
    sub, sim = _sim(False)
    try:
        sim.pipe.send("", 1, *range(30))
        got = sim.poll_all()
        sim.pipe.send("", 1, 30, 31)
        sim.reconnect()
        got += sim.poll_all()
        sim.pipe.send("", 2, 0, 1, 2)
        got += sim.poll_all()
        until = time.monotonic() + 0.2  # past replay_timeout (0.05 s): no GAP comes for the tail
        got += collect(sub, lambda g: time.monotonic() > until)
    finally:
        sim.close()
    after = _after_reset(got)
    assert [(d.kind, d.seq) for d in after] == [(BATCH, 0), (BATCH, 1), (BATCH, 2)]
    h = sub.health()["p"]
    assert (h.resets, h.old_conn_dropped, h.unrecoverable) == (1, 2, 0), h


def test_the_new_runs_frames_in_the_same_drain_as_the_old_tail_are_delivered_no_replay() -> None:
    """Scripted, no replay endpoint: run 1's unread tail and run 2's first frames come in one drain
    with the reconnect. Run 2's first frame goes back below the tail's seqs: from it on everything
    is run 2's and delivered (before: all of it dropped until the socket ran dry)."""
    sub, sim = _sim(False)
    try:
        sim.pipe.send("", 1, *range(30))
        got = sim.poll_all()
        sim.pipe.send("", 1, 30, 31)
        sim.reconnect()
        sim.pipe.send("", 2, *range(5))
        got += sim.poll_all()
    finally:
        sim.close()
    after = _after_reset(got)
    assert [(d.kind, d.seq) for d in after] == [(BATCH, s) for s in range(5)]
    assert all(run_of(d) == 2 for d in after)
    assert sub.health()["p"].old_conn_dropped == 2


def test_bind_mode_a_dead_new_connection_continuing_the_old_seq_exactly_is_delivered_after_the_reset() -> None:
    """Bind mode, the replay socket dead: run 2 connects and its frames continue run 1's seqs one by
    one. The connection tells them apart (run 1's connection closed, read to its end): they are run
    2's, delivered after the RESET and a GAP for the seqs before them. Before: dropped as if they
    could be run 1's tail, and the whole range reported lost."""
    from ..pubsub_helpers import free_tcp_port
    from .bindsim import BindSim

    t = "kv@pod@m"
    sub = Subscriber(bind=f"tcp://127.0.0.1:{free_tcp_port()}", replay_endpoints={t: ipc_pair()[1]},
                     tail_probe_after=None, replay_timeout=0.05, heartbeat=None)
    sim = BindSim(sub)
    try:
        a = sim.accept(5).send(t, 1, *range(30))
        got = sim.poll_all()
        assert [d.seq for d in got] == list(range(30))
        a.close()
        got += sim.poll_all()
        sim.accept(5).send(t, 2, *range(30, 40))
        got += collect(sub, lambda g: 39 in [d.seq for d in got + g if d.kind is BATCH and run_of(d) == 2])
    finally:
        sim.close()
    assert judge(got)["splices"] == 0
    after = _after_reset(got)
    assert [(d.kind, d.seq, d.missed) for d in after[:2]] == [(GAP, 0, 30), (BATCH, 30, 0)]
    assert [d.seq for d in after[1:]] == list(range(30, 40)) and all(run_of(d) == 2 for d in after[1:])
    h = sub.health()[t]
    assert (h.resets, h.unverified_resets, h.old_conn_dropped) == (1, 1, 0), h
