"""Per-publisher sequence tracking: the subscriber's logic, with no sockets in it.

The socket layer (:mod:`kvevents.subscriber`) feeds a :class:`SeqTracker` what arrives —
live batches, replayed batches, the replay end marker, the passing of time — and sends a
replay request whenever ``tracker.request`` is set. The tracker returns deliveries, in
sequence order, without duplicates:

* a live seq equal to the next expected one is delivered at once;
* a live seq past it is a gap: with a replay endpoint the tracker asks for replay from the
  first missing seq and holds live batches until the answer ends; the replayed batches are
  delivered first, then the held ones. What replay could not cover becomes a GAP delivery
  with its size; a held gap may be asked for once more before it is given up;
* a live seq at or below the last live seq means the publisher restarted (ZeroMQ keeps one
  publisher's messages in order): a RESET delivery, then the stream starts again from seq 0
  (missing early seqs of the new run are a gap as above); a live seq above the last live one
  but below the expected one was already delivered by a replay that ran ahead: dropped;
* a malformed payload (seq known, batch undecodable) is a GAP of one with reason "malformed";
* ``restarted()`` (the socket layer found the last delivered batch changed under its seq: a
  restart that kept the seq going up) is a RESET, then the new run from seq 0 by replay;
* ``check()`` asks for replay with no known gap (after a reconnect, or a quiet publisher's idle
  probe): whatever comes back past the last delivered seq is delivered as a healed gap;
* a late join whose initial replay was not answered (the socket layer asks again with
  ``rejoin()`` while nothing was delivered) and that then gives up with live batches held
  reports the start of the stream it never saw as a GAP from seq 0.

What arrives (``item``) is a decoded :class:`KVEventBatch`, or the payload bytes for a raw
subscriber (the tracker does not look inside), or None for an undecodable payload. A BATCH
delivery carries a decoded item in ``Delivery.batch`` and raw bytes in ``Delivery.payload``,
never one in the other's field.

The same tracker heals every stream in the project: the live :class:`kvevents.Subscriber`
(and the recorder, a consumer of a raw one), a recording read back
(:class:`kvevents.recordstream.DeliveryStream`, the record's time as the clock), and
hand-made streams whose batches arrive out of order (``consumers.recordtools.SeqHealer``,
through :meth:`SeqTracker.on_fill`).
"""

from __future__ import annotations

from .delivery import Delivery, DeliveryKind, HealthState, PublisherHealth
from .events import KVEventBatch

BATCH, RESET, GAP = DeliveryKind.BATCH, DeliveryKind.RESET, DeliveryKind.GAP


class SeqTracker:
    __slots__ = ("publisher", "topic", "can_replay", "health", "heard", "expected", "live_high", "recovering", "late",
                 "pending", "attempts", "request", "deadline", "replay_timeout", "max_pending",
                 "max_attempts", "probing", "unseen", "covers")

    def __init__(self, publisher: str, topic: str = "", *, can_replay: bool = False, late_join: bool = False,
                 replay_timeout: float = 2.0, max_pending: int = 10_000, max_attempts: int = 2,
                 now: float = 0.0) -> None:
        self.publisher = publisher
        self.topic = topic
        self.can_replay = can_replay
        self.health = PublisherHealth(publisher, last_recv_ts=now)
        #: the publisher answered: a replay answer or end marker, or a probe (live frames count in health.received)
        self.heard = False
        self.expected: int | None = None  # next seq to deliver; None before the first
        self.live_high = -1  # highest seq seen on the live socket (since the last restart)
        self.recovering = False
        self.late = False  # recovering for a late join: the first replayed seq sets `expected`
        self.pending: dict[int, tuple[KVEventBatch | bytes | None, float, bool]] = {}  # seq -> (item, time, replayed)
        self.attempts = 0  # replays asked for the gap now held (see _drain)
        #: the highest live seq held when the replay in flight was asked: its answer reaches at least
        #: that far (the publisher rings every batch before it sends it live); a hole past it opened
        #: after the request
        self.covers = -1
        self.request: int | None = None  # a replay request the socket layer must send
        self.deadline = 0.0
        self.replay_timeout = replay_timeout
        self.max_pending = max_pending
        self.max_attempts = max_attempts
        self.probing = False  # recovering for a check(): no gap known (health stays SYNCED)
        #: after an unverified restart: the new run's seqs below this were read and dropped (they could
        #: not be told from the old run's); a replay from 0 that is never answered reports them as a GAP
        self.unseen = 0
        if late_join and can_replay:
            self.late = True
            self._recover(0, now)

    # ---- inputs ---------------------------------------------------------------------------

    def on_live(self, seq: int, batch: KVEventBatch | None, now: float, topic: str = "") -> list[Delivery]:
        h = self.health
        h.received += 1
        h.last_recv_ts = now
        if topic:
            self.topic = topic
        out: list[Delivery] = []
        if seq == self.expected and seq > self.live_high and not self.recovering and batch is not None:
            self.expected = seq + 1  # the common case: next in line
            self.live_high = seq
            h.last_seq = seq
            h.delivered += 1
            self.attempts = 0
            if type(batch) is bytes:  # raw mode: the payload travels undecoded
                return [Delivery(BATCH, self.publisher, self.topic, seq, None, now, 0, False, "", batch)]
            return [Delivery(BATCH, self.publisher, self.topic, seq, batch, now)]
        if self.probing:  # the quiet publisher spoke again: the idle probe is moot
            self.probing = self.recovering = False
            self.request = None
            h.received -= 1
            return self.on_live(seq, batch, now, topic)
        if seq <= self.live_high:
            # the live stream itself went backwards (ZeroMQ keeps one publisher's messages in
            # order): the publisher restarted
            if self.recovering:
                self._abandon(out, now)
            self._reset(out, seq, now)
            self.live_high = seq
            return self._accept(out, seq, batch, now)
        self.live_high = seq
        if self.expected is not None and seq < self.expected and not self.late:
            return out  # already delivered from a replay that ran ahead of the live socket
        if self.recovering:
            self.pending[seq] = (batch, now, False)
            if len(self.pending) > self.max_pending:
                self._abandon(out, now)
            return out
        return self._accept(out, seq, batch, now)

    def on_replay(self, seq: int, batch: KVEventBatch | None, now: float) -> list[Delivery]:
        out: list[Delivery] = []
        self.heard = True
        self.health.last_answer_ts = now
        if not self.recovering:
            return out  # a late answer to a request already given up: ignored
        self.health.last_recv_ts = now
        if self.expected is None:
            self.expected = seq
            self.late = False
        if seq < self.expected:
            return out
        if self.probing:  # a check found batches the live socket never brought: a gap after all
            self.probing = False
            self.health.gaps += 1
        if seq > self.expected:
            self._gap(out, self.expected, seq - self.expected, now, "lost")
        self.health.recovered += 1
        self._emit(out, seq, batch, now, replayed=True)
        self.deadline = now + self.replay_timeout  # progress: keep waiting for the end marker
        return out

    def on_replay_end(self, now: float) -> list[Delivery]:
        out: list[Delivery] = []
        self.heard = True
        self.health.last_answer_ts = now
        if self.recovering:
            if self.late and self.expected is None:
                # an empty ring: nothing was published when we asked, so the stream starts at 0
                # and whatever live batch we hold beyond it is a gap to ask for again
                self.expected = 0
            self.recovering = False
            self.late = False
            self.probing = False
            self.unseen = 0  # the publisher answered: what its ring held is what there is
            self._drain(out, now, may_retry=True)
        return out

    def on_fill(self, seq: int, item, now: float, replayed: bool = True) -> list[Delivery]:
        """A batch inside the hole being recovered that came another way than a replay answer
        (a hand-made stream whose batches arrive out of order): held with the live batches;
        the run from the expected seq on is delivered as soon as it is complete, and the
        recovery ends when nothing is held any more. Ignored (returns nothing) when it is not
        inside such a hole or is held already."""
        out: list[Delivery] = []
        exp = self.expected
        if not self.recovering or exp is None or seq < exp or seq in self.pending:
            return out
        pending = self.pending
        pending[seq] = (item, now, replayed)
        if seq == exp:
            while exp in pending:
                item, t, rep = pending.pop(exp)
                self._emit(out, exp, item, t, rep)
                exp += 1
            if not pending:
                self.recovering = False
                self.late = False
                self.request = None
                self.attempts = 0
        elif len(pending) > self.max_pending:
            self._abandon(out, now)
        return out

    def rejoin(self, now: float) -> bool:
        """Ask again for everything from seq 0, as a late joiner does, when nothing has been
        delivered yet and no request is outstanding (the first one went unanswered: the
        publisher was not up). True when a request is now set."""
        if not self.can_replay or self.recovering or self.expected is not None or self.pending:
            return False
        self.late = True
        self._recover(0, now)
        return True

    def tick(self, now: float) -> list[Delivery]:
        """Called as time passes: gives up a replay whose answer did not come in time."""
        out: list[Delivery] = []
        if self.recovering and now >= self.deadline:
            self.health.replay_timeouts += 1
            self._abandon(out, now)
        return out

    def restarted(self, now: float, *, verified: bool = True, unseen: int = 0) -> list[Delivery]:
        """The publisher restarted without its seq going backwards: RESET, then its new run from 0
        (by replay; without a replay endpoint the next live batch's seqs before it are a GAP).
        ``verified=False``: a reconnect that could not be checked is taken for a restart (counted).
        ``unseen``: the new run's seqs below it may have been read and dropped by the socket layer
        (not told from the old run's): if the replay from 0 is given up, they are a GAP, and a
        live seq below it is another restart.

        Live batches held for a replay belong to the new run: they stay held.
        """
        out: list[Delivery] = []
        self.health.resets += 1
        self.health.last_seq = -1  # the new run's: none delivered yet
        if not verified:
            self.health.unverified_resets += 1
        out.append(Delivery(RESET, self.publisher, self.topic, 0, None, now))
        self.expected = 0
        self.live_high = max(max(self.pending, default=-1), unseen - 1)
        self.unseen = unseen
        self.attempts = 0
        self.probing = False
        self.late = False
        if self.can_replay:
            self._recover(0, now)
        return out

    def unplaced(self, upto: int, now: float) -> list[Delivery]:
        """The socket layer dropped live seqs below ``upto`` after a RESET it could not verify (they
        could not be told from the old run's) and no later batch placed the new run: what is not
        delivered below ``upto`` is a GAP, and a live seq below it later is another restart."""
        out: list[Delivery] = []
        if self.expected is not None and self.expected < upto and not self.recovering:
            self._gap(out, self.expected, upto - self.expected, now, "lost")
            self.live_high = max(self.live_high, upto - 1)
        return out

    def check(self, now: float, *, probe: bool = False) -> bool:
        """Ask for replay from the next expected seq with no gap known (False: nothing to ask)."""
        if self.recovering or self.expected is None or not self.can_replay:
            return False
        self.probing = probe
        if probe:
            self.health.probes += 1
        self._ask(self.expected, now)
        return True

    def state(self, now: float, stale_after: float, connected: bool | None = None) -> HealthState:
        """Liveness from evidence, never from silence alone: a publisher is STALE only when,
        for longer than ``stale_after``, nothing was received, its replay socket did not answer
        (idle probes back off up to ``stale_after``: an answer within twice that plus the replay
        timeout counts) and the transport does not say its connection is up (``connected``:
        True up, False down, None not known). A connection up is also enough to leave
        CONNECTING: subscribed, the publisher is routable with what it has told (nothing yet)."""
        if self.recovering and not self.probing:
            return HealthState.RECOVERING
        h = self.health
        if not self.heard and not h.received and not connected:
            return HealthState.CONNECTING  # never SYNCED with a publisher we have not heard
        if now - h.last_recv_ts <= stale_after or connected:
            return HealthState.SYNCED
        if h.last_answer_ts and now - h.last_answer_ts <= 2 * stale_after + self.replay_timeout:
            return HealthState.SYNCED  # quiet, but its replay socket answers: alive
        return HealthState.STALE

    # ---- internals --------------------------------------------------------------------------

    def _accept(self, out: list[Delivery], seq: int, batch, now: float) -> list[Delivery]:
        exp = self.expected
        if exp is None or seq == exp:
            self._emit(out, seq, batch, now)
        elif seq > exp:
            self.health.gaps += 1
            if self.can_replay and self.attempts < self.max_attempts:
                self.pending[seq] = (batch, now, False)
                self._recover(exp, now)
            else:
                self._gap(out, exp, seq - exp, now, "lost")
                self._emit(out, seq, batch, now)
        else:
            if seq < 0:  # never from the wire (8 unsigned bytes): recursing on it would never end
                raise ValueError(f"seq must be an unsigned 64-bit int, got {seq}")
            self._reset(out, seq, now)  # expected is 0 now, and 0 <= seq: one level deep
            return self._accept(out, seq, batch, now)
        return out

    def _emit(self, out: list[Delivery], seq: int, batch, now: float, replayed: bool = False) -> None:
        self.expected = seq + 1
        self.health.last_seq = seq
        if batch is not None:
            self.health.delivered += 1
        if batch is None:
            out.append(Delivery(GAP, self.publisher, self.topic, seq, None, now, 1, False, "malformed"))
        elif type(batch) is bytes:  # raw mode: the payload travels undecoded
            out.append(Delivery(BATCH, self.publisher, self.topic, seq, None, now, 0, replayed, "", batch))
        else:
            out.append(Delivery(BATCH, self.publisher, self.topic, seq, batch, now, 0, replayed))
        if not self.recovering:
            self.attempts = 0

    def _gap(self, out: list[Delivery], first: int, missed: int, now: float, reason: str) -> None:
        self.health.unrecoverable += missed
        out.append(Delivery(GAP, self.publisher, self.topic, first, None, now, missed, False, reason))
        self.expected = first + missed

    def _reset(self, out: list[Delivery], seq: int, now: float) -> None:
        self.health.resets += 1
        self.health.last_seq = -1  # the new run's: none delivered yet
        self.unseen = 0
        self.pending.clear()
        self.attempts = 0
        out.append(Delivery(RESET, self.publisher, self.topic, seq, None, now))
        self.expected = 0

    def _recover(self, start: int, now: float) -> None:
        self.attempts += 1
        self._ask(start, now)

    def _ask(self, start: int, now: float) -> None:
        """A replay from ``start`` for the socket layer to send (one in flight at a time)."""
        self.recovering = True
        self.health.replay_requests += 1
        self.request = start
        self.covers = max(self.pending, default=-1)
        self.deadline = now + self.replay_timeout

    def _abandon(self, out: list[Delivery], now: float) -> None:
        """Replay did not answer (or too much piled up): deliver what is held, gaps named."""
        if self.late and self.expected is None and self.pending:
            self.expected = 0  # a late join never heard the stream's start: that is a gap too
        self.recovering = False
        self.late = False
        self.probing = False
        self.request = None
        self._drain(out, now, may_retry=False)
        if self.unseen:  # after an unverified restart: seqs read and dropped, never replayed
            if self.expected is not None and self.expected < self.unseen:
                self._gap(out, self.expected, self.unseen - self.expected, now, "lost")
            self.unseen = 0

    def _drain(self, out: list[Delivery], now: float, *, may_retry: bool) -> None:
        for seq in sorted(self.pending):
            if self.expected is not None and seq < self.expected:
                del self.pending[seq]
                continue
            if self.expected is not None and seq > self.expected:
                if self.expected > self.covers:
                    # a hole among live batches that came after the request (a lagging subscriber's
                    # stream losing more while the replay ran): a new gap, with its own attempts;
                    # the limit is for a gap the answer should have filled and did not
                    self.attempts = 0
                if may_retry and self.can_replay and self.attempts < self.max_attempts:
                    self._recover(self.expected, now)
                    return
                self._gap(out, self.expected, seq - self.expected, now, "lost")
            batch, _, replayed = self.pending.pop(seq)
            self._emit(out, seq, batch, now, replayed)
        self.attempts = 0
