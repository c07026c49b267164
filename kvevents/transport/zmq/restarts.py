"""The subscriber's restart detection, beside its socket loop (``Subscriber`` mixes this in).

* :meth:`RestartDetection._check_reconnect`: a publisher reconnected (connect mode: its SUB
  socket's monitor; bind mode: :mod:`.conns`): hold live batches and replay from the last
  delivered batch, whose payload must not have changed (see :mod:`.peers`);
* :meth:`RestartDetection._reconnected`: bind mode's reconnect, with or without a replay
  endpoint to check against;
* :meth:`RestartDetection._restart`: RESET, then the new run from seq 0;
* :meth:`RestartDetection._drain_bind` / :meth:`RestartDetection._drain_live`: a drain of the
  bound socket / of a connect-mode SUB socket, which reads what the monitor queued meanwhile
  before it uses a frame (a reconnect reported late still comes before the new run's frames);
* :meth:`RestartDetection._connect_reconnected`: connect mode's reconnect: the check, or without
  a replay endpoint a RESET and the frames read until the socket runs dry (or a seq goes back:
  the new run's first frame) dropped.
"""

from __future__ import annotations

import zmq

from ...delivery import Delivery
from ._recv import drain
from .peers import Peer, reconnected

__all__ = ["RestartDetection"]

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


class RestartDetection:
    """Mixed into ``Subscriber``: uses its ``_conns``, ``_send_request``, ``_on_live``, ``tap``."""

    def _drain_bind(self, sock: zmq.Socket, now: float, out: list[Delivery]) -> None:
        """The bound socket: read a drain's frames (with their descriptors while some connection
        needs attributing), then what the monitor reported meanwhile, then use them (see .conns)."""
        conns = self._conns
        msgs, fds, dry = drain(sock, DRAIN, conns.watching())
        conns.after_drain(sock, dry)
        tap = self.tap
        for i, frames in enumerate(msgs):
            if tap is not None:
                tap(None, "pub", frames)
            self._on_live(None, frames, now, out, -1 if fds is None else fds[i])

    def _drain_live(self, peer: Peer, sock: zmq.Socket, now: float, out: list[Delivery]) -> None:
        """Connect mode: read a drain of ``peer``'s SUB socket, then its monitor (a reconnect
        reported meanwhile comes before any of those frames is used), then use them."""
        read_at = peer.epoch
        msgs, _, dry = drain(sock, DRAIN)
        if dry:
            peer.epoch += 1
        if peer.monitor.getsockopt(EVENTS) & POLLIN and reconnected(peer):
            self._connect_reconnected(peer, now, out)
        tap = self.tap
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
        for frames in msgs:
            if tap is not None:
                tap(peer.name, "pub", frames)
            if stale:
                stale -= 1
                continue
            self._on_live(peer, frames, now, out)

    def _window_drops(self, peer: Peer, msgs: list, n: int, now: float) -> int:
        """No replay endpoint: how many of the first ``n`` frames read inside the reconnect's
        window are dropped. One run's seqs only go up, and the old connection's unread frames come
        before the new one's: a frame whose seq is not above every seq read before it is the new
        run's first; it closes the window, and it and what follows are delivered (after the RESET).
        Dropped frames with no such frame after them may have been the new run's: unless a live
        frame places the new run within ``replay_timeout`` (the old connection's tail, then the
        new run's first frame, the common case), their seqs are reported as a GAP (``_unplaced``)."""
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
            peer.unplaced_due = now + self.replay_timeout
            peer.unplaced_recv = peer.tracker.health.received
            self._table.active.add(peer)
        return n

    @staticmethod
    def _unplaced(peer: Peer, now: float, out: list[Delivery]) -> bool:
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

    def _connect_reconnected(self, peer: Peer, now: float, out: list[Delivery]) -> None:
        """Connect mode: ``peer``'s SUB socket connected again. With a replay endpoint, the check;
        without one nothing can verify the run: a RESET (counted as unverified). ZeroMQ keeps
        the socket's queue across the reconnect, so the old connection's unread frames come
        first, then the new one's; they are told apart once the socket has run dry after this
        (``peer.window``), or at the first frame whose seq goes back (``_window_drops``): what is
        read before that is dropped (``old_conn_dropped``) — the old run's are superseded by the
        RESET, the new run's lie inside the GAP before its first delivered batch (or, nothing
        placing the new run after them, inside the GAP ``_unplaced`` reports)."""
        tracker = peer.tracker
        tracker.health.reconnects += 1
        # frames read until the socket runs dry after this may be the old connection's tail: with a
        # replay endpoint they are held for the check (and after a restart, those continuing the
        # old run's seqs go with it); without one, dropped
        # the highest seq read so far (a window still open: its frames' too): the new run's first is not above it
        peer.window_top = max(tracker.live_high, peer.window_top if peer.epoch <= peer.window else -1)
        peer.window = peer.epoch
        peer.window_left = tail_bound(self._rcvhwm)
        if not peer.sub.getsockopt(EVENTS) & POLLIN:
            peer.epoch += 1  # nothing left to read: as good as an EAGAIN
        if peer.replay_endpoint:
            self._check_reconnect(peer, now, new_connection=True)
        elif tracker.expected is not None:  # (nothing delivered yet: nothing to reset)
            out.extend(tracker.restarted(now, verified=False))
            peer.anchor, peer.anchor_seq = None, -1

    def _check_reconnect(self, peer: Peer, now: float, new_connection: bool = False) -> None:
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
        self._send_request(peer, strict=True)

    def _reconnected(self, peer: Peer, seq: int, now: float, out: list[Delivery]) -> None:
        """Bind mode: a topic heard before came over another connection (see .conns)."""
        tracker = peer.tracker
        tracker.health.reconnects += 1
        if tracker.expected is None or seq <= tracker.live_high:
            return  # nothing delivered yet, or the seq went backwards: the tracker says RESET itself
        if peer.replay_endpoint:
            self._check_reconnect(peer, now, new_connection=True)
        else:  # nothing to verify against: the reconnect is a RESET (a blip costs a re-learn, never a splice)
            out.extend(tracker.restarted(now, verified=False))
            peer.anchor, peer.anchor_seq = None, -1

    def _restart(self, peer: Peer, now: float, out: list[Delivery], verified: bool = True) -> None:
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
        self._send_request(peer)
