"""ZeroMQ publisher: vLLM's frames and replay protocol, without vLLM's ways of hurting the engine.

Wire (identical to vLLM's ``ZmqEventPublisher``; the frame shapes are written down in
:mod:`kvevents.transport.zmq.frames`):

* PUB: ``[topic, seq (8 bytes big-endian unsigned, from 0), payload]``;
* replay (ROUTER, always bound; :mod:`kvevents.transport.zmq.replay` serves it): a request
  ``[b"", start_seq]`` is answered with ``[b"", topic, seq, payload]`` for every buffered batch
  whose seq >= start, then the end marker.

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

import threading
import time
from collections import deque
from collections.abc import Callable
from operator import length_hint as _length_hint
from typing import get_args

import zmq

from ...codec import BatchEncoder
from ...config import Overflow
from ...errors import ConfigError, EndpointError
from ...events import KVEventBatch
from ...publisher_base import EventPublisher, PublisherStats, ShutdownReport, _Ring
from .endpoints import offset_endpoint, should_bind, validate_endpoint
from .frames import END_SEQ, pack_seq as _pack_seq
from .replay import REQUEST_BURST, REQUEST_RATE, ReplayServer
from .sched import batch_thread

__all__ = ["ZmqEventPublisher", "OVERFLOW_POLICIES", "END_SEQ"]

SNDMORE = zmq.SNDMORE
_yield_gil = time.sleep
OVERFLOW_POLICIES: tuple[str, ...] = get_args(Overflow)
_UNTRACED = object()  # the span token of a batch whose seq the hooks do not sample


class ZmqEventPublisher(EventPublisher):
    """Publishes KVEventBatches on a ZeroMQ PUB socket, with a ROUTER replay socket.

    Arguments mirror vLLM's KVEventsConfig (``endpoint``, ``replay_endpoint``, ``buffer_steps``,
    ``hwm``, ``max_queue_size``, ``topic``) plus our bounds: ``buffer_bytes`` for the ring,
    ``overflow`` policy, ``replay_rate``/``replay_burst`` per replay client,
    ``replay_request_rate``/``replay_request_burst`` for all replay clients together (messages read
    off the replay socket a second; past it the socket is not read for a while), ``mode``
    (``auto``/``bind``/``connect``) for the PUB socket, and ``legacy`` encoding.

    ``drop_live`` is fault injection for tests and demos: a callable given each seq that,
    when it returns True, keeps that batch off the live socket (it still goes to the replay
    ring), so subscribers' gap healing can be exercised; counted as ``live_dropped``.
    """

    #: most batches of a backlog encoded before they are sent back to back (see _send_chunk)
    SEND_GROUP = 32

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
        replay_client_bytes: int = 4 << 20,
        replay_buffer_bytes: int = 32 << 20,
        replay_stall_timeout: float = 2.0,
        replay_request_rate: float = REQUEST_RATE,
        replay_request_burst: int = REQUEST_BURST,
        hwm_bytes: int | None = 64 << 20,
        mean_batch_bytes: int = 2048,
        mode: str = "auto",
        legacy: bool = False,
        context: zmq.Context | None = None,
        drop_live: "Callable[[int], bool] | None" = None,
    ) -> None:
        super().__init__(data_parallel_rank)
        if overflow not in OVERFLOW_POLICIES:
            raise ConfigError(f"overflow must be one of {OVERFLOW_POLICIES}, got {overflow!r}")
        for name, value in (("buffer_steps", buffer_steps), ("buffer_bytes", buffer_bytes),
                            ("max_queue_size", max_queue_size), ("replay_burst", replay_burst),
                            ("replay_client_bytes", replay_client_bytes), ("replay_buffer_bytes", replay_buffer_bytes),
                            ("mean_batch_bytes", mean_batch_bytes), ("replay_request_burst", replay_request_burst),
                            ("hwm_bytes", 1 if hwm_bytes is None else hwm_bytes)):
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        if not replay_stall_timeout > 0:
            raise ConfigError(f"replay_stall_timeout must be > 0, got {replay_stall_timeout!r}")
        if hwm < 0 or replay_rate <= 0 or not replay_request_rate > 0:
            raise ConfigError(f"hwm must be >= 0, replay_rate and replay_request_rate > 0, got hwm={hwm!r} "
                              f"replay_rate={replay_rate!r} replay_request_rate={replay_request_rate!r}")
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
        self._buf = bytearray(8192)
        self._drop_live = drop_live
        #: telemetry hook point (kvevents.telemetry installs it): ``on_enqueue``, ``before_send`` and
        #: ``after_send`` are called only for the batches whose seq is a multiple of ``hooks.every``
        #: (trace sampling by seq), ``on_replay`` for every replay served
        self.hooks = None

        self._lock = threading.Lock()
        self._queue: deque = deque()  # (seq, batch | bytes, topic bytes)
        self._ring_only: deque = deque()  # overflowed: numbered, kept for replay, not sent live
        self._seq = 0
        # the live thread's wake-up: a plain lock, held while there is nothing to do, released by
        # publish() (one C call; Event.set() runs a Condition's notify in Python, ~6x the instructions)
        self._wake = threading.Lock()
        self._wake.acquire()
        self._idle = threading.Event()  # set while the live thread has nothing to send
        self._idle.set()
        self._asleep = True  # _idle as a plain bool (read by publish(), under the lock)
        self._closing = False
        self._closed = False
        self._inflight: list = []  # what the live thread took and is sending now
        self._group_end, self._ready, self._sending = 0, [], None  # where it is (see _stuck)
        self._deadline = 0.0

        bind = should_bind(self.endpoint, mode)  # a bad mode is refused before a socket exists
        self._ctx = context or zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        # SNDHWM counts messages, per subscriber: with hwm_bytes it is also held under
        # hwm_bytes / mean_batch_bytes, so a stuck subscriber costs about hwm_bytes, not hwm batches
        if hwm_bytes is not None:
            by_bytes = max(1, hwm_bytes // mean_batch_bytes)
            hwm = by_bytes if hwm == 0 else min(hwm, by_bytes)
        self._stats.pub_hwm = hwm
        self._pub.setsockopt(zmq.SNDHWM, hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        try:
            if bind:
                self._pub.bind(self.endpoint)
            else:
                self._pub.connect(self.endpoint)
            if self.replay_endpoint:
                self._replay = ReplayServer.bind(self._ctx, self.replay_endpoint, self._ring, self._stats,
                                                 rate=replay_rate, burst=replay_burst, hooks=lambda: self.hooks,
                                                 client_bytes=replay_client_bytes, total_bytes=replay_buffer_bytes,
                                                 stall_timeout=replay_stall_timeout,
                                                 request_rate=replay_request_rate, request_burst=replay_request_burst)
        except zmq.ZMQError as exc:
            self._pub.close(0)
            raise EndpointError(
                f"cannot open publisher on {self.endpoint!r} (replay {self.replay_endpoint!r}): {exc}"
            ) from None

        self._thread = threading.Thread(target=self._run_live, name="kvevents-pub", daemon=True)
        self._thread.start()
        if self._replay is not None:
            self._replay.start()

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
        if seq is not None and not 0 <= seq < (1 << 64) - 1:  # 2**64 - 1 is the replay end marker's frame
            raise ValueError(f"seq must be an unsigned 64-bit int below 2**64 - 1 (the replay end marker), got {seq!r}")
        self._enqueue(bytes(payload), seq, None if topic is None else topic.encode())

    def _enqueue(self, item, seq: int | None, topic: bytes | None) -> None:
        """Numbers ``item`` (or takes ``seq``) and queues it for the live thread: the engine's cost
        per step. The lock is taken by acquire/release, not ``with``: CPython 3.11's ``with`` looks
        __enter__ and __exit__ up on every use (~2x the instructions)."""
        lock = self._lock
        lock.acquire()
        try:
            if self._closing:
                raise RuntimeError("publish() after shutdown()")
            if seq is None:
                seq = self._seq
            self._seq = seq + 1
            q = self._queue
            if len(q) >= self.max_queue_size:
                self._overflow(q)
            q.append((seq, item, topic or self._topic_bytes))
            hooks = self.hooks
            if hooks is not None and not seq % hooks.every:
                hooks.on_enqueue(seq)
            if self._asleep:
                self._wake_up()
        finally:
            lock.release()

    def _overflow(self, q: deque) -> None:
        """The queue is full (lock held): the oldest batch leaves the live path, as the policy says."""
        self._stats.overflow += 1
        old = q.popleft()
        if self.overflow_policy == "replay_only":
            self._ring_only.append(old)
            if len(self._ring_only) > self._ring.max_items:
                self._ring_only.popleft()
                self._stats.overflow_lost += 1
        else:
            self._stats.overflow_lost += 1

    def _wake_up(self) -> None:
        """The live thread is idle (lock held): it has work again."""
        self._asleep = False
        self._idle.clear()
        wake = self._wake
        if wake.locked():  # else a wake-up is pending already (only calls under self._lock release it)
            wake.release()

    # ---- live thread -----------------------------------------------------------------------

    def _take(self) -> tuple[list, list]:
        with self._lock:
            ring_only = list(self._ring_only)
            self._ring_only.clear()
            live = list(self._queue)
            self._queue.clear()
            if not ring_only and not live:
                self._asleep = True
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
        batch_thread()  # publish() wakes this thread: it must not preempt the caller (see .sched)
        try:
            self._live_loop()
        finally:  # this thread owns the PUB socket: it closes it, lingering until the deadline
            remaining = max(0.0, self._deadline - time.monotonic())
            self._pub.close(linger=int(remaining * 1000))

    def _live_loop(self) -> None:
        ring = self._ring
        while True:
            ring_only, live = self._take()
            if not ring_only and not live:
                if self._closing:
                    break
                self._wake.acquire(timeout=0.5)
                continue
            if ring_only:
                encoded = [(seq, topic, self._encode(item)) for seq, item, topic in ring_only]
                for seq, topic, payload in encoded:
                    if payload is not None:
                        ring.append(seq, topic, payload)
            self._inflight = live
            if self._send_chunk(live):
                return
            self._inflight = []

    def _send_chunk(self, live: list) -> bool:
        """Encode, keep in the ring, and send each of ``live``; True when shutdown's deadline
        passed (what is left went back to the queue for shutdown() to report).

        A backlog goes in groups of up to ``SEND_GROUP``: the group is encoded and put in the
        ring, then its sends go back to back. +2% instructions, but a higher delivered rate to
        a subscriber process on 2 cores in each of 4 interleaved A/B runs (+2% to +29%), with
        less CPU per batch over both processes in 3 of them. A lone batch (an engine step) is a
        group of one: no added latency. Under a backlog a sampled batch's span also covers the
        rest of its group's encoding.
        """
        stats = self._stats
        ring = self._ring
        hooks = self.hooks
        every = hooks.every if hooks is not None else 0
        token = None
        drop = self._drop_live
        pub = self._pub
        # pyzmq's exported backend class's send: zmq.Socket.send only adds the DRAFT routing_id /
        # group arguments (never used here) in Python, +7.6% instructions per batch (NOTES.md);
        # a subclass overriding send keeps its own
        send = zmq.backend.Socket.send.__get__(pub) if type(pub) is zmq.Socket else pub.send
        # the encoder, one call deep, into a reused buffer: one copy out of it (bytes) instead
        # of msgspec's growing and shrinking a fresh bytes object per batch
        encode_into = None if self._encoder.legacy else self._encoder._enc.encode_into
        buf = self._buf
        group_size = self.SEND_GROUP
        n_live = len(live)
        for start in range(0, n_live, group_size):
            end = start + group_size
            self._group_end = end
            self._sending = None  # shutdown() reads where this thread is: see _stuck
            ready = []  # (seq, topic, payload, item, span token): in the ring, not yet sent
            for seq, item, topic in live[start:end] if n_live > group_size else live:
                traced = every and not seq % every  # per-batch hooks only for sampled seqs
                if traced:
                    token = hooks.before_send(seq, topic)
                if type(item) is bytes:
                    payload = item
                else:
                    try:
                        if encode_into is not None:
                            encode_into(item, buf)
                            payload = bytes(buf)
                        else:
                            payload = self._encoder.encode(item)
                    except Exception:  # a batch holding values msgpack cannot carry
                        stats.encode_errors += 1
                        if traced:
                            hooks.after_send(token, seq, b"", item, "encode_error")
                        continue
                ring.append(seq, topic, payload)  # into the ring before the socket (see _Ring)
                ready.append((seq, topic, payload, item, token if traced else _UNTRACED))
            self._ready = ready
            self._sending = it = iter(ready)
            for seq, topic, payload, item, token in it:
                if self._closing and time.monotonic() > self._deadline:
                    rest = [(r[0], r[3], r[1]) for r in ready[len(ready) - _length_hint(it) - 1:]]
                    with self._lock:  # give the rest back for shutdown() to report
                        self._queue.extendleft(reversed(rest + live[end:]))
                        self._inflight = []
                    return True
                if drop is not None and drop(seq):
                    stats.live_dropped += 1
                    if token is not _UNTRACED:
                        hooks.after_send(token, seq, payload, item, "dropped")
                    continue
                try:
                    # three plain sends: pyzmq's send_multipart costs ~2.5x as much per message
                    send(topic, SNDMORE)
                    send(_pack_seq(seq), SNDMORE)
                    send(payload)
                except zmq.ZMQError:
                    stats.send_errors += 1
                    if token is not _UNTRACED:
                        hooks.after_send(token, seq, payload, item, "send_error")
                else:
                    stats.batches_published += 1
                    stats.bytes_published += len(payload)
                    if type(item) is not bytes:
                        stats.events_published += len(item.events)
                    if token is not _UNTRACED:
                        hooks.after_send(token, seq, payload, item, "sent")
            if end < n_live:
                # hand the GIL over between groups: the engine thread calling publish() must
                # never wait a whole switch interval (5 ms) behind this loop
                _yield_gil(0)
        return False

    # ---- lifecycle ---------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        out = {k: getattr(self._stats, k) for k in PublisherStats.__slots__}
        out["queue_depth"] = len(self._queue) + len(self._ring_only)
        out["ring_batches"] = len(self._ring.items)
        out["ring_bytes"] = self._ring.nbytes
        return out

    def _stuck(self) -> list[int]:
        """Seqs the live thread took and has not finished: the one it is on and the rest."""
        inflight = self._inflight
        if not inflight:
            return []
        sending = self._sending
        if sending is None:  # encoding a group: nothing of it sent yet
            start = max(0, self._group_end - self.SEND_GROUP)
            return [seq for seq, _, _ in inflight[start:]]
        ready = self._ready  # sending a group: the iterator has handed out the current one
        rest = ready[max(0, len(ready) - _length_hint(sending) - 1):]
        return [r[0] for r in rest] + [seq for seq, _, _ in inflight[self._group_end:]]

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
            if self._wake.locked():
                self._wake.release()
        if self._replay is not None:
            self._replay.request_stop()
        self._thread.join(max(0.0, timeout) + 1.0)
        with self._lock:
            stuck = self._stuck() if self._thread.is_alive() else []
            unsent = stuck + [seq for seq, _, _ in self._queue]
            self._queue.clear()
            self._ring_only.clear()
        if self._replay is not None:
            self._replay.stop(2.0)
        self._closed = True
        return ShutdownReport(flushed=self._stats.batches_published - published_before, unsent=len(unsent), unsent_seqs=unsent)
