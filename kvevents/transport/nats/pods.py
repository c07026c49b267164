"""What the JetStream source checks per pod, in one place: order, duplicates, and trust.

Anything on the wire is hostile: a message on a pod's subject may not come from that pod's
bridge. A message is admitted only if it could follow from what this reader has seen of the
pod; one that cannot is **rejected**: counted (``rejected`` and ``rejected_<why>`` in the
source's stats, ``malformed["rejected-<why>"]`` in the pod's health), it changes nothing — no
delivery, no position, it does not even count as hearing from the pod — so it can neither
shadow the real batches that follow nor keep a dead pod looking alive, nor take a live pod out
of routing. The checks:

* ``id``: its ``Nats-Msg-Id`` is not ``<pod>:<run>:<kind>:<seq>:<16 hex digits>`` for its own
  headers (every plane writer sets one; JetStream's de-duplication works on it);
* ``run``: the pod is known and the message moves to a later run other than by a RESET to
  exactly the next run (our writers raise the run by one, RESET first);
* ``seq``: a batch or GAP of the pod's current run whose seq jumps past the next one (our
  writers put a GAP control message before any jump).

After a stream hole (the stream lost messages: see :mod:`.source`) a pod last seen before it
may have moved on in the part that was lost, so its next run and seq are taken as they come
(an exact GAP, or an implied RESET, as before). A pod met for the first time is taken as it
comes (nothing to check it against: a replica's snapshot seeds what it covered).

Two messages for the same batch under different ids (the second one is a duplicate by seq, but
not a re-send of the first: a re-send has the same id) mean one of them is not the pod's; which
one cannot be told in band: counted (``conflicts``, ``malformed["conflict"]`` in the pod's
health), the first one stands, no GAP (a forgery that comes second must not take a live pod out
of routing). A forgery that is first at a pod's next seq, with a well-formed id, is applied:
only the server's permissions (:mod:`.permissions`) keep it out of the stream. A GAP
control message with reason ``forged`` (a writer's acknowledgement showed its own message was
not stored, another was, under its id) is delivered even for seqs already delivered
(``forged_reported``).

Why not through :class:`kvevents.tracker.SeqTracker`: it infers a restart from a seq going
backwards on an in-order socket and heals by asking a replay endpoint; on the plane the run is
explicit in the headers, a seq going backwards is a duplicate (or a forgery), and the stream
itself is the replay, with holes found by stream seq (:mod:`.source`).
"""

from __future__ import annotations

from ...delivery import Delivery, DeliveryKind, PublisherHealth
from ...errors import DecodeError
from .wire import MSG_ID, id_matches, parse_headers, unpack

BATCH, RESET, GAP = DeliveryKind.BATCH, DeliveryKind.RESET, DeliveryKind.GAP

STATS = ("duplicates", "malformed", "implied_resets", "stream_gaps", "hole_gaps", "rejected", "rejected_id",
         "rejected_run", "rejected_seq", "conflicts", "forged_reported")


class PodState:
    __slots__ = ("health", "run", "last_seq", "stream_seq", "topic", "hole_at", "last_id", "last_first")

    def __init__(self, pod: str, now: float) -> None:
        self.health = PublisherHealth(pod, last_recv_ts=now)
        self.run = -1
        self.last_seq = -1
        self.stream_seq = 0  #: stream seq of the last message read for this pod (0: none, or seeded)
        self.topic = pod  #: the router topic of its last message
        self.hole_at: tuple[int, int] | None = None  #: (run, last seq) its last tail stream-hole GAP was for
        self.last_id = ""  #: the id of the last batch message admitted
        self.last_first = -1  #: its first seq


class PodChecks:
    """Per-pod state and checks of one source; ``stats`` is the source's counter dict."""

    def __init__(self, stats: dict) -> None:
        self.stats = stats
        for k in STATS:
            stats.setdefault(k, 0)
        self.pods: dict[str, PodState] = {}

    def pod(self, name: str, now: float) -> PodState:
        st = self.pods.get(name)
        if st is None:
            st = self.pods[name] = PodState(name, now)
        return st

    def seed(self, pods: dict, now: float) -> None:
        """The per-pod (run, last seq[, topic]) a snapshot covered."""
        for pod, (run, last_seq, *topic) in pods.items():
            st = self.pod(pod, now)
            st.run, st.last_seq = int(run), int(last_seq)
            st.health.last_seq = st.last_seq
            st.topic = str(topic[0]) if topic else pod

    def hole_gap(self, st: PodState, pod: str, seq: int, topic: str, now: float, out: list) -> None:
        self.stats["hole_gaps"] += 1
        st.health.gaps += 1
        out.append(Delivery(GAP, pod, topic, seq, None, now, 0, reason="stream-hole"))

    def _why_not(self, m, mid, st: PodState | None, doubted: bool) -> str | None:
        """Why a message cannot follow from what was seen of its pod (None: it may)."""
        if not id_matches(m, mid):
            return "id"
        if st is None or st.run < 0 or doubted:
            return None
        if m.run > st.run and (m.kind != "reset" or m.run != st.run + 1):
            return "run"
        if m.run == st.run and m.kind != "reset" and st.last_seq >= 0 and m.seq > st.last_seq + 1:
            return "seq"
        return None

    def reject(self, why: str, st: PodState | None) -> None:
        self.stats["rejected"] += 1
        self.stats[f"rejected_{why}"] += 1
        if st is not None:
            mal = st.health.malformed
            mal[f"rejected-{why}"] = mal.get(f"rejected-{why}", 0) + 1

    def one(self, msg, q: int, now: float, out: list, doubt_from: int | None) -> None:
        """Check one stream message (stream seq ``q``) and append what it delivers to ``out``.
        ``doubt_from``: the first seq of an open stream hole, or None."""
        hdr = msg.headers
        try:
            m = parse_headers(hdr)
        except DecodeError:
            self.stats["malformed"] += 1
            return
        st = self.pods.get(m.pod)
        doubted = doubt_from is not None and (st is None or st.stream_seq < doubt_from)
        mid = hdr.get(MSG_ID)
        why = self._why_not(m, mid, st, doubted)
        if why is not None:
            self.reject(why, st)
            return
        if st is None:
            st = self.pod(m.pod, now)
        st.stream_seq = q
        st.topic = m.router_topic
        h = st.health
        h.received += 1
        h.last_recv_ts = now
        if doubted and st.run < 0:  # first met inside a hole: what it lost before this is unknowable
            self.hole_gap(st, m.pod, m.seq, m.router_topic, now, out)
        if m.run < st.run:
            self.stats["duplicates"] += 1  # an older run, seen before
            return
        if m.kind == "reset":
            if m.run == st.run:
                self.stats["duplicates"] += 1
                return
            st.run, st.last_seq = m.run, -1  # the new run starts afresh (its early seqs may follow)
            h.resets += 1
            out.append(Delivery(RESET, m.pod, m.router_topic, m.seq, None, now))
            return
        if m.run > st.run:
            if st.run >= 0:  # the run moved on and its RESET is not in what we read (a hole)
                self.stats["implied_resets"] += 1
                h.resets += 1
                out.append(Delivery(RESET, m.pod, m.router_topic, m.seq, None, now))
                st.last_seq = -1
                if doubted:  # the new run's first batches may lie in the hole with its RESET
                    self.hole_gap(st, m.pod, m.seq, m.router_topic, now, out)
            else:
                st.last_seq = m.seq - 1  # first sight of this pod: start where the stream does
            st.run = m.run
        if m.kind == "gap":
            end = m.seq + m.missed - 1
            if end <= st.last_seq:
                if m.reason != "forged":
                    self.stats["duplicates"] += 1
                    return
                self.stats["forged_reported"] += 1  # what was delivered for these seqs was not the pod's
            h.gaps += 1
            h.unrecoverable += m.missed
            st.last_seq = max(st.last_seq, end)
            out.append(Delivery(GAP, m.pod, m.router_topic, m.seq, None, now, m.missed, reason=m.reason))
            return
        if m.count > 1:
            try:
                bodies = unpack(msg.data, m.count)
            except DecodeError:
                self.stats["malformed"] += 1
                h.malformed["packed"] = h.malformed.get("packed", 0) + 1
                return
        else:
            bodies = (msg.data,)
        seq = m.seq
        last = st.last_seq
        if seq <= last and seq == st.last_first and mid != st.last_id:
            # the same batch again under another id: not a re-send (a re-send keeps its id); one
            # of the two is not the pod's, and which one cannot be told here. Counted, in the
            # pod's health too; no GAP: a forgery that comes second must not take a live pod out
            # of routing (one that won the race was applied: only the server's permissions stop that)
            self.stats["conflicts"] += 1
            h.malformed["conflict"] = h.malformed.get("conflict", 0) + 1
            return
        if seq + len(bodies) - 1 > last:
            st.last_id, st.last_first = mid, m.seq
        if seq > last:  # the usual case: every batch of the message is new, in order
            if seq > last + 1 and last >= 0:
                self._batch(st, m, seq, bodies[0], now, out)  # the jump (after a hole): a GAP, then the batch
                seq += 1
                bodies = bodies[1:]
            pod, topic = m.pod, m.router_topic
            out.extend([Delivery(BATCH, pod, topic, s, None, now, 0, False, "", body)
                        for s, body in enumerate(bodies, seq)])
            st.last_seq = h.last_seq = seq + len(bodies) - 1
            return
        for body in bodies:
            self._batch(st, m, seq, body, now, out)
            seq += 1

    def _batch(self, st: PodState, m, seq: int, body: bytes, now: float, out: list) -> None:
        h = st.health
        if seq <= st.last_seq:
            self.stats["duplicates"] += 1
            return
        if seq > st.last_seq + 1 and st.last_seq >= 0:
            self.stats["stream_gaps"] += 1
            h.gaps += 1
            h.unrecoverable += seq - st.last_seq - 1
            out.append(Delivery(GAP, m.pod, m.router_topic, st.last_seq + 1, None, now, seq - st.last_seq - 1,
                                reason="lost"))
        st.last_seq = seq
        h.last_seq = seq
        out.append(Delivery(BATCH, m.pod, m.router_topic, seq, None, now, 0, False, "", body))
