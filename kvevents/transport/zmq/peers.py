"""The subscriber's publishers: a bounded table, the few that need attention, and their checks.

* A :class:`Peer` is one publisher: its SUB socket (connect mode), replay DEALER, socket
  monitor, :class:`~kvevents.tracker.SeqTracker`, and the *anchor* — the seq and payload of
  the last batch delivered — that restart detection compares against.
* :class:`PeerTable` bounds the publishers a bind-mode subscriber learns from topics
  (``max_publishers``): at the bound the longest-silent one is expired if it has been silent
  past ``stale_after`` (``publishers_expired``), else the new topic is refused
  (``publishers_refused``). It keeps the *active* set (peers with a replay outstanding or to
  send) so an idle poll costs O(active), not O(publishers), and a heap of idle-probe times.

Restart detection without a run id on the wire (vLLM's frames have none): a restarted
publisher is a new connection, so when the SUB socket's monitor reports a reconnect (bind mode:
see :mod:`.conns`) the peer is *suspect*: the subscriber holds live batches and asks for replay
from the anchor's seq; the publisher's copy of that batch must be the anchor's payload. Another
payload under that seq, or no batch at it at all (the new ring is behind, or has moved past
it), means another run: RESET, then the new run from seq 0. The monitor's event is queued before
the new connection's first message (the handshake completes before data flows), and a drain's
frames are used only after the monitor has been read again (``RestartDetector.read_live``),
so the new run's batches are held, not spliced, however late the event is read. Without a
replay endpoint the reconnect is a RESET itself (``unverified_resets``). Until the
check's answer every request the peer makes is such a check (an idle probe in flight when the
reconnect comes becomes one), and a check left unanswered with live batches held is a RESET
(``unverified_resets``): what cannot be verified is not spliced on.
A restart found while no connection was up (an idle probe answered by the next run, below)
makes the connection that comes next that run's own (:meth:`Peer.connection_came`): its check
takes an answer that begins past the anchor for that run's ring having moved on under a lagging
subscriber (the seqs between are a GAP), not for yet another run.

An idle probe is such a check too: it is sent while the publisher is quiet, maybe down, and a
request sent while the publisher is down waits in the DEALER and is answered by whatever binds
the replay endpoint next. An idle publisher of the same run still holds the anchor, so no batch
at the anchor's seq means another run there too — except where the connection the probe went
out on is still up, unbroken (:meth:`Peer.link`): a restarted process is a new connection, so
an answer that begins past the anchor is then the same run's ring having moved on while this
subscriber lags more than a ring behind (its live frames are on their way, or their loss shows
as a seq jump). That answer is *moot* (``probes_moot``): nothing is concluded or delivered from
it. (Under bursts on busy cores that lag is common; taking it for a restart RESET the pod and
then replayed from 0 into the ring's hole: a false reset and thousands of batches "lost".) So
is the answer to a probe that live traffic made moot before the answer was read (the SUB socket
is read before the replay DEALER in a poll): the anchor has moved on since. A gap's replay asks
from the first missing seq, as vLLM's subscriber does (it follows a live batch: the publisher
was up a moment ago).

Idle-tail probes: a publisher silent for ``probe_after`` seconds gets a replay request from
its next expected seq (from the anchor, so it is a restart check too); batches coming back
were lost at the end of a burst and are delivered as a healed gap. Probes back off (doubling,
up to ``max(stale_after, probe_after)``) while the publisher stays silent; a live batch resets
the interval. A probe that finds the anchor and nothing after it reports nothing.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

import zmq

from ...tracker import SeqTracker

__all__ = ["Peer", "PeerTable", "CHECK_RECONNECT", "SAME", "RESTART", "MOOT", "is_connected", "reconnected"]

#: verify (after a reconnect, or by an idle probe): a different payload, or no batch at the
#: anchor's seq, is a restart
CHECK_RECONNECT = 2
#: :meth:`Peer.verdict`'s answers
SAME, RESTART, MOOT = 0, 1, 2


class Peer:
    """Sockets, tracker and restart anchor of one publisher."""

    __slots__ = ("name", "replay_endpoint", "sub", "dealer", "monitor", "tracker", "anchor_seq", "anchor",
                 "anchor_run", "checking", "check_kind", "check_run", "connects", "probe_ivl", "probed_at", "gone", "bind",
                 "suspect", "conn", "old", "settled", "old_held", "old_next", "epoch", "window", "window_left",
                 "window_top", "unplaced_due", "unplaced_recv", "connected", "check_link", "found_unlinked",
                 "own_conn")

    def __init__(self, name: str, replay_endpoint: str | None, tracker: SeqTracker, bind: bool = False) -> None:
        self.name = name
        self.replay_endpoint = replay_endpoint
        self.sub = None
        self.dealer = None
        self.monitor = None
        self.tracker = tracker
        self.anchor_seq = -1  #: seq of the last delivered batch whose payload is ``anchor``
        self.anchor: bytes | None = None
        self.anchor_run = 0  #: the tracker's ``resets`` when the anchor was taken (a RESET voids it)
        self.checking = -1  #: the anchor seq the replay in flight must start with (-1: none)
        self.check_kind = 0
        self.check_run = 0  #: the tracker's ``resets`` when the check was asked (a RESET since: moot)
        #: an idle probe's: the connection it went out on (:meth:`link`), None for other checks
        self.check_link = None
        self.suspect = False  #: reconnected, not yet verified: every replay asked is a reconnect check
        #: the current run was found (a RESET) from its replay socket's answer while no connection
        #: was up: the next connection is its own; and the connection being checked is that one
        self.found_unlinked = False
        self.own_conn = False
        #: bind mode (see .conns): the connection its frames come over (None: not known), the one
        #: it left whose unread tail may still come, and whether its frames need no attributing
        self.conn = None
        self.old = None
        self.settled = False
        #: seqs of live batches held when the reconnect was seen: the old connection's, so the old
        #: run's if the check finds a restart (dropped with the old run's state by its RESET)
        self.old_held: tuple[int, ...] = ()
        #: after a restart was found: the old run's next seq, while its unread frames may still come
        self.old_next = -1
        self.connects = 0  #: SUB socket connections made (a second one is a reconnect)
        self.connected = False  #: connect mode: its SUB socket's connection is up (the monitor says)
        #: connect mode: drains of the SUB socket that ended in EAGAIN, and the value it had at an
        #: unverifiable reconnect (frames read up to then may be either run's: dropped; -1: none)
        self.epoch = 0
        self.window = -1
        self.window_left = -1  #: frames still to drop in that window before it closes by count (-1: no bound)
        self.window_top = -1  #: no replay endpoint: the highest seq read before or inside that window
        #: no replay endpoint: when the window's dropped frames, never placed by a live frame after
        #: them, become a GAP (0: none), and the tracker's ``received`` when they were dropped
        self.unplaced_due = 0.0
        self.unplaced_recv = 0
        self.probe_ivl = 0.0
        self.probed_at = 0.0
        self.gone = False  #: expired from the table (its heap entry is skipped)
        self.bind = bind  #: learnt from a topic on the bind socket (may be expired)

    def replay_start(self, start: int, strict: bool) -> int:
        """Where to start a replay asked from ``start``: at the anchor, when one is held, for a
        reconnect check (``strict``, or while ``suspect``) and an idle probe, so that the first
        answer verifies the run; a gap's replay starts at ``start``, as vLLM's subscriber asks."""
        if self.has_anchor() and self.anchor_seq < start and (strict or self.suspect or self.tracker.probing):
            self.checking = self.anchor_seq
            self.check_kind = CHECK_RECONNECT
            self.check_run = self.tracker.health.resets
            self.check_link = None if strict or self.suspect else self.link()
            return self.anchor_seq
        self.checking = -1
        self.check_kind = 0
        return start

    def link(self):
        """The connection up now, as a token equal only to itself while it stays up unbroken
        (connect mode: the count of connections made; bind mode: the connection); None when none
        is known to be up."""
        if self.bind:
            conn = self.conn
            return conn if conn is not None and conn.open else None
        return self.connects if self.connected else None

    def drop_old_held(self) -> tuple[int, int]:
        """A restart was found: the live batches held before the reconnect were the old run's, and
        so are those read after it that continue the old run's seqs one by one: one connection's
        frames come in order, and the old connection's unread ones before the new one's (a new run
        continuing exactly is dropped here too, and comes back in its replay from 0; if that replay
        is never answered, the tracker reports those seqs as a GAP). Not in bind mode, where each
        frame's connection is known: what was read after the reconnect is the new run's. Returns
        how many were dropped and the highest seq among those read after the reconnect (-1: none)."""
        self.suspect = False
        self.checking = -1
        pending = self.tracker.pending
        held = set(self.old_held)
        nxt = self.tracker.expected if self.tracker.expected is not None else -1
        n, top = 0, -1
        cont = not self.bind  # (bind mode: frames read after the reconnect came over the new connection, .conns)
        for seq in list(pending):  # in the order they arrived
            if seq in held or (cont and seq == nxt):
                del pending[seq]
                n += 1
                if seq not in held:
                    top = seq
                nxt = seq + 1
            else:
                break
        self.old_next = nxt
        self.old_held = ()
        return n, top

    def explained(self) -> int:
        """A live seq went backwards while a reconnect was being checked: that frame starts a new
        run (one run's seqs only go up), so the reconnect is explained and its check moot (the
        tracker RESETs by itself). What was held before the reconnect is the old run's and stays
        held (delivered before the RESET, gaps named); what was read after it and before this frame
        came between the two runs (connect mode: the old connection's tail, or a run that died in
        between; bind mode: a connection since left): it cannot be placed in the new run, and
        after the RESET it is no part of the publisher's state: dropped. Returns how many."""
        self.suspect = False
        self.checking = -1
        self.check_kind = 0
        pending = self.tracker.pending
        held = set(self.old_held)
        drop = [seq for seq in pending if seq not in held]
        for seq in drop:
            del pending[seq]
        self.old_held = ()
        return len(drop)

    def old_leftover(self, seq: int) -> bool:
        """After a restart was found: is the live frame ``seq`` one of the old run's, still unread
        then? It goes on up from the old run's seqs — not always one by one: frames lost at a
        high-water mark leave holes in a lagging subscriber's tail — and the first frame whose
        seq goes back (the new run's, from 0) ends the old run; so does the socket running dry."""
        if seq >= self.old_next:
            self.old_next = seq + 1
            return True
        self.old_next = -1
        return False

    def connection_came(self) -> None:
        """A new connection (a reconnect): the first since a restart found while none was up is
        that run's own (:meth:`verdict`); any later one may be another run's."""
        self.own_conn, self.found_unlinked = self.found_unlinked, False

    def has_anchor(self) -> bool:
        return self.anchor is not None and self.anchor_run == self.tracker.health.resets

    def verdict(self, seq: int | None, payload: bytes | None) -> int:
        """The first answer of a checked replay (``seq`` None: the end marker): SAME, RESTART, or
        MOOT (an idle probe's answer begins past the anchor on the connection it went out on,
        still up: the ring moved on; or the tracker gave the request up before this answer came:
        nothing is concluded, see the module docstring)."""
        kind, anchor_seq, link = self.check_kind, self.checking, self.check_link
        self.checking = -1
        self.check_kind = 0
        self.check_link = None
        if not self.tracker.recovering:
            # given up (live traffic made the idle probe moot, or it timed out), maybe in the very
            # poll that read this answer: the anchor has moved on since, so the batch asked for
            # cannot be compared with it
            return MOOT
        if self.check_run != self.tracker.health.resets:
            restart = False  # a RESET came first (the seq went backwards): this check is moot
        elif seq == anchor_seq:
            restart = payload != self.anchor
        elif seq is not None and seq > anchor_seq and link is not None and link == self.link() \
                and not self.suspect:
            self.tracker.health.probes_moot += 1
            return MOOT
        elif seq is not None and seq > anchor_seq and self.suspect and self.own_conn:
            # the first connection of a run found while none was up: that run's ring has moved
            # past the anchor it was replayed to (the seqs between are a GAP), not another run
            restart = False
        else:  # the anchor is not there: unverifiable, and after a reconnect that is a new run
            restart = kind == CHECK_RECONNECT
        if kind == CHECK_RECONNECT:
            self.suspect = self.own_conn = False  # verified now, one way or the other
        if not restart:
            self.old_held = ()  # the same run: what was held is delivered in order
        return RESTART if restart else SAME


class PeerTable:
    """Publishers by name, bounded for the bind-mode ones, with the active set and probe timers."""

    def __init__(self, max_publishers: int, stale_after: float, probe_after: float | None) -> None:
        self.by_name: dict[str, Peer] = {}
        self.active: set[Peer] = set()  # a replay outstanding, or a request to send
        self._lru: OrderedDict[str, Peer] = OrderedDict()  # bind-mode peers, least recently heard first
        self._timers: list[tuple[float, int, Peer]] = []
        self._n = 0
        self.max_publishers = max_publishers
        self.stale_after = stale_after
        self.probe_after = probe_after
        self.refused = 0
        self.expired = 0

    def __len__(self) -> int:
        return len(self.by_name)

    def add(self, peer: Peer, now: float) -> None:
        self.by_name[peer.name] = peer
        if peer.bind:
            self._lru[peer.name] = peer
        if self.probe_after is not None and peer.replay_endpoint:
            peer.probe_ivl = self.probe_after
            self._schedule(peer, now + self.probe_after)

    def make_room(self, now: float) -> tuple[bool, Peer | None]:
        """Room for one more bind-mode peer? ``(ok, expired peer to close or None)``."""
        if len(self.by_name) < self.max_publishers:
            return True, None
        if self._lru:
            oldest = next(iter(self._lru.values()))
            if now - oldest.tracker.health.last_recv_ts > self.stale_after:
                self.remove(oldest)
                self.expired += 1
                return True, oldest
        self.refused += 1
        return False, None

    def heard(self, peer: Peer) -> None:
        """A bind-mode peer spoke: it is the most recently heard."""
        self._lru.move_to_end(peer.name)

    def remove(self, peer: Peer) -> None:
        peer.gone = True
        self.by_name.pop(peer.name, None)
        self._lru.pop(peer.name, None)
        self.active.discard(peer)

    def totals(self, malformed: dict[str, int]) -> dict[str, int]:
        """Counters summed over publishers; ``malformed`` (the shared socket's) plus each one's, by kind."""
        out = {"publishers": len(self.by_name), "publishers_active": len(self.active),
               "publishers_refused": self.refused, "publishers_expired": self.expired}
        names = ("received", "gaps", "recovered", "unrecoverable", "resets", "probes", "join_retries", "reconnects",
                 "unverified_resets", "old_conn_dropped", "delivered", "disconnects", "probes_moot")
        out.update(dict.fromkeys(names, 0))
        kinds = dict(malformed)
        for peer in self.by_name.values():
            h = peer.tracker.health
            for k in names:
                out[k] += getattr(h, k)
            for k, v in h.malformed.items():
                kinds[k] = kinds.get(k, 0) + v
        out["malformed"] = sum(kinds.values())
        out.update({f"malformed_{k}": v for k, v in kinds.items()})
        return out

    def _schedule(self, peer: Peer, when: float) -> None:
        self._n += 1
        heapq.heappush(self._timers, (when, self._n, peer))

    def due_probes(self, now: float) -> list[Peer]:
        """Peers silent long enough to be probed now (each rescheduled); O(due), not O(publishers)."""
        out = []
        timers = self._timers
        base = self.probe_after
        cap = max(self.stale_after, base or 0.0)
        while timers and timers[0][0] <= now:
            _, _, peer = heapq.heappop(timers)
            if peer.gone:
                continue
            heard = peer.tracker.health.last_recv_ts
            if heard > peer.probed_at:  # live traffic since the last probe: the interval starts over
                peer.probe_ivl = base
                if heard + base > now:
                    self._schedule(peer, heard + base)
                    continue
            peer.probed_at = now
            self._schedule(peer, now + peer.probe_ivl)
            peer.probe_ivl = min(cap, peer.probe_ivl * 2)
            out.append(peer)
        return out


def is_connected(peer: Peer) -> bool:
    """Is the publisher's connection up? Connect mode: its SUB socket's monitor said so last
    (a lost connection, a heartbeat timeout included, is reported down); bind mode: the
    connection its frames came over is still open (:mod:`.conns`)."""
    if peer.bind:
        return peer.conn is not None and peer.conn.open
    return peer.connected


def reconnected(peer: Peer) -> bool:
    """Read the peer's SUB monitor (its connection's state, :func:`is_connected`; losses counted
    in ``disconnects``): True when a connection followed an earlier one."""
    from zmq.utils.monitor import recv_monitor_message

    again = False
    while True:
        try:
            msg = recv_monitor_message(peer.monitor, zmq.NOBLOCK)
        except zmq.Again:
            return again
        if msg["event"] == zmq.EVENT_CONNECTED:
            peer.connected = True
            peer.tracker.heard = True  # subscribed: not CONNECTING any more (STALE once gone and silent)
            peer.connects += 1
            if peer.connects > 1:
                again = True
        elif msg["event"] == zmq.EVENT_DISCONNECTED:
            if peer.connected:
                peer.tracker.health.disconnects += 1
            peer.connected = False
