"""Connect mode without a replay endpoint: a publisher killed -9 and restarted whose new run is
already past the old seq is a RESET (counted as unverified), never a gap followed by the new run
spliced on. Nothing can verify the run (no replay socket to fingerprint-check), so the SUB
socket's reconnect itself is the RESET, as bind mode does without a replay endpoint."""

from __future__ import annotations

import signal

from kvevents import DeliveryKind, Subscriber

from ..pubsub_helpers import collect, ipc_pair
from .kill9 import judge, run_of, start_publisher

BATCH, RESET, GAP = DeliveryKind.BATCH, DeliveryKind.RESET, DeliveryKind.GAP
NEW = 100_000


def _batches_of(got, run: int) -> int:
    return sum(1 for d in got if d.kind is BATCH and run_of(d) == run)


def test_connect_mode_restart_without_replay_past_the_old_seq_is_a_reset_not_a_splice() -> None:
    ep, rep = ipc_pair()
    sub = Subscriber([(ep, None, "p")], tail_probe_after=None)
    proc = start_publisher(ep, rep, 1, "--no-replay")
    got: list = []
    try:
        got += collect(sub, lambda g: _batches_of(g, 1) >= 20)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        # the new run is far past the old one's seq when its first frame arrives
        proc = start_publisher(ep, rep, 2, "--from", "100000", "--no-replay")
        got += collect(sub, lambda g: _batches_of(got + g, 2) >= 20)
    finally:
        proc.kill()
        proc.wait()
        sub.close()
    r = judge(got)
    assert r["splices"] == 0 and r["disorder"] == 0, r
    assert r["resets"] == 1, r
    after = got[[d.kind for d in got].index(RESET) + 1:]
    # 0..99999 never published by run 2 (and what its connection dropped before the subscription
    # took hold): one GAP, then run 2's batches in order
    assert after[0].kind is GAP and after[0].seq == 0 and after[0].missed >= 100000, after[:2]
    assert after[1].kind is BATCH and after[1].seq == after[0].missed
    assert all(run_of(d) == 2 for d in after if d.kind is BATCH)
    h = sub.health()["p"]
    assert (h.reconnects, h.resets, h.unverified_resets) == (1, 1, 1), h
    assert sub.stats()["unverified_resets"] == 1


def _connect_sim(rcvhwm: int = 100_000):
    from .bindsim import ConnectSim

    sub = Subscriber([(ipc_pair()[0], None, "p")], tail_probe_after=None, rcvhwm=rcvhwm)
    return sub, ConnectSim(sub, "p")


def test_reconnect_reported_after_the_new_runs_frames_were_read_is_still_a_reset_first() -> None:
    """Scripted: run 1's last frames are unread, the SUB reconnects and run 2's frames queue behind
    them in the same pipe; the monitor's CONNECTED is queued only while a drain reads them (the
    poll's snapshot predates it). Nothing read before the socket runs dry after the reconnect is
    delivered (old tail or new start, no mark between): RESET, then run 2."""
    sub, sim = _connect_sim()
    try:
        sim.pipe.send("", 1, *range(30))
        got = sim.poll_all()
        assert [d.seq for d in got] == list(range(30))
        sim.pipe.send("", 1, 30, 31)

        def restart() -> None:
            sim.reconnect()
            sim.pipe.send("", 2, *range(NEW, NEW + 3))

        sim.at_recv(sim.taken + 1, restart)
        got += sim.poll_all()
        sim.pipe.send("", 2, NEW + 3, NEW + 4)
        got += sim.poll_all()
    finally:
        sim.close()
    r = judge(got)
    assert r["splices"] == 0 and r["resets"] == 1, r
    after = got[[d.kind for d in got].index(RESET) + 1:]
    assert [(d.kind, d.seq) for d in after] == [(GAP, 0), (BATCH, NEW + 3), (BATCH, NEW + 4)]
    h = sub.health()["p"]
    assert (h.reconnects, h.unverified_resets, h.old_conn_dropped) == (1, 1, 5), h


def test_a_reconnect_window_that_never_runs_dry_closes_by_count() -> None:
    """The SUB socket never runs dry after the reconnect: what is dropped is bounded by what the
    old connection can have left unread (receive HWM and a drain); then run 2 is delivered."""
    from kvevents.transport.zmq.restarts import tail_bound

    sub, sim = _connect_sim(rcvhwm=4)
    bound = tail_bound(4)
    try:
        sim.pipe.send("", 1, *range(10))
        got = sim.poll_all()
        sim.reconnect()
        sim.pipe.send("", 2, *range(NEW, NEW + bound + 100))
        while not [d for d in got if d.kind is BATCH and run_of(d) == 2]:
            got += sub.poll(0)
            assert sim.readable(), "the socket ran dry: the window closed by EAGAIN, not by count"
    finally:
        sim.close()
    h = sub.health()["p"]
    assert h.old_conn_dropped == bound and h.unverified_resets == 1, h
    assert judge(got)["splices"] == 0
