"""Restart detection: the role that tells a publisher's next run from the one it follows.

A :class:`RestartDetector` belongs to one ``Subscriber``, which hands it, at construction, what it
may do there: ``ask`` a replay (the subscriber's request path), ``forget`` a replay socket's
answers, ``attend`` a publisher at the next poll, and ``use`` a live frame (the subscriber's frame
handler). The subscriber calls it when:

* :meth:`~RestartDetector.read_live` / :meth:`~RestartDetector.read_bound`: a connect-mode SUB
  socket / the bound socket is readable. It reads a drain, then what the monitor queued meanwhile,
  and only then uses the frames (a reconnect reported late still comes before the new run's
  frames); after an unverifiable reconnect it drops what cannot be placed;
* :meth:`~RestartDetector.monitor`: a connect-mode SUB socket's monitor is readable: on a
  reconnect the check (hold live batches, replay from the last delivered batch, whose payload must
  not have changed, see :mod:`.peers`), or without a replay endpoint a RESET;
* :meth:`~RestartDetector.reconnected`: bind mode's reconnect (:mod:`.conns` says NEW);
* :meth:`~RestartDetector.held`: a live frame came while a reconnect is not verified yet;
* :meth:`~RestartDetector.restart`: the check found another run (or could not be answered): RESET,
  then the new run from seq 0;
* :meth:`~RestartDetector.unplaced`: a publisher with no replay endpoint whose reconnect window's
  dropped frames were never placed by a live frame (a GAP at the deadline).
"""

from __future__ import annotations

from collections.abc import Callable

import zmq

from ...delivery import Delivery
from ._recv import drain
from .conns import BindConnections
from .peers import Peer, reconnected

__all__ = ["RestartDetector", "tail_bound", "DRAIN"]

EVENTS, POLLIN = zmq.EVENTS, zmq.POLLIN
#: messages taken from one socket per poll: keeps publishers fair and the deliveries a poll
#: holds (and the garbage collector scans) small
DRAIN = 64


def tail_bound(rcvhwm: int, pipes: int = 1) -> int:
    """Frames read after a reconnect was seen, beyond which the old connection's unread tail is
    surely gone even if the socket never runs dry: its pipe holds at most the receive HWM (and a
    half HWM of unacknowledged reads), plus a drain read before the event was; a reused
    descriptor number has the old and the new pipe taken in turn (``pipes`` 2). -1: no HWM."""
    return pipes * (rcvhwm * 3 // 2 + 2 + DRAIN) if rcvhwm > 0 else -1


class RestartDetector:
    """Restart detection for one subscriber's publishers (see the module docstring).

    ``ask(peer, strict)`` sends the replay request the peer's tracker holds (``strict``: a
    reconnect check); ``forget(peer)`` drops its replay socket, so no answer to an abandoned
    request arrives; ``attend(peer)`` has the next poll look at it; ``use(peer, frames, now, out,
    fd)`` handles a live frame (``peer`` None: the bound socket's, named by its topic). ``conns``:
    bind mode's connections (:mod:`.conns`), else None. ``tail``: frames after a reconnect beyond
    which the old connection's tail is surely gone (:func:`tail_bound`)."""

    __slots__ = ("_ask", "_forget", "_attend", "_use", "_conns", "_tail", "_replay_timeout", "_max_pending")

    def __init__(self, *, ask: Callable[[Peer, bool], None], forget: Callable[[Peer], None],
                 attend: Callable[[Peer], None], use: Callable[..., None], conns: BindConnections | None,
                 tail: int, replay_timeout: float, max_pending: int) -> None:
        self._ask, self._forget, self._attend, self._use = ask, forget, attend, use
        self._conns = conns
        self._tail = tail
        self._replay_timeout = replay_timeout
        self._max_pending = max_pending

    # ---- the reads -----------------------------------------------------------------------------

    def read_bound(self, sock: zmq.Socket, now: float, out: list[Delivery], tap) -> None:
        """The bound socket: read a drain's frames (with their descriptors while some connection
        needs attributing), then what the monitor reported meanwhile, then use them (see .conns)."""
        conns = self._conns
        msgs, fds, dry = drain(sock, DRAIN, conns.watching())
        conns.after_drain(sock, dry)
        use = self._use
        for i, frames in enumerate(msgs):
            if tap is not None:
                tap(None, "pub", frames)
            use(None, frames, now, out, -1 if fds is None else fds[i])

    def read_live(self, peer: Peer, sock: zmq.Socket, now: float, out: list[Delivery], tap) -> None:
        """Connect mode: read a drain of ``peer``'s SUB socket, then its monitor (a reconnect
        reported meanwhile comes before any of those frames is used), then use them."""
        read_at = peer.epoch
        msgs, _, dry = drain(sock, DRAIN)
        if dry:
            peer.epoch += 1
        if peer.monitor.getsockopt(EVENTS) & POLLIN and reconnected(peer):
            self._connect_reconnected(peer, now, out)
        # read before the old connection was known to be exhausted after an unverifiable
        # reconnect: the old run's tail or the new run's start, which cannot be told apart
        stale = 0
        if read_at <= peer.window:
            n = len(msgs) if peer.window_left < 0 else min(len(msgs), peer.window_left)
            if peer.window_left >= 0:
                peer.window_left -= n
                if not peer.window_left:
                    peer.window = -1  # exhausted by count: the socket never ran dry
            if not peer.replay_endpoint:
                stale = self._window_drops(peer, msgs, n, now)
                peer.tracker.health.old_conn_dropped += stale
        elif peer.old_next >= 0:
            peer.old_next = -1  # the old connection's tail is gone: no frame read now is the old run's
        use = self._use
        for frames in msgs:
            if tap is not None:
                tap(peer.name, "pub", frames)
            if stale:
                stale -= 1
                continue
            use(peer, frames, now, out)

    # ---- what the subscriber tells it ------------------------------------------------------------

    def monitor(self, peer: Peer, now: float, out: list[Delivery]) -> None:
        """Connect mode: ``peer``'s SUB monitor is readable: its connection's state, and on a
        connection that followed an earlier one the reconnect (:meth:`_connect_reconnected`)."""
        if reconnected(peer):
            self._connect_reconnected(peer, now, out)

    def reconnected(self, peer: Peer, seq: int, now: float, out: list[Delivery]) -> None:
        """Bind mode: a topic heard before came over another connection (see .conns)."""
        tracker = peer.tracker
        tracker.health.reconnects += 1
        peer.connection_came()
        if tracker.expected is None or seq <= tracker.live_high:
            return  # nothing delivered yet, or the seq went backwards: the tracker says RESET itself
        if peer.replay_endpoint:
            self._check(peer, now, new_connection=True)
        else:  # nothing to verify against: the reconnect is a RESET (a blip costs a re-learn, never a splice)
            out.extend(tracker.restarted(now, verified=False))
            peer.anchor, peer.anchor_seq = None, -1

    def held(self, peer: Peer, seq: int, now: float, out: list[Delivery]) -> None:
        """A live frame ``seq`` came while ``peer``'s reconnect is not verified (``suspect``): hold
        it and check again; never spill what is unverified."""
        tracker = peer.tracker
        if seq <= tracker.live_high:
            # the seq went backwards: this frame starts a new run, which the tracker RESETs to;
            # the check is moot (a dead publisher's replay socket would never answer it)
            tracker.health.old_conn_dropped += peer.explained()
            self._forget(peer)
        elif not tracker.recovering:
            self._check(peer, now)
        elif len(tracker.pending) >= self._max_pending:
            self.restart(peer, now, out, verified=False)

    def restart(self, peer: Peer, now: float, out: list[Delivery], verified: bool = True) -> None:
        """The anchor's payload changed under its seq (or could not be checked): RESET, then the new run from 0."""
        dropped, top = peer.drop_old_held()  # the old run's, held for a replay it never finished
        peer.tracker.health.old_conn_dropped += dropped
        if peer.bind or peer.epoch > peer.window:
            # the old connection's tail cannot come any more (bind mode: its frames are told by
            # connection, .conns): a live frame continuing the old run's seqs is the new run's
            peer.old_next = -1
        # unverified: frames read after the reconnect that continued the old run's seqs may have
        # been the new run's; if its replay never answers either, those seqs are a GAP (tracker)
        out.extend(peer.tracker.restarted(now, verified=verified, unseen=0 if verified else top + 1))
        peer.anchor, peer.anchor_seq = None, -1
        # found while no connection is up (an idle probe answered by the next run): the connection
        # that comes next is this run's, and its check must not take this run's moving ring for another
        peer.found_unlinked, peer.own_conn = peer.link() is None, False
        self._ask(peer, False)

    @staticmethod
    def unplaced(peer: Peer, now: float, out: list[Delivery]) -> bool:
        """A reconnect window's dropped frames (no replay endpoint) still unplaced: True while it
        waits. A live frame used since places the new run itself (the tracker names any gap
        before it); none by the deadline (the publisher died with them): the seqs up to the
        highest dropped one are a GAP, and a later live seq at or below it another restart."""
        tracker = peer.tracker
        if tracker.health.received != peer.unplaced_recv:
            peer.unplaced_due = 0.0
            return False
        if now < peer.unplaced_due:
            return True
        peer.unplaced_due = 0.0
        out.extend(tracker.unplaced(peer.window_top + 1, now))
        return False

    # ---- internals -----------------------------------------------------------------------------

    def _window_drops(self, peer: Peer, msgs: list, n: int, now: float) -> int:
        """No replay endpoint: how many of the first ``n`` frames read inside the reconnect's
        window are dropped. One run's seqs only go up, and the old connection's unread frames come
        before the new one's: a frame whose seq is not above every seq read before it is the new
        run's first; it closes the window, and it and what follows are delivered (after the RESET).
        Dropped frames with no such frame after them may have been the new run's: unless a live
        frame places the new run within ``replay_timeout`` (the old connection's tail, then the
        new run's first frame, the common case), their seqs are reported as a GAP (:meth:`unplaced`)."""
        top = peer.window_top
        for i in range(n):
            frames = msgs[i]
            if len(frames) == 3 and len(frames[1]) == 8:
                seq = int.from_bytes(frames[1], "big")
                if seq <= top:
                    peer.window = -1
                    peer.window_top = -1
                    peer.unplaced_due = 0.0
                    return i
                top = seq
        peer.window_top = top
        if n and top >= 0:
            peer.unplaced_due = now + self._replay_timeout
            peer.unplaced_recv = peer.tracker.health.received
            self._attend(peer)
        return n

    def _connect_reconnected(self, peer: Peer, now: float, out: list[Delivery]) -> None:
        """Connect mode: ``peer``'s SUB socket connected again. With a replay endpoint, the check;
        without one nothing can verify the run: a RESET (counted as unverified). ZeroMQ keeps
        the socket's queue across the reconnect, so the old connection's unread frames come
        first, then the new one's; they are told apart once the socket has run dry after this
        (``peer.window``), or at the first frame whose seq goes back (:meth:`_window_drops`): what
        is read before that is dropped (``old_conn_dropped``) — the old run's are superseded by the
        RESET, the new run's lie inside the GAP before its first delivered batch (or, nothing
        placing the new run after them, inside the GAP :meth:`unplaced` reports)."""
        tracker = peer.tracker
        tracker.health.reconnects += 1
        peer.connection_came()
        # frames read until the socket runs dry after this may be the old connection's tail: with a
        # replay endpoint they are held for the check (and after a restart, those continuing the
        # old run's seqs go with it); without one, dropped
        # the highest seq read so far (a window still open: its frames' too): the new run's first is not above it
        peer.window_top = max(tracker.live_high, peer.window_top if peer.epoch <= peer.window else -1)
        peer.window = peer.epoch
        peer.window_left = self._tail
        if not peer.sub.getsockopt(EVENTS) & POLLIN:
            peer.epoch += 1  # nothing left to read: as good as an EAGAIN
        if peer.replay_endpoint:
            self._check(peer, now, new_connection=True)
        elif tracker.expected is not None:  # (nothing delivered yet: nothing to reset)
            out.extend(tracker.restarted(now, verified=False))
            peer.anchor, peer.anchor_seq = None, -1

    def _check(self, peer: Peer, now: float, new_connection: bool = False) -> None:
        """The publisher reconnected: maybe another run. Hold live batches, replay from the anchor
        and compare (strictly: no batch there is a restart too); until that answer, the peer is
        ``suspect`` and every request it makes is such a check."""
        tracker = peer.tracker
        if not peer.has_anchor() or tracker.expected is None:
            return
        peer.suspect = True
        if new_connection:  # what is held so far came over the old one
            peer.old_held = tuple(tracker.pending)
        tracker.probing = False  # an idle probe in flight becomes this check: live batches are held
        if not tracker.check(now):  # a replay already in flight: ask again, from the anchor
            tracker.request = tracker.expected
            tracker.deadline = now + tracker.replay_timeout
        self._ask(peer, True)
