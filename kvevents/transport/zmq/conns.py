"""Bind mode: which connection each publisher's frames come over, so that a restart is seen.

A bind-mode subscriber has one SUB socket that every publisher connects to, and vLLM's frames
carry no run id: a publisher killed and restarted comes back as a new connection under the same
topic, and if its new run is already past the old seq when its first frame arrives, nothing in
the frames says so. What does say so is the connection:

* the bound socket's monitor reports each accepted connection and each closed one, by file
  descriptor (``EVENT_ACCEPTED`` / ``EVENT_DISCONNECTED``); the monitor is set up before the
  bind, so no connection escapes it;
* while some accepted connection has not yet carried a frame (``fresh``), the subscriber reads
  each frame's source descriptor (``zmq.SRCFD``; about 1 µs a frame, and only then), so the
  first frame of a new connection names its topic;
* a topic heard before whose frame comes over another connection than its last one, or whose
  last connection was closed (``Peer.moved``), has **reconnected**.

What the subscriber then does (``Subscriber._reconnected``): with a replay endpoint for the
topic, the same check as connect mode (hold live batches, replay from the last delivered batch,
compare its payload: a change, or no batch there, is a RESET); without one, nothing can be
verified, so the reconnect is a RESET (``unverified_resets``) and the new frames follow it, the
seqs before them a GAP. A publisher that merely reconnected (a network blip, same run) then
costs its consumers a re-learn, never a wrong block; one whose seq went backwards is a RESET
anyway.

Ordering: libzmq queues a connection's accept event before the connection carries data, and its
disconnect event before the descriptor is closed (so before the number can be reused); the
monitor is polled before the bound socket. One publisher per connection is assumed (vLLM's
case): a connection carrying several topics is attributed to the first topic it carries.
"""

from __future__ import annotations

import zmq

from .peers import Peer

__all__ = ["BindConnections"]

_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED


class BindConnections:
    """The bound SUB socket's connections: accepted ones not yet attributed, and peers by connection."""

    __slots__ = ("monitor", "fresh", "by_fd")

    def __init__(self, sock: zmq.Socket) -> None:
        self.monitor = sock.get_monitor_socket(_EVENTS)  # before bind(): every accept is seen
        self.fresh: set[int] = set()  #: accepted connections whose first frame has not come yet
        self.by_fd: dict[int, set[Peer]] = {}  #: peers by the connection they were last heard on

    def read_events(self) -> None:
        """Take in what the monitor reported (non-blocking)."""
        from zmq.utils.monitor import recv_monitor_message

        while True:
            try:
                msg = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            fd = int(msg["value"])
            if msg["event"] == zmq.EVENT_ACCEPTED:
                self._closed(fd)  # a mapping still on this number is stale: its close was not seen
                self.fresh.add(fd)
            elif msg["event"] == zmq.EVENT_DISCONNECTED:
                self.fresh.discard(fd)
                self._closed(fd)

    def _closed(self, fd: int) -> None:
        for peer in self.by_fd.pop(fd, ()):
            if peer.fd == fd:
                peer.fd = -1
                peer.moved = True

    def attribute(self, peer: Peer, fd: int) -> bool:
        """``peer``'s frame came over connection ``fd``: True when that is a reconnection (another
        connection than its last one, for a peer that has delivered before)."""
        self.fresh.discard(fd)
        old = peer.fd
        if old == fd:
            return False
        if old >= 0:
            self.forget(peer)
        peer.fd = fd
        self.by_fd.setdefault(fd, set()).add(peer)
        return old >= 0 or peer.tracker.expected is not None

    def forget(self, peer: Peer) -> None:
        """``peer`` left the table (expired), or moved off its connection."""
        peers = self.by_fd.get(peer.fd)
        if peers is not None:
            peers.discard(peer)
            if not peers:
                del self.by_fd[peer.fd]
