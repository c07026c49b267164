"""Bind mode's connections are bounded: at most ``max_connections`` open (the longest-open one
carrying no publisher is closed for a newcomer, counted), and a peer that stops answering — a
host that died without a FIN, here a publisher process stopped with SIGSTOP — is closed by the
bound socket's heartbeat instead of staying open forever. Before: every accepted connection
stayed until its peer closed it (a half-open one never did), unbounded and uncounted."""

from __future__ import annotations

import select
import signal
import socket
import time

from kvevents import DeliveryKind, Subscriber, ZmqEventPublisher

from ..pubsub_helpers import batch, collect, free_tcp_port, ipc_pair
from .kill9 import start_publisher

BATCH = DeliveryKind.BATCH


def _poll_until(sub, cond, deadline: float = 10.0) -> None:
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        sub.poll(20)
        if cond():
            return
    raise AssertionError(f"condition not met within {deadline}s: {sub.stats()}")


def _at_eof(s: socket.socket) -> bool:
    """Read what the subscriber sent (its ZMTP greeting) without blocking; True once the stream ended."""
    while select.select([s], [], [], 0)[0]:
        try:
            if not s.recv(4096):
                return True
        except ConnectionResetError:
            return True
    return False


def test_connections_past_max_connections_are_closed_and_counted_and_a_publisher_still_gets_in() -> None:
    port = free_tcp_port()
    ep = f"tcp://127.0.0.1:{port}"
    sub = Subscriber(bind=ep, max_connections=4, heartbeat=None, stale_after=3600.0)
    junk = []
    pub = None
    try:
        for _ in range(12):  # peers that connect and never say anything (nor close)
            junk.append(socket.create_connection(("127.0.0.1", port)))
        _poll_until(sub, lambda: sub.stats()["connections_evicted"] >= 8)
        st = sub.stats()
        assert (st["connections_open"], st["connections_evicted"]) == (4, 8), st
        closed: set[int] = set()
        end = time.monotonic() + 10
        while len(closed) < 8 and time.monotonic() < end:  # the peers see the end of their streams
            closed |= {i for i, s in enumerate(junk) if i not in closed and _at_eof(s)}
        assert len(closed) == 8, closed
        assert closed == set(range(8)), "the longest-open connections go first"
        pub = ZmqEventPublisher(ep, topic="kv@a@m", mode="connect")
        got = collect(sub, lambda g: any(d.kind is BATCH for d in g), pump=lambda: pub.publish(batch(1)))
        assert {d.publisher for d in got} == {"kv@a@m"}
        st = sub.stats()
        assert (st["connections_open"], st["connections_evicted"]) == (4, 9), st
    finally:
        for s in junk:
            s.close()
        if pub is not None:
            pub.shutdown()
        sub.close()


def test_a_publisher_that_stops_answering_is_closed_by_the_heartbeat() -> None:
    """A publisher process stopped (SIGSTOP: its kernel keeps the connection, nothing answers, as
    a host that died without a FIN) has its connection closed once the heartbeat goes unanswered;
    its next run is a new connection, seen as the reconnect it is (a RESET: no replay endpoint)."""
    ep, rep = ipc_pair()
    sub = Subscriber(bind=ep, heartbeat=0.1, stale_after=3600.0, tail_probe_after=None)
    proc = start_publisher(ep, rep, 1, "--no-replay", "--connect", "kv@p@m")
    new = None
    try:
        collect(sub, lambda g: sum(d.kind is BATCH for d in g) >= 5)
        assert sub.stats()["connections_open"] == 1
        proc.send_signal(signal.SIGSTOP)
        _poll_until(sub, lambda: sub.stats()["connections_open"] == 0)
        new = start_publisher(ep, rep, 2, "--no-replay", "--connect", "kv@p@m")
        got = collect(sub, lambda g: any(d.kind is BATCH and int(d.batch.ts) // 1_000_000 == 2 for d in g))
        assert DeliveryKind.RESET in [d.kind for d in got]
        h = sub.health()["kv@p@m"]
        assert (h.reconnects, h.resets) == (1, 1), h
        assert sub.stats()["connections_evicted"] == 0
    finally:
        proc.send_signal(signal.SIGCONT)
        for p in (proc, new):
            if p is not None:
                p.kill()
                p.wait()
        sub.close()
