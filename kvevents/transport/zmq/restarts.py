"""The subscriber's restart detection, beside its socket loop (``Subscriber`` mixes this in).

* :meth:`RestartDetection._check_reconnect`: a publisher reconnected (connect mode: its SUB
  socket's monitor; bind mode: :mod:`.conns`): hold live batches and replay from the last
  delivered batch, whose payload must not have changed (see :mod:`.peers`);
* :meth:`RestartDetection._reconnected`: bind mode's reconnect, with or without a replay
  endpoint to check against;
* :meth:`RestartDetection._restart`: RESET, then the new run from seq 0;
* :meth:`RestartDetection._drain_bind`: the bound socket's drain, which reads what the monitor
  queued meanwhile before it uses a frame.
"""

from __future__ import annotations

import zmq

from ...delivery import Delivery
from .peers import Peer

__all__ = ["RestartDetection"]

NOBLOCK, RCVMORE, SRCFD = zmq.NOBLOCK, zmq.RCVMORE, zmq.SRCFD
#: messages taken from one socket per poll: keeps publishers fair and the deliveries a poll
#: holds (and the garbage collector scans) small
DRAIN = 64


class RestartDetection:
    """Mixed into ``Subscriber``: uses its ``_conns``, ``_send_request``, ``_on_live``, ``tap``."""

    def _drain_bind(self, sock: zmq.Socket, now: float, out: list[Delivery]) -> None:
        """The bound socket: read a drain's frames (with their descriptors while some connection
        needs attributing), then what the monitor reported meanwhile, then use them (see .conns)."""
        conns = self._conns
        watch = conns.watching()
        recv = sock.recv
        more = sock.getsockopt
        msgs = []
        drained = False
        for _ in range(DRAIN):
            try:
                if watch:
                    first = recv(NOBLOCK, copy=False)
                    fd = first.get(SRCFD)
                    frames = [first.bytes]
                else:
                    frames = [recv(NOBLOCK)]
                    fd = -1
            except zmq.Again:
                drained = True
                break
            while more(RCVMORE):
                frames.append(recv())
            msgs.append((frames, fd))
        conns.after_drain(sock, drained)
        tap = self.tap
        for frames, fd in msgs:
            if tap is not None:
                tap(None, "pub", frames)
            self._on_live(None, frames, now, out, fd)

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
        peer.drop_old_held()  # the old run's, held for a replay it never finished
        out.extend(peer.tracker.restarted(now, verified=verified))
        peer.anchor, peer.anchor_seq = None, -1
        self._send_request(peer)
