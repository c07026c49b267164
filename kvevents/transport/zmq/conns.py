"""Bind mode: which connection each publisher's frames come over, so that a restart is seen.

A bind-mode subscriber has one SUB socket that every publisher connects to, and vLLM's frames
carry no run id: a publisher killed and restarted comes back as a new connection under the same
topic, and if its new run is already past the old seq when its first frame arrives, nothing in
the frames says so. What does say so is the connection. The bound socket's monitor (set up
before the bind, so no connection escapes it) reports each connection accepted and each one
closed, by file descriptor; a :class:`Conn` is one of them, from its accept to its close. A
publisher (:class:`~.peers.Peer`) is on one connection; its frames coming over **another
connection** is its reconnect — counted once per change of connection, however its frames and
the monitor's events interleave.

What libzmq guarantees, and what the subscriber's thread sees of it on a starved machine:

* a connection's accept is queued on the monitor before its first frame can be read; its close
  after its last frame was queued for the socket. But the monitor and the socket are read one
  after the other, and a poll's readiness snapshot, or a drain of the socket, can be overtaken
  by both. So a drain reads its frames first and uses them only after reading what the monitor
  queued meanwhile (:meth:`BindConnections.after_drain`): every connection a frame came over
  has then been reported accepted, and every close queued before it reported;
* a closed connection's unread frames stay readable after its close, taken in turn with the
  other connections' — the new run's among them. Once the socket has said "nothing more"
  (``EAGAIN``) after a close was read, the closed connection has nothing left (**exhausted**);
  so too, for a subscriber that never catches up, once more frames that could be its own were
  read than its pipe can hold (``tail_bound``: the receive HWM and a drain, twice: a reused
  number's old and new pipes are taken in turn);
* descriptor numbers are reused: the new connection of a restarted publisher usually gets the
  dead one's number. A frame's source descriptor (``zmq.SRCFD``, ~1 µs a frame, read only
  while some connection needs attributing) then names either of them.

Each frame of a publisher whose connection is not known to be open and its own (``settled``)
is classified (:meth:`BindConnections.classify`) by the connections it can have come over:

* its own connection: the same run goes on (**SAME**) — also a closed connection's frames read
  before any other connection of the publisher spoke: the old run's tail, in order;
* another connection, open or newly accepted: **NEW**, the reconnect (``RestartDetector.reconnected``:
  with a replay endpoint the fingerprint check, without one a counted RESET);
* a connection the publisher has left: its unread tail, after the reconnect: **DROP**;
* more than one of those (its closed connection not yet exhausted, and a new one that could be
  the frame's — a reused descriptor number, or an accept reported by the same drain): **DROP**
  as well: a frame that cannot be placed is never delivered. Dropped frames are counted
  (``old_conn_dropped``); the old run's are superseded by the RESET that follows, the new
  run's lie before its first delivered batch (inside the GAP, or the check's replay).

A descriptor is read while a connection has not yet named its publisher (``fresh``), while a
publisher that left a connection may still get frames from it, and while a publisher's
connection is not known (its reconnect came over an unnamed one). One publisher per connection
is assumed for a frame read without its descriptor (vLLM's case): another topic on an open
connection is taken as that connection's.

Connections are bounded: at most ``max_open`` are open; past it the longest-open one that carries
no publisher (a peer that never named one, or one its publisher left: a half-open connection whose
host died without a close) is shut down, else the newcomer (``evicted``). The subscriber's
heartbeat closes a peer that stops answering.
"""

from __future__ import annotations

import zmq

__all__ = ["BindConnections", "Conn", "SAME", "NEW", "DROP"]

_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
SAME, NEW, DROP = 0, 1, 2


class Conn:
    """One accepted connection, from its accept to its close."""

    __slots__ = ("fd", "open", "peers", "closed_at", "prev", "tail_left")

    def __init__(self, fd: int, prev: "Conn | None") -> None:
        self.fd = fd
        self.open = True
        self.peers: set = set()  #: publishers whose frames came over it
        #: ``BindConnections.epoch`` when its close was read: frames read after a later EAGAIN are not its
        self.closed_at = -1
        #: the connection that had this descriptor number before (closed), maybe not yet exhausted
        self.prev = prev
        #: once closed: frames that may still be its own before it is exhausted whatever the
        #: socket says (its unread tail is bounded by the receive HWM); -1: no bound
        self.tail_left = -1

    def may_hold(self, read_epoch: int) -> bool:
        """Can a frame read at ``read_epoch`` have come over this connection?"""
        return self.open or (read_epoch <= self.closed_at and self.tail_left != 0)


class BindConnections:
    """The bound SUB socket's connections, and the attribution of publishers' frames to them."""

    __slots__ = ("monitor", "by_fd", "fresh", "epoch", "read_epoch", "post_new", "olds", "unbound", "closes",
                 "tail_bound", "opened", "max_open", "local", "evicted")

    def __init__(self, sock: zmq.Socket, tail_bound: int = -1, max_open: int = -1) -> None:
        self.monitor = sock.get_monitor_socket(_EVENTS)  # before bind(): every accept is seen
        #: open connections, in accept order, at most ``max_open`` (-1: no bound; see :meth:`_bound`)
        self.opened: dict[int, Conn] = {}
        self.max_open = max_open
        self.local: tuple[int, object] | None = None  #: the bound address (:func:`local_address`), set after bind()
        self.evicted = 0  #: connections closed by this side at ``max_open``
        #: frames that may be a closed connection's before it counts as exhausted even if the
        #: socket never runs dry (a subscriber that never catches up); -1: none (no receive HWM)
        self.tail_bound = tail_bound
        self.by_fd: dict[int, Conn] = {}  #: the latest connection per descriptor number
        self.fresh: dict[int, Conn] = {}  #: accepted, no publisher named yet
        self.epoch = 0  #: drains of the socket that ended in EAGAIN
        self.read_epoch = 0  #: ``epoch`` when the frames being used were read
        self.post_new: tuple[Conn, ...] = ()  #: accepts reported after the frames being used were read
        self.olds: set = set()  #: publishers that left a connection not yet exhausted
        self.unbound: set = set()  #: publishers whose current connection is not known
        self.closes = 0  #: closes read

    # ---- the monitor ---------------------------------------------------------------------------

    def read_events(self) -> list[Conn]:
        """Take in what the monitor reported (non-blocking); the connections accepted."""
        from zmq.utils.monitor import recv_monitor_message

        accepted = []
        while True:
            try:
                msg = recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.Again:
                return accepted
            fd = int(msg["value"])
            if msg["event"] == zmq.EVENT_ACCEPTED:
                accepted.append(self.accepted(fd))
                if len(self.opened) > self.max_open >= 0:
                    self._bound(accepted[-1])
            elif msg["event"] == zmq.EVENT_DISCONNECTED:
                self.closed(fd)

    def accepted(self, fd: int) -> Conn:
        old = self.by_fd.get(fd)
        if old is not None:
            self.closed(fd)  # (its close not seen: it is over all the same)
            old.prev = None  # one connection back is all a frame can come from
        conn = self.by_fd[fd] = self.fresh[fd] = self.opened[fd] = Conn(fd, old)
        return conn

    def _bound(self, newest: Conn) -> None:
        """More open connections than ``max_open``: close one. The longest-open connection that
        carries no publisher (one that never named a publisher — a junk or hostile peer, or a
        silent one — or one its publisher has left: a half-open connection whose host died
        without a close), else the newcomer itself. Closed by shutting down its socket (checked
        to be a connection of the bound address first); libzmq then reports its close."""
        victim = next((c for c in self.opened.values() if not c.peers and c is not newest), newest)
        if _shutdown(victim.fd, self.local):
            self.evicted += 1
            self.closed(victim.fd)  # its frames still unread are a closed connection's tail
        else:  # not ours any more (its close not yet read): no longer counted as open
            self.opened.pop(victim.fd, None)

    def closed(self, fd: int) -> None:
        conn = self.by_fd.get(fd)
        if conn is None or not conn.open:
            return
        conn.open = False
        self.opened.pop(fd, None)
        conn.closed_at = self.epoch
        conn.tail_left = self.tail_bound
        self.closes += 1
        self.fresh.pop(fd, None)
        for peer in conn.peers:
            peer.settled = False
            peer.tracker.health.disconnects += 1

    def watching(self) -> bool:
        """Must the next drain read each frame's descriptor?"""
        if self.olds:
            self.olds = {p for p in self.olds if p.old is not None and p.old.may_hold(self.epoch)}
        return bool(self.fresh or self.olds or self.unbound)

    def after_drain(self, sock: zmq.Socket, drained: bool) -> None:
        """A drain's frames were read from ``sock`` (``drained``: it ended in EAGAIN): take in what
        the monitor queued meanwhile before any of them is used."""
        self.read_epoch = self.epoch
        if drained:
            self.epoch += 1
        if not self.monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self.post_new = ()
            return
        closes = self.closes
        self.post_new = tuple(self.read_events())
        if self.closes != closes and not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self.epoch += 1  # nothing readable after those closes were read: as good as an EAGAIN

    # ---- attribution ---------------------------------------------------------------------------

    def classify(self, peer, fd: int) -> int:
        """``peer``'s frame, read at ``read_epoch`` over descriptor ``fd`` (-1: not read): SAME,
        NEW (it reconnected: counted once per connection) or DROP (see the module docstring)."""
        r = self.read_epoch
        cur, old = peer.conn, peer.old
        if old is not None and not old.may_hold(r):
            peer.old = old = None
        if fd >= 0:
            x = self.by_fd.get(fd)
            if x is None:  # an accept not reported (the ordering says it cannot be): a connection all the same
                x = self.accepted(fd)
            cands = (x, x.prev) if x.prev is not None and x.prev.may_hold(r) else (x,)
        elif cur is not None and cur.open:
            cands = (cur,)  # one publisher per connection
        else:
            cands = tuple(c for c in (cur, old) if c is not None and c.may_hold(r))
            cands += tuple(c for c in self.post_new if not c.peers)
        for c in cands:
            if c.tail_left > 0:
                c.tail_left -= 1  # (0: exhausted, told by count)
        if len(cands) > 1:  # one publisher per connection: not one that carries others
            cands = tuple(c for c in cands if not c.peers or peer in c.peers) or cands
        if len(cands) == 1:
            x = cands[0]
        elif not cands:
            x = None  # a connection that cannot be named (it carries another topic too): a new one
        elif all(c is not cur and c is not old and not c.peers for c in cands):
            x = None  # new, whichever of those it was
        else:
            return DROP
        if x is not None and x is cur:
            peer.settled = x.open and old is None
            return SAME
        if x is not None and peer in x.peers:
            return DROP  # the unread tail of a connection it has left
        if cur is None and peer in self.unbound:  # its connection named at last: the same one
            if x is not None:
                self._bind(peer, x)
                self.unbound.discard(peer)
                peer.settled = x.open and old is None
            return SAME
        first = cur is None  # its first frame ever: nothing to reconnect from
        if cur is not None:
            if cur.open:
                cur.peers.discard(peer)  # (another publisher under its topic there: each switch counts)
            elif cur.may_hold(r):
                peer.old = cur  # its tail may still come: DROP, as told apart above
                self.olds.add(peer)
        peer.conn = None
        if x is None:
            self.unbound.add(peer)  # read descriptors until its connection is known
        else:
            self._bind(peer, x)
        peer.settled = x is not None and x.open and peer.old is None
        return SAME if first else NEW

    def _bind(self, peer, conn: Conn) -> None:
        peer.conn = conn
        conn.peers.add(peer)
        self.fresh.pop(conn.fd, None)

    def forget(self, peer) -> None:
        """``peer`` left the table (expired)."""
        for conn in (peer.conn, peer.old):
            if conn is not None:
                conn.peers.discard(peer)
        self.olds.discard(peer)
        self.unbound.discard(peer)

    def unnamed(self, fd: int) -> None:
        """A frame over ``fd`` named no publisher (malformed, refused): it is no longer fresh."""
        self.fresh.pop(fd, None)


def local_address(endpoint: str) -> tuple[int, object] | None:
    """The bound socket's own address as an accepted connection's ``getsockname()`` gives it:
    ``(AF_INET/AF_INET6, port)`` or ``(AF_UNIX, path)``; None for other transports."""
    import socket

    if endpoint.startswith("ipc://"):
        return socket.AF_UNIX, endpoint[6:]
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[6:].rpartition(":")
        return (socket.AF_INET6 if host.startswith("[") else socket.AF_INET), int(port)
    return None


def _shutdown(fd: int, local: tuple[int, object] | None) -> bool:
    """Shut down the accepted connection behind descriptor ``fd`` (libzmq's; it sees the end of
    the stream and closes it) if ``fd`` is still a connection of the bound address ``local``."""
    import os
    import socket

    if local is None:
        return False
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    try:
        family, want = local
        name = s.getsockname()
        if s.family != family or (name[1] if family != socket.AF_UNIX else name) != want:
            return False
        s.shutdown(socket.SHUT_RDWR)
        return True
    except (OSError, IndexError, TypeError):
        return False
    finally:
        s.close()  # the duplicate only
