"""Bind mode (publishers connect to the subscriber's socket): a publisher killed -9 and restarted
whose new run is already past the old seq when its first frame arrives is a RESET, never a
splice — found from the connection it came back on (kvevents.transport.zmq.conns), with a
replay endpoint (fingerprint check) and without one (a reconnect is a RESET, counted)."""

from __future__ import annotations

import signal

import pytest

from kvevents import DeliveryKind, Subscriber, ZmqEventPublisher

from ..pubsub_helpers import batch, collect, free_tcp_port, ipc_pair
from .kill9 import judge, run_of, start_publisher

BATCH, RESET, GAP = DeliveryKind.BATCH, DeliveryKind.RESET, DeliveryKind.GAP


def _batches_of(got, publisher: str, run: int) -> int:
    return sum(1 for d in got if d.kind is BATCH and d.publisher == publisher and run_of(d) == run)


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "no-replay"])
def test_bind_mode_restart_past_the_old_seq_is_a_reset_not_a_splice(replay: bool) -> None:
    ep = f"tcp://127.0.0.1:{free_tcp_port()}"
    _, rep = ipc_pair()
    sub = Subscriber(bind=ep, replay_endpoints={"b": rep} if replay else {}, tail_probe_after=None)
    other = ZmqEventPublisher(ep, topic="a", mode="connect")  # stays up throughout: never reset
    extra = ("--connect", "b") + (() if replay else ("--no-replay",))
    proc = start_publisher(ep, rep, 1, *extra)
    got: list = []
    try:
        got += collect(sub, lambda g: _batches_of(g, "b", 1) >= 20 and any(d.publisher == "a" for d in g),
                       pump=lambda: other.publish(batch(1)))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        # the new run is far past the old one's seq when its first frame arrives: nothing in the
        # frames tells it from the old run's continuation
        proc = start_publisher(ep, rep, 2, "--from", "100000", *extra)
        got += collect(sub, lambda g: _batches_of(got + g, "b", 2) >= 20, pump=lambda: other.publish(batch(2)))
    finally:
        proc.kill()
        proc.wait()
        other.shutdown()
        sub.close()
    mine = [d for d in got if d.publisher == "b"]
    r = judge(mine)
    assert r["splices"] == 0 and r["disorder"] == 0, r
    assert r["resets"] == 1, r
    after = mine[[d.kind for d in mine].index(RESET) + 1:]
    # 0..99999 never published by run 2 (without replay, also what the new connection dropped before
    # its subscription took hold): one GAP, then run 2's batches in order
    assert after[0].kind is GAP and after[0].seq == 0 and after[0].missed >= 100000
    assert after[1].kind is BATCH and after[1].seq == after[0].missed
    assert all(run_of(d) == 2 for d in after if d.kind is BATCH)
    h = sub.health()
    assert h["b"].reconnects == 1 and h["b"].resets == 1
    assert h["b"].unverified_resets == (0 if replay else 1)
    assert (h["a"].resets, h["a"].reconnects) == (0, 0), "another publisher's reconnect is not this one's"
    assert not [d for d in got if d.publisher == "a" and d.kind is not BATCH]
