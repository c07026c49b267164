"""ZeroMQ publisher: vLLM's frames and replay protocol, without vLLM's ways of hurting the engine.

Wire (identical to vLLM's ``ZmqEventPublisher``):

* PUB: ``[topic, seq (8 bytes big-endian unsigned, from 0), payload]``;
* replay (ROUTER, always bound): a request ``[b"", start_seq (8 bytes)]`` is answered with
  ``[b"", topic, seq, payload]`` for every buffered batch whose seq >= start, then the end
  marker ``[b"", b"", (-1 as 8 signed big-endian bytes), b""]``.

What differs from vLLM's:

* ``publish()`` never blocks: the caller appends to a bounded queue under a lock held for a
  few hundred nanoseconds. When the queue is full, the overflow policy decides:
  ``"replay_only"`` (default) takes the OLDEST queued batch off the live path but still
  numbers, encodes and keeps it in the replay ring, so a subscriber heals the gap by replay;
  ``"drop_oldest"`` discards it. Every batch that misses the live path, and every batch lost
  for good, is counted.
* The replay ring is bounded by batch count (``buffer_steps``) AND bytes (``buffer_bytes``).
* Replays are served by their own thread, in chunks, so a large replay never stalls live
  publishing; each replay client is rate-limited (token bucket per ZeroMQ identity):
  a request over the limit waits for its turn instead of being served at once.
* ``shutdown(timeout)`` flushes what is queued before the deadline and reports what it could not send.
"""

from __future__ import annotations

import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from .codec import BatchEncoder
from .endpoints import offset_endpoint, should_bind, validate_endpoint
from .errors import ConfigError, EndpointError
from .events import KVEventBatch
from .publisher_base import EventPublisher, ShutdownReport

END_SEQ = (-1).to_bytes(8, "big", signed=True)
SNDMORE = zmq.SNDMORE
_pack_seq = struct.Struct(">Q").pack
_yield_gil = time.sleep
OVERFLOW_POLICIES = ("replay_only", "drop_oldest")


@dataclass(slots=True)
class PublisherStats:
    """Plain-int counters; read them any time (``stats()`` returns a dict copy)."""

    batches_published: int = 0  #: batches sent on the PUB socket
    events_published: int = 0
    bytes_published: int = 0  #: payload bytes sent live
    overflow: int = 0  #: batches taken off the live path because the queue was full
    overflow_lost: int = 0  #: of those, batches also lost to replay (policy drop_oldest, or ring full)
    encode_errors: int = 0  #: batches that could not be encoded (their seq becomes a gap)
    send_errors: int = 0
    ring_evicted: int = 0  #: batches pushed out of the replay ring by its count/bytes bounds
    replay_requests: int = 0
    replay_batches_served: int = 0
    replay_rate_limited: int = 0  #: requests that had to wait for their client's token bucket
    replay_malformed: int = 0  #: replay requests with a bad shape
    replay_aborted: int = 0  #: replays cut short (client gone or not reading)
    live_dropped: int = 0  #: batches kept off the live socket by the drop_live fault injector


class _Ring:
    """Encoded batches kept for replay, bounded by count and bytes.

    One writer (the live thread) appends each batch BEFORE it goes on the socket, so a
    subscriber that sees seq s live can always get every earlier seq the ring still holds.
    No lock: readers take a snapshot with ``list(deque)``, one C-level copy that no other
    Python thread can interleave with under the GIL.
    """

    __slots__ = ("items", "nbytes", "max_items", "max_bytes", "stats")

    def __init__(self, max_items: int, max_bytes: int, stats: PublisherStats) -> None:
        self.items: deque[tuple[int, bytes, bytes]] = deque()
        self.nbytes = 0
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.stats = stats

    def append(self, seq: int, topic: bytes, payload: bytes) -> None:
        self.items.append((seq, topic, payload))
        self.nbytes += len(payload)
        self.trim()

    def trim(self) -> None:
        items = self.items
        while len(items) > self.max_items or self.nbytes > self.max_bytes:
            self.nbytes -= len(items.popleft()[2])
            self.stats.ring_evicted += 1

    def since(self, start: int) -> list[tuple[int, bytes, bytes]]:
        """Every kept batch with seq >= start, oldest first."""
        snapshot = list(self.items)
        out = []
        for item in reversed(snapshot):
            if item[0] < start:
                break
            out.append(item)
        out.reverse()
        return out


class ZmqEventPublisher(EventPublisher):
    """Publishes KVEventBatches on a ZeroMQ PUB socket, with a ROUTER replay socket.

    Arguments mirror vLLM's KVEventsConfig (``endpoint``, ``replay_endpoint``, ``buffer_steps``,
    ``hwm``, ``max_queue_size``, ``topic``) plus our bounds: ``buffer_bytes`` for the ring,
    ``overflow`` policy, ``replay_rate``/``replay_burst`` per replay client, ``mode``
    (``auto``/``bind``/``connect``) for the PUB socket, and ``legacy`` encoding.

    ``drop_live`` is fault injection for tests and demos: a callable given each seq that,
    when it returns True, keeps that batch off the live socket (it still goes to the replay
    ring), so subscribers' gap healing can be exercised; counted as ``live_dropped``.
    """

    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:5557",
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        data_parallel_rank: int = 0,
        buffer_steps: int = 10_000,
        buffer_bytes: int = 64 << 20,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        overflow: str = "replay_only",
        replay_rate: float = 20.0,
        replay_burst: int = 5,
        mode: str = "auto",
        legacy: bool = False,
        context: zmq.Context | None = None,
        drop_live: "Callable[[int], bool] | None" = None,
    ) -> None:
        super().__init__(data_parallel_rank)
        if overflow not in OVERFLOW_POLICIES:
            raise ConfigError(f"overflow must be one of {OVERFLOW_POLICIES}, got {overflow!r}")
        for name, value in (("buffer_steps", buffer_steps), ("buffer_bytes", buffer_bytes),
                            ("max_queue_size", max_queue_size), ("replay_burst", replay_burst)):
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if hwm < 0 or replay_rate <= 0:
            raise ConfigError(f"hwm must be >= 0 and replay_rate > 0, got hwm={hwm!r} replay_rate={replay_rate!r}")
        self.endpoint = offset_endpoint(validate_endpoint(endpoint), data_parallel_rank)
        self.replay_endpoint = (
            offset_endpoint(validate_endpoint(replay_endpoint, what="replay_endpoint"), data_parallel_rank)
            if replay_endpoint else None
        )
        self.topic = topic
        self._topic_bytes = topic.encode()
        self.max_queue_size = max_queue_size
        self.overflow_policy = overflow
        self._stats = PublisherStats()
        self._ring = _Ring(buffer_steps, buffer_bytes, self._stats)
        self._encoder = BatchEncoder(legacy=legacy)
        self._replay_rate = float(replay_rate)
        self._replay_burst = replay_burst
        self._drop_live = drop_live
        #: telemetry hook object (installed by kvevents.telemetry; None: the cost is one check)
        #: telemetry hook point (kvevents.telemetry installs it): ``on_enqueue``, ``before_send`` and
        #: ``after_send`` are called only for the batches whose seq is a multiple of ``hooks.every``
        #: (trace sampling by seq), ``on_replay`` for every replay served
        self.hooks = None

        self._lock = threading.Lock()
        self._queue: deque = deque()  # (seq, batch | bytes, topic bytes)
        self._ring_only: deque = deque()  # overflowed: numbered, kept for replay, not sent live
        self._seq = 0
        self._wake = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._closing = False
        self._closed = False
        self._inflight: list = []  # what the live thread took and is sending now
        self._inflight_pos = 0
        self._deadline = 0.0

        self._ctx = context or zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay_sock = None
        try:
            if should_bind(self.endpoint, mode):
                self._pub.bind(self.endpoint)
            else:
                self._pub.connect(self.endpoint)
            if self.replay_endpoint:
                self._replay_sock = self._ctx.socket(zmq.ROUTER)
                self._replay_sock.setsockopt(zmq.LINGER, 0)
                self._replay_sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
                self._replay_sock.setsockopt(zmq.SNDHWM, 0)
                self._replay_sock.bind(self.replay_endpoint)
        except zmq.ZMQError as exc:
            self._pub.close(0)
            if self._replay_sock is not None:
                self._replay_sock.close(0)
            raise EndpointError(
                f"cannot open publisher on {self.endpoint!r} (replay {self.replay_endpoint!r}): {exc}"
            ) from None

        self._thread = threading.Thread(target=self._run_live, name="kvevents-pub", daemon=True)
        self._thread.start()
        self._replay_thread = None
        if self._replay_sock is not None:
            self._replay_thread = threading.Thread(target=self._run_replay, name="kvevents-replay", daemon=True)
            self._replay_thread.start()

    # ---- caller side: never blocks -------------------------------------------------------

    def publish(self, batch: KVEventBatch) -> None:
        """Queue ``batch``; returns at once. Raises RuntimeError after shutdown, TypeError on a non-batch."""
        if type(batch) is not KVEventBatch:
            raise TypeError(f"publish() expects a KVEventBatch, got {type(batch).__name__}")
        self._enqueue(batch, None, None)

    def publish_raw(self, payload: bytes, seq: int | None = None, topic: str | None = None) -> None:
        """Queue an already encoded payload, optionally with its own seq (record/replay tools).

        With an explicit ``seq`` the publisher's counter continues from ``seq + 1``.
        """
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise TypeError(f"publish_raw() expects bytes, got {type(payload).__name__}")
        if seq is not None and not 0 <= seq < 1 << 64:
            raise ValueError(f"seq must be an unsigned 64-bit int, got {seq!r}")
        self._enqueue(bytes(payload), seq, None if topic is None else topic.encode())

    def _enqueue(self, item, seq: int | None, topic: bytes | None) -> None:
        with self._lock:
            if self._closing:
                raise RuntimeError("publish() after shutdown()")
            if seq is None:
                seq = self._seq
            self._seq = seq + 1
            q = self._queue
            if len(q) >= self.max_queue_size:
                self._stats.overflow += 1
                old = q.popleft()
                if self.overflow_policy == "replay_only":
                    self._ring_only.append(old)
                    if len(self._ring_only) > self._ring.max_items:
                        self._ring_only.popleft()
                        self._stats.overflow_lost += 1
                else:
                    self._stats.overflow_lost += 1
            q.append((seq, item, topic or self._topic_bytes))
            hooks = self.hooks
            if hooks is not None and not seq % hooks.every:
                hooks.on_enqueue(seq)
            if self._idle.is_set():
                self._idle.clear()
                self._wake.set()

    # ---- live thread -----------------------------------------------------------------------

    def _take(self) -> tuple[list, list]:
        with self._lock:
            ring_only = list(self._ring_only)
            self._ring_only.clear()
            live = list(self._queue)
            self._queue.clear()
            if not ring_only and not live:
                self._idle.set()
            return ring_only, live

    def _encode(self, item) -> bytes | None:
        if type(item) is bytes:
            return item
        try:
            return self._encoder.encode(item)
        except Exception:  # a batch holding values msgpack cannot carry
            self._stats.encode_errors += 1
            return None

    def _run_live(self) -> None:
        try:
            self._live_loop()
        finally:  # this thread owns the PUB socket: it closes it, lingering until the deadline
            remaining = max(0.0, self._deadline - time.monotonic())
            self._pub.close(linger=int(remaining * 1000))

    def _live_loop(self) -> None:
        stats = self._stats
        pub = self._pub
        ring = self._ring
        while True:
            ring_only, live = self._take()
            if not ring_only and not live:
                if self._closing:
                    break
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            if ring_only:
                encoded = [(seq, topic, self._encode(item)) for seq, item, topic in ring_only]
                for seq, topic, payload in encoded:
                    if payload is not None:
                        ring.append(seq, topic, payload)
            self._inflight = live
            hooks = self.hooks
            every = hooks.every if hooks is not None else 0
            token = None
            drop = self._drop_live
            send = pub.send
            # the encoder and the ring, one call deep (this loop is the publisher's hot path)
            encode = None if self._encoder.legacy else self._encoder._enc.encode
            items = ring.items
            for i, (seq, item, topic) in enumerate(live):
                self._inflight_pos = i
                if self._closing and time.monotonic() > self._deadline:
                    with self._lock:  # give the rest back for shutdown() to report
                        self._queue.extendleft(reversed(live[i:]))
                        self._inflight = []
                    return
                traced = every and not seq % every  # per-batch hooks only for sampled seqs
                if traced:
                    token = hooks.before_send(seq, topic)
                if type(item) is bytes:
                    payload = item
                else:
                    try:
                        payload = encode(item) if encode is not None else self._encoder.encode(item)
                    except Exception:  # a batch holding values msgpack cannot carry
                        stats.encode_errors += 1
                        if traced:
                            hooks.after_send(token, seq, b"", item, "encode_error")
                        continue
                # into the ring before the socket (see _Ring); _Ring.append, inlined
                items.append((seq, topic, payload))
                ring.nbytes += len(payload)
                if len(items) > ring.max_items or ring.nbytes > ring.max_bytes:
                    ring.trim()
                if i & 31 == 31:
                    # hand the GIL over: the engine thread calling publish() must never wait
                    # a whole switch interval (5 ms) behind this loop
                    _yield_gil(0)
                if drop is not None and drop(seq):
                    stats.live_dropped += 1
                    if traced:
                        hooks.after_send(token, seq, payload, item, "dropped")
                    continue
                try:
                    # three plain sends: pyzmq's send_multipart costs ~2.5x as much per message
                    send(topic, SNDMORE)
                    send(_pack_seq(seq), SNDMORE)
                    send(payload)
                except zmq.ZMQError:
                    stats.send_errors += 1
                    if traced:
                        hooks.after_send(token, seq, payload, item, "send_error")
                else:
                    stats.batches_published += 1
                    stats.bytes_published += len(payload)
                    if type(item) is not bytes:
                        stats.events_published += len(item.events)
                    if traced:
                        hooks.after_send(token, seq, payload, item, "sent")
            self._inflight = []

    # ---- replay thread ---------------------------------------------------------------------

    def _run_replay(self) -> None:
        try:
            self._replay_loop()
        finally:
            self._replay_sock.close(0)

    def _replay_loop(self) -> None:
        sock = self._replay_sock
        stats = self._stats
        buckets: dict[bytes, list[float]] = {}  # identity -> [tokens, last refill time]
        waiting: dict[bytes, int] = {}  # identity -> start seq of its pending request
        deferred: set[bytes] = set()  # identities whose pending request was already counted as limited
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self._closing:
            if poller.poll(20 if waiting else 200):
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                        stats.replay_malformed += 1
                        continue
                    stats.replay_requests += 1
                    # a newer request from the same client replaces its pending one
                    waiting[frames[0]] = int.from_bytes(frames[2], "big")
            if len(buckets) > 4096:  # forget idle clients
                buckets = {k: v for k, v in buckets.items() if k in waiting}
            now = time.monotonic()
            for ident in list(waiting):
                bucket = buckets.setdefault(ident, [float(self._replay_burst), now])
                bucket[0] = min(float(self._replay_burst), bucket[0] + (now - bucket[1]) * self._replay_rate)
                bucket[1] = now
                if bucket[0] < 1.0:
                    if ident not in deferred:
                        deferred.add(ident)
                        stats.replay_rate_limited += 1
                    continue
                bucket[0] -= 1.0
                deferred.discard(ident)
                self._serve(sock, ident, waiting.pop(ident))

    def _serve(self, sock, ident: bytes, start: int) -> None:
        hooks = self.hooks
        if hooks is None:
            self._serve_replay(sock, ident, start)
            return
        t0 = time.time_ns()
        served = self._stats.replay_batches_served
        self._serve_replay(sock, ident, start)
        hooks.on_replay(start, self._stats.replay_batches_served - served, t0)

    def _serve_replay(self, sock, ident: bytes, start: int) -> None:
        stats = self._stats
        try:
            for seq, topic, payload in self._ring.since(start):
                if self._closing:
                    return
                if not sock.poll(1000, zmq.POLLOUT):
                    stats.replay_aborted += 1
                    return
                sock.send_multipart((ident, b"", topic, seq.to_bytes(8, "big"), payload))
                stats.replay_batches_served += 1
            sock.send_multipart((ident, b"", b"", END_SEQ, b""))
        except zmq.ZMQError:  # EHOSTUNREACH: the client went away
            stats.replay_aborted += 1

    # ---- lifecycle ---------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        out = {k: getattr(self._stats, k) for k in PublisherStats.__slots__}
        out["queue_depth"] = len(self._queue) + len(self._ring_only)
        out["ring_batches"] = len(self._ring.items)
        out["ring_bytes"] = self._ring.nbytes
        return out

    @property
    def next_seq(self) -> int:
        return self._seq

    def shutdown(self, timeout: float = 1.0) -> ShutdownReport:
        """Send what is queued within ``timeout`` seconds, close the sockets, report the rest."""
        if self._closed:
            return ShutdownReport()
        published_before = self._stats.batches_published
        with self._lock:
            self._closing = True
            self._deadline = time.monotonic() + max(0.0, timeout)
        self._wake.set()
        self._thread.join(max(0.0, timeout) + 1.0)
        with self._lock:
            stuck = self._inflight[self._inflight_pos:] if self._thread.is_alive() else []
            unsent = [seq for seq, _, _ in stuck] + [seq for seq, _, _ in self._queue]
            self._queue.clear()
            self._ring_only.clear()
        if self._replay_thread is not None:
            self._replay_thread.join(2.0)
        self._closed = True
        return ShutdownReport(flushed=self._stats.batches_published - published_before, unsent=len(unsent), unsent_seqs=unsent)
