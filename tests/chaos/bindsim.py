"""A bound SUB socket's libzmq side, scripted: to put a bind-mode subscriber through orderings of
monitor events and frames that a loaded machine produces only now and then.

``BindSim`` replaces a real bind-mode :class:`~kvevents.Subscriber`'s bound socket, its monitor
and its poller with fakes over the same pyzmq calls (``recv``/``recv(copy=False)`` with the
Frame's ``SRCFD`` and ``more``, ``getsockopt(RCVMORE)``, ``getsockopt(EVENTS)``, the monitor's
``recv_multipart``).
Connections have file-descriptor numbers the script picks, so a number can be reused after a
close, as the kernel does. What libzmq guarantees is kept: a connection's accept is queued on the
monitor before its first frame can be read, its close after its last frame was queued for the
socket; its frames stay readable after its close until read; the socket takes messages from its
connections in turn (fair queueing). Everything else is the script's: ``at_recv(n, action)``
runs ``action`` just before the socket's n-th message is taken (events and frames that arrive
in the middle of a drain), and the poller reports what is ready when it is called.
"""

from __future__ import annotations

import struct
from collections import deque

import zmq

from kvevents import BlockStored, KVEventBatch, encode_batch

ACCEPTED, DISCONNECTED = zmq.EVENT_ACCEPTED, zmq.EVENT_DISCONNECTED


def run_batch(run: int, seq: int) -> bytes:
    """The payload of ``run``'s batch ``seq`` (``ts`` = run * 1e6 + seq, as tests.chaos.kill9 judges)."""
    return encode_batch(KVEventBatch(run * 1e6 + seq, [BlockStored([run * 1_000_000 + seq], None, [seq] * 4, 4,
                                                                   None, "GPU", None)], 0))


class Conn:
    def __init__(self, sim: "BindSim", fd: int) -> None:
        self.sim, self.fd = sim, fd
        self.frames: deque[list[bytes]] = deque()
        self.closed = False

    def send(self, topic: str, run: int, *seqs: int) -> "Conn":
        assert not self.closed, "a closed connection sends nothing more"
        for seq in seqs:
            self.frames.append([topic.encode(), seq.to_bytes(8, "big"), run_batch(run, seq)])
        return self

    def close(self) -> None:
        """The peer went away: its close is queued after every frame it sent (those stay readable)."""
        self.closed = True
        self.sim.events.append((DISCONNECTED, self.fd))


class _Frame:
    __slots__ = ("bytes", "fd", "more")

    def __init__(self, data: bytes, fd: int, more: bool) -> None:
        self.bytes, self.fd, self.more = data, fd, more

    def get(self, prop):
        assert prop == zmq.SRCFD
        return self.fd


class _Sub:
    """The bound SUB socket: messages from the connections in turn."""

    def __init__(self, sim: "BindSim") -> None:
        self.sim = sim
        self.parts: deque[bytes] = deque()
        self.fd = -1

    def recv(self, flags: int = 0, copy: bool = True):
        sim = self.sim
        if not self.parts:
            action = sim.hooks.pop(sim.taken, None)
            if action is not None:
                action()
            conn = sim.next_conn()
            if conn is None:
                raise zmq.Again()
            sim.taken += 1
            self.parts.extend(conn.frames.popleft())
            self.fd = conn.fd
        data = self.parts.popleft()
        return data if copy else _Frame(data, self.fd, bool(self.parts))

    def getsockopt(self, opt):
        if opt == zmq.RCVMORE:
            return 1 if self.parts else 0
        if opt == zmq.EVENTS:
            return zmq.POLLIN if self.sim.readable() else 0
        raise AssertionError(opt)

    def close(self, linger=None) -> None:
        pass


class _Monitor:
    def __init__(self, sim: "BindSim") -> None:
        self.sim = sim

    def recv_multipart(self, flags: int = 0, copy: bool = True):
        if not self.sim.events:
            raise zmq.Again()
        event, fd = self.sim.events.popleft()
        return [struct.pack("=hi", event, fd), b"tcp://127.0.0.1:1"]

    def getsockopt(self, opt):
        assert opt == zmq.EVENTS
        return zmq.POLLIN if self.sim.events else 0

    def close(self, linger=None) -> None:
        pass


class _Poller:
    def __init__(self, sim: "BindSim") -> None:
        self.sim = sim

    def poll(self, timeout=None):
        sim = self.sim
        ready = [(sim.monitor, zmq.POLLIN)] if sim.events else []
        if sim.readable():
            ready.append((sim.sub, zmq.POLLIN))
        return ready

    def register(self, *a) -> None:
        pass

    def unregister(self, *a) -> None:
        pass


class BindSim:
    """Takes over ``subscriber``'s bound socket, monitor and poller (see the module docstring).
    Replay sockets stay real."""

    def __init__(self, subscriber) -> None:
        self.events: deque[tuple[int, int]] = deque()
        self.conns: list[Conn] = []
        self.turn = 0
        self.taken = 0  #: messages taken by the subscriber so far
        self.hooks: dict[int, object] = {}
        self.sub, self.monitor = _Sub(self), _Monitor(self)
        s = subscriber
        self._real = (s._bind_sub, s._conns.monitor)
        for real in self._real:
            del s._by_sock[real]
        s._by_sock[self.monitor] = ("bindmon", None)
        s._by_sock[self.sub] = ("bind", None)
        s._conns.monitor = self.monitor
        s._bind_sub = self.sub
        poller = _Poller(self)
        for sock in s._by_sock:  # replay DEALERs made later register on the fake: they stay unpolled
            if sock not in (self.monitor, self.sub):
                raise AssertionError("BindSim wants a subscriber with no other sockets (a bind-only one)")
        s._poller = poller
        self.subscriber = s

    def accept(self, fd: int) -> Conn:
        """A publisher connects; it gets descriptor ``fd`` (which may be a closed one's number)."""
        assert all(c.closed or c.fd != fd for c in self.conns), f"fd {fd} is open"
        conn = Conn(self, fd)
        self.conns.append(conn)
        self.events.append((ACCEPTED, fd))
        return conn

    def at_recv(self, n: int, action) -> None:
        """Run ``action`` just before the socket's ``n``-th message (counting from 0) is taken."""
        self.hooks[n] = action

    def readable(self) -> bool:
        return any(c.frames for c in self.conns)

    def next_conn(self) -> Conn | None:
        n = len(self.conns)
        for i in range(n):
            conn = self.conns[(self.turn + i) % n]
            if conn.frames:
                self.turn = (self.turn + i + 1) % n
                return conn
        return None

    def poll_all(self, limit: int = 100) -> list:
        """Poll until nothing is left to read or report; the deliveries."""
        out = []
        for _ in range(limit):
            got = self.subscriber.poll(0)
            out += got
            if not got and not self.events and not self.readable():
                return out
        raise AssertionError("the subscriber kept producing deliveries")

    def close(self) -> None:
        s = self.subscriber
        for fake in (self.sub, self.monitor):
            s._by_sock.pop(fake, None)
        s._bind_sub, s._conns.monitor = self._real
        for real in self._real:
            s._by_sock[real] = ("bind", None)
        s.close()


class ConnectSim(BindSim):
    """The same for one connect-mode publisher ``name``: its SUB socket and its monitor. ZeroMQ
    keeps a connecting SUB's queue across reconnects, so the old connection's unread frames and
    the new one's are one pipe (``pipe``), in order; ``reconnect()`` queues the monitor's
    ``EVENT_CONNECTED`` (the first connection's is queued at the start)."""

    def __init__(self, subscriber, name: str) -> None:  # noqa: D107 - (BindSim's set-up, per peer)
        self.events = deque()
        self.conns = []
        self.turn = 0
        self.taken = 0
        self.hooks = {}
        self.sub, self.monitor = _Sub(self), _Monitor(self)
        s = subscriber
        peer = s._peers[name]
        self._real = (peer.sub, peer.monitor)
        self._peer = peer
        for real in self._real:
            del s._by_sock[real]
        s._by_sock[self.monitor] = ("monitor", peer)
        s._by_sock[self.sub] = ("live", peer)
        peer.sub, peer.monitor = self.sub, self.monitor
        s._poller = _Poller(self)
        self.subscriber = s
        self.pipe = Conn(self, 7)
        self.conns.append(self.pipe)
        self.reconnect()

    def reconnect(self) -> None:
        self.events.append((zmq.EVENT_CONNECTED, 7))

    def close(self) -> None:
        s, peer = self.subscriber, self._peer
        for fake in (self.sub, self.monitor):
            s._by_sock.pop(fake, None)
        peer.sub, peer.monitor = self._real
        s._by_sock[peer.sub] = ("live", peer)
        s._by_sock[peer.monitor] = ("monitor", peer)
        s.close()
