"""The router's event source on the plane: a JetStream durable consumer, read as deliveries.

``JetStreamSource(url, durable="replica-a", start_seq=...)`` gives what a ZeroMQ
:class:`~kvevents.Subscriber` gives — BATCH (raw payloads), RESET, GAP deliveries, per-pod
order, ``health()`` per pod — but read from the stream, so a router that starts late, or again,
reads everything the stream still holds from ``start_seq`` (a snapshot's covered seq + 1).

Flow: nats-py runs on a dedicated thread; a pull task keeps pull requests of ``fetch_batch``
messages outstanding and every message goes into a queue as it arrives, bounded by
``max_queued`` messages and ``max_queued_bytes`` bytes (queued plus requested: when it is full
no new request goes out — counted in ``stats()['queue_full_waits']`` — and the server holds the
rest: the consumer's ``max_ack_pending`` is the in-flight window). Each request also carries a
byte budget (``pull_bytes``; the server ends the request with a 409 when the next message would
pass it): without one, a backlog of large (packed) messages came as whole requests' worth at
once, past the server's per-connection outbound limit (64 MB by default), which cut the
connection as a slow consumer. A message larger than a whole budget doubles the budget
(``stats()['pull_bytes_raised']``). ``poll()`` hands the caller what is queued. The
consumer acknowledges "all up to here" (AckAll): with ``auto_ack`` every ``poll()`` first
acknowledges what the previous one returned (the caller applied it before polling again, as
``KVRouter.run`` does); otherwise call ``ack()`` after applying. ``position`` is the stream seq
of the last delivery returned, ``acked`` that of the last one acknowledged.

Per pod the source checks what it reads (:mod:`.pods`, one place): a batch at or below the pod's
last (run, seq) is a duplicate (counted, skipped); a run that moves on without a RESET message
(the RESET was lost in a stream hole) gets a RESET delivery first; a seq that jumps after a hole
is a GAP delivery. A message that cannot follow from what was seen of its pod (an id that is not
the plane's for its headers, a run or seq that jumps with no hole to explain it) is rejected:
counted, and it changes nothing. A message whose headers are malformed is counted and skipped.
Nothing is dropped without a counter.

Loss in the middle of the stream (the stream's own limits — max_msgs, max_bytes, max_age — drop
the oldest messages while this reader is behind, or someone deletes messages): the stream seq of
what the consumer delivers must follow on from ``start_seq`` without a hole (our replicas' purge
never removes a message past a live replica's cover, so for a replica every hole is a loss).
A hole is counted (``stream_holes``, ``stream_lost`` messages) and opens a doubt over every pod
last seen before it: a doubted pod whose next message carries the next engine seq lost nothing;
one whose seq jumps gets an exact GAP (as always); a pod met for the first time inside the doubt,
or one that has shown nothing after the hole by the time the reader has caught up with the
stream's end as it stood when the hole was seen, gets a GAP with reason ``stream-hole`` and
``missed`` 0 (how many is unknowable: its messages are gone) — counted in ``hole_gaps`` and in
that pod's health. ``pods=`` seeds the per-pod (run, last seq) a replica's snapshot covered, so a
warm start checks its first message of each pod too (``positions()`` gives them for a snapshot).
The hole check needs the consumer to see the whole stream: it is off under a narrower
``filter_subject``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import replace

from ...delivery import Delivery, HealthState
from ...errors import ConfigError
from ...source import EventSource
from .loop import LoopThread, connect
from .pods import PodChecks
from .wire import StreamSpec

__all__ = ["JetStreamSource"]


class JetStreamSource(EventSource):
    """``open_source("nats://HOST:PORT", durable=...)`` builds one (the ``nats`` entry of ``SOURCES``)."""

    @classmethod
    def from_urls(cls, urls: list[str], **options) -> "JetStreamSource":
        if len(urls) != 1:
            raise ConfigError(f"a JetStream source reads one nats:// URL (the client finds a cluster's other "
                              f"servers itself), got {urls}")
        return cls(urls[0], **options)

    def __init__(self, url: str, *, durable: str = "kvrouter", stream: StreamSpec | None = None,
                 start_seq: int | None = None, window: int = 4096, fetch_batch: int = 512, max_queued: int = 8192,
                 pull_bytes: int = 4 << 20, max_queued_bytes: int = 24 << 20, auto_ack: bool = True,
                 stale_after: float = 10.0, filter_subject: str | None = None,
                 pods: dict[str, tuple] | None = None) -> None:
        if window < 1 or fetch_batch < 1 or max_queued < fetch_batch:
            raise ValueError("window and fetch_batch must be >= 1, max_queued >= fetch_batch")
        if pull_bytes < 1024 or max_queued_bytes < pull_bytes:
            raise ValueError("pull_bytes must be >= 1024, max_queued_bytes >= pull_bytes")
        self.url = url
        self.stream = stream or StreamSpec()
        self.durable = durable
        self.start_seq = start_seq
        self.window = window
        self.fetch_batch = fetch_batch
        self.max_queued = max_queued
        self.pull_bytes = pull_bytes  #: byte budget of one pull request (raised if one message needs more)
        self.max_queued_bytes = max_queued_bytes  #: bytes queued here plus bytes requested, at most
        self._queued_bytes = 0  #: bodies in the hand-over queue (written on the loop, read under _cond)
        self.auto_ack = auto_ack
        self.stale_after = stale_after
        self.filter_subject = filter_subject or self.stream.subjects
        self.position = (start_seq - 1) if start_seq else 0  #: stream seq of the last delivery returned
        self.acked = self.position  #: stream seq of the last delivery acknowledged
        self.stream_last = 0  #: the stream's last seq, as last read (about once a second)
        self._stats = {"messages": 0, "deliveries": 0, "queue_full_waits": 0, "fetch_errors": 0,
                       "pull_bytes_raised": 0, "acks": 0, "disconnects": 0, "reconnects": 0, "errors": 0,
                       "stream_holes": 0, "stream_lost": 0}
        self._checks = PodChecks(self._stats)  #: per-pod order and trust checks (see .pods)
        self._pods = self._checks.pods
        self._checks.seed(pods or {}, time.time())  # what a snapshot covered
        #: the stream seq the next delivered message must have (0: take the first one's)
        self._next_stream = (start_seq or 0) if self.filter_subject == self.stream.subjects else -1
        self._doubt: tuple[int, int] | None = None  #: open hole: (its first seq, read up to here to close it)
        self._queue: deque = deque()
        self._cond = threading.Condition()
        self._last_msg = None
        self._closed = False
        self._lt = LoopThread(f"kvevents-js-{durable}")
        self._lt.start(self._start())

    # ---- loop thread ---------------------------------------------------------------------------

    def _event(self, what: str) -> None:
        self._stats[what] += 1

    async def _start(self) -> None:
        from nats.js import api
        from nats.js.errors import NotFoundError

        self.nc = await connect(self.url, f"kvevents-source-{self.durable}", on_event=self._event)
        self.js = self.nc.jetstream()
        await self.stream.ensure(self.js, update=False)
        try:  # a replica (re)starts from ITS snapshot: the old consumer's position means nothing now
            await self.js.delete_consumer(self.stream.name, self.durable)
        except NotFoundError:
            pass
        if self.start_seq:
            policy = dict(deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=self.start_seq)
        else:
            policy = dict(deliver_policy=api.DeliverPolicy.ALL)
        cfg = api.ConsumerConfig(durable_name=self.durable, ack_policy=api.AckPolicy.ALL,
                                 max_ack_pending=self.window, filter_subject=self.filter_subject,
                                 ack_wait=30.0, **policy)
        await self.js.add_consumer(self.stream.name, cfg)
        # continuous pull: requests of ``fetch_batch`` messages, each on its own reply subject,
        # kept outstanding so that messages flow into the queue as the server stores them (a
        # fetch that waits for a whole batch, or for its timeout, would add that wait to the lag)
        self._next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{self.stream.name}.{self.durable}"
        self._inbox = self.nc.new_inbox()
        #: reply subject -> [messages still due, local expiry, bytes still due, messages delivered],
        #: oldest first (a delivered message carries its own subject, not the request's: only the
        #: end of a request, a status, names it)
        self._pulls: dict[str, list] = {}
        self._npull = 0
        self._wake = asyncio.Event()
        self._sub = await self.nc.subscribe(f"{self._inbox}.*", cb=self._on_msg)
        await self._refresh_last()
        self._task = asyncio.get_running_loop().create_task(self._pull_loop())

    async def _refresh_last(self) -> None:
        info = await self.js.stream_info(self.stream.name)
        self.stream_last = info.state.last_seq

    PULL_EXPIRES = 2.0  #: seconds a pull request waits at the server for messages
    MAX_PULL_BYTES = 256 << 20  #: the most a pull budget is raised to (a message that large is refused anyway)

    async def _pull_loop(self) -> None:
        next_info = 0.0
        blocked = False
        while not self._closed:
            now = time.monotonic()
            try:
                if now >= next_info:
                    next_info = now + 1.0
                    await self._refresh_last()
                pulls = self._pulls
                for subj in [k for k, v in pulls.items() if now > v[1]]:
                    del pulls[subj]  # its end (a 408) never came: lost with a connection
                due = sum(v[0] for v in pulls.values())
                due_bytes = sum(v[2] for v in pulls.values())
                room = self.max_queued - len(self._queue) - due
                room_bytes = self.max_queued_bytes - self._queued_bytes - due_bytes
                if due < self.fetch_batch and due_bytes < self.pull_bytes:
                    if room >= self.fetch_batch and room_bytes >= self.pull_bytes:
                        blocked = False
                        self._npull += 1
                        subj = f"{self._inbox}.{self._npull}"
                        pulls[subj] = [self.fetch_batch, now + self.PULL_EXPIRES + 1.0, self.pull_bytes, 0]
                        req = b'{"batch":%d,"max_bytes":%d,"expires":%d}' % (
                            self.fetch_batch, self.pull_bytes, int(self.PULL_EXPIRES * 1e9))
                        await self.nc.publish(self._next_subject, req, reply=subj)
                        continue
                    if not blocked:
                        blocked = True
                        self._stats["queue_full_waits"] += 1
            except asyncio.CancelledError:
                return
            except Exception:
                if self._closed:
                    return
                self._stats["fetch_errors"] += 1  # the connection is down: nats-py reconnects by itself
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), 0.5)
            except asyncio.TimeoutError:
                pass
            except asyncio.CancelledError:
                return

    async def _on_msg(self, msg) -> None:
        hdr = msg.headers
        if hdr is not None and "Status" in hdr and not msg.data:
            if hdr["Status"] != "100":  # 404/408 (no messages, expired), 409 (over a limit): that pull is over
                pull = self._pulls.pop(msg.subject, None)
                if (pull is not None and pull[3] == 0 and hdr["Status"] == "409"
                        and "MaxBytes" in str(hdr.get("Description", "")) and self.pull_bytes < self.MAX_PULL_BYTES):
                    # the next message is larger than a whole budget: without more, it never comes
                    self.pull_bytes = min(self.pull_bytes * 2, self.MAX_PULL_BYTES)
                    self.max_queued_bytes = max(self.max_queued_bytes, self.pull_bytes)
                    self._stats["pull_bytes_raised"] += 1
                self._wake.set()
            return
        size = len(msg.data)
        pulls = self._pulls
        if pulls:  # the server fills its waiting pull requests in order: this one counts against the oldest
            head = next(iter(pulls))
            pull = pulls[head]
            pull[0] -= 1
            pull[2] -= size
            pull[3] += 1
            if pull[0] <= 0:
                del pulls[head]
                self._wake.set()
        with self._cond:
            self._queue.append(msg)
            self._queued_bytes += size
            self._cond.notify()

    # ---- caller thread ------------------------------------------------------------------------

    def ack(self) -> None:
        """Acknowledge every delivery returned so far (call after applying them)."""
        msg, self._last_msg = self._last_msg, None
        if msg is None:
            return
        self.acked = self.position
        self._stats["acks"] += 1
        self._lt.loop.call_soon_threadsafe(self._ack_now, msg)

    def _ack_now(self, msg) -> None:
        self._lt.loop.create_task(self._ack(msg))

    async def _ack(self, msg) -> None:
        try:
            await msg.ack()
        except Exception:
            self._stats["errors"] += 1  # not redelivered to us: AckAll on a later message covers it

    def poll(self, timeout_ms: int = 100) -> list[Delivery]:
        if self._closed:
            raise RuntimeError("JetStreamSource is closed")
        if self.auto_ack:
            self.ack()
        with self._cond:
            if not self._queue:
                self._cond.wait(timeout_ms / 1000)
            queue = self._queue
            msgs = [queue.popleft() for _ in range(min(len(queue), self.fetch_batch * 2))]
            for msg in msgs:
                self._queued_bytes -= len(msg.data)
        if not msgs:
            return []
        if len(self._queue) + self.fetch_batch <= self.max_queued:
            self._lt.loop.call_soon_threadsafe(self._wake.set)
        out: list[Delivery] = []
        now = time.time()
        check = self._next_stream >= 0
        for msg in msgs:
            q = msg.metadata.sequence.stream
            if check:
                if q > self._next_stream > 0:
                    self._hole(self._next_stream, q)
                self._next_stream = q + 1
            self._checks.one(msg, q, now, out, None if self._doubt is None else self._doubt[0])
        last = msgs[-1]
        self._last_msg = last
        self.position = last.metadata.sequence.stream
        if self._doubt is not None and self.position >= self._doubt[1]:
            self._settle_doubt(now, out)
        self._stats["messages"] += len(msgs)
        self._stats["deliveries"] += len(out)
        return out

    def _hole(self, first: int, got: int) -> None:
        """Stream seqs ``first`` .. ``got - 1`` are gone: count them, open (or widen) the doubt."""
        self._stats["stream_holes"] += 1
        self._stats["stream_lost"] += got - first
        start = first if self._doubt is None else self._doubt[0]
        self._doubt = (start, max(self.stream_last, got))

    def _settle_doubt(self, now: float, out: list) -> None:
        """Caught up past the hole: pods that showed nothing after it may have lost their tail."""
        start = self._doubt[0]
        self._doubt = None
        for st in self._pods.values():
            # a pod whose possible tail loss was reported at this very position, and that has shown
            # nothing since, gets no second GAP for a second hole: it would say the same thing
            if st.stream_seq < start and st.hole_at != (st.run, st.last_seq):
                st.hole_at = (st.run, st.last_seq)
                self._checks.hole_gap(st, st.health.publisher, st.last_seq + 1, st.topic, now, out)

    def positions(self) -> dict[str, tuple[int, int, str]]:
        """Per pod (run, last seq, topic) as of ``position``: what a snapshot taken now covers (seed a
        later reader with ``pods=``). Empty while a stream hole is unresolved (not yet safe)."""
        if self._doubt is not None:
            return {}
        return {pod: (st.run, st.last_seq, st.topic) for pod, st in self._pods.items() if st.run >= 0}

    @property
    def in_doubt(self) -> bool:
        """A stream hole was seen and not every pod is cleared of it yet (see the module doc)."""
        return self._doubt is not None

    def __iter__(self):
        while not self._closed:
            yield from self.poll(100)

    def health(self) -> dict[str, PublisherHealth]:
        now = time.time()
        out = {}
        for name, st in self._pods.items():
            h = st.health
            state = HealthState.STALE if now - h.last_recv_ts > self.stale_after else HealthState.SYNCED
            out[name] = replace(h, state=state, malformed=dict(h.malformed))
        return out

    def lag(self) -> int:
        """How many stream messages lie past what was acknowledged (as of the last stream read)."""
        return max(0, self.stream_last - self.acked)

    def stats(self) -> dict[str, int]:
        return {**self._stats, "queued": len(self._queue), "queued_bytes": self._queued_bytes,
                "position": self.position, "acked": self.acked, "stream_last": self.stream_last, "lag": self.lag(),
                "pods": len(self._pods)}

    def close(self) -> None:
        if self._closed:
            return
        if self.auto_ack:
            self.ack()
        self._closed = True
        self._lt.close_connection(self.nc, before=self._task.cancel)

    def __enter__(self) -> "JetStreamSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
