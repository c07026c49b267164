"""The replay server: a ROUTER socket answering ``[b"", start_seq]`` from a publisher's ring.

It runs on its own thread, so a large replay never stalls live publishing. What it promises
under hostile or stuck clients:

* **Bounded memory.** What it has queued toward clients and ZeroMQ has not yet handed to the
  connection is accounted per client: each chunk's last message is sent zero-copy and
  *tracked* (pyzmq's ``MessageTracker``), and a client's pipe empties in order, so a chunk is
  released when its last message is. A client holding ``client_bytes`` unreleased gets
  nothing more until it reads; all clients together hold at most ``total_bytes`` (plus one
  chunk each). A client that makes no progress for ``stall_timeout`` seconds has its replay
  aborted (``replay_stalled``, and ``replay_aborted``); its further requests are refused while
  its earlier answer sits unread (``replay_refused``). The ROUTER's ``SNDHWM`` (messages) is
  a backstop; a send at it is not queued (ROUTER_MANDATORY + non-blocking). So the process
  holds at most ring bytes + ``total_bytes`` + a chunk per client for replay, however many
  requests arrive (``replay_outstanding_bytes`` shows the queued part).
* **Fair service.** Active replays are served round-robin, one chunk (``CHUNK`` batches or
  ``CHUNK_BYTES``) per client per round: a one-batch request waits for at most one chunk of
  each other replay, not for whole rings.
* **Rate limits.** Each client (ZeroMQ identity) has a token bucket: a request over the limit
  waits for its turn (``replay_rate_limited``, once per waiting request); a newer request from
  the same client replaces its pending or running one (``replay_superseded``).
* **A global cap on reading.** All clients together get at most ``request_rate`` messages a
  second read off the socket (well-formed or not; a token bucket of ``request_burst``). Past it
  the server stops reading for a while (``replay_throttled`` counts each pause): what was sent
  waits in libzmq's bounded pipe (``RCVHWM`` messages per connection) and then in the kernel,
  and a sender at its own high-water mark is made to wait, so a flood costs this process (and,
  on the same machine, the flooder) little CPU whatever its rate, and nothing is dropped. Reading
  resumes once ``PAUSE`` seconds of the cap have refilled; libzmq fair-queues the connections,
  so a well-behaved client's request is read after at most one message of each other connection.

A replay covers the batches the ring holds from ``start`` up to the newest one when the replay
began; batches evicted while a slow replay runs are skipped (the client sees the seq jump and
reports the gap). Frame shapes: :mod:`kvevents.transport.zmq.frames`.

**The engine's GIL.** This thread shares the GIL with the engine thread calling ``publish()``.
A hostile client could keep it busy all the time (thousands of malformed requests a second, the
whole ring asked for again and again), so its work is bounded: the global cap above limits the
messages read a second, the per-client buckets and byte bounds limit what is sent, the thread
never preempts the engine's (:mod:`.sched`), and the ring is read through a mirror list kept in
step with it (:mod:`.mirror`), never copied whole while replays run.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from operator import itemgetter
from typing import Any

import zmq

from ...publisher_base import PublisherStats, _Ring
from .frames import END_SEQ, SEQ_BYTES, parse_replay_request
from .mirror import RingMirror as _Mirror
from .sched import batch_thread, lower_io_threads, threads

__all__ = ["ReplayServer"]

#: replay clients remembered at once (token buckets, replays in progress); past it requests are refused
MAX_CLIENTS = 4096
#: most batches, and bytes, sent to one client per round of the fair schedule
CHUNK = 64
CHUNK_BYTES = 256 << 10
#: libzmq's own bookkeeping per queued message (msg_t structs, pipe slot), counted with its bytes
MSG_OVERHEAD = 5 * 64
#: the global cap: messages read a second, all clients together, and the bucket's depth
REQUEST_RATE = 1000.0
REQUEST_BURST = 1000
#: a throttled socket is read again once this many seconds of the cap have refilled (one wake-up
#: per PAUSE, not one per message, under a flood)
PAUSE = 0.05
#: per-connection queue of unread requests (messages): a flooder is pushed back once it is full
RCVHWM = 64
#: ZMQ_THREAD_NAME_PREFIX of the replay sockets' own contexts: their I/O threads are named
#: "1010/ZMQbg/IO/<n>" (libzmq 4.3 takes an int), which is how lower_io_threads finds them
IO_THREAD_PREFIX = 1010
IO_NICE = 19
_seq_of = itemgetter(0)
_MORE_NOW = int(zmq.SNDMORE | zmq.NOBLOCK)  # ints: an enum's | runs Python code per frame
_MORE = int(zmq.SNDMORE)


class _Replay:
    """One client's replay in progress (cursor None: done, waiting only for its bytes to drain)."""

    __slots__ = ("ident", "start", "cursor", "end", "chunks", "outstanding", "progress", "served", "t0", "ending")

    def __init__(self, ident: bytes, start: int, end: int, now: float) -> None:
        self.ident = ident
        self.chunks: deque = deque()  # (MessageTracker, bytes accounted)
        self.outstanding = 0
        self.restart(start, end, now)

    def restart(self, start: int, end: int, now: float) -> None:
        self.start = start
        self.cursor: int | None = start
        self.end = end
        self.progress = now
        self.served = 0
        self.t0 = time.time_ns()
        self.ending = False  # every batch sent: the end marker is next


class ReplayServer:
    """Serves replay requests on ``sock`` (a bound ROUTER) from ``ring``, counting into ``stats``.

    ``hooks`` returns the telemetry hook object (or None) at the time of each replay: the
    publisher's ``hooks`` attribute, which telemetry installs and removes at any time.
    """

    def __init__(self, sock: zmq.Socket, ring: _Ring, stats: PublisherStats, *, rate: float, burst: int,
                 hooks: Callable[[], Any] = lambda: None, client_bytes: int = 4 << 20,
                 total_bytes: int = 32 << 20, stall_timeout: float = 2.0, request_rate: float = REQUEST_RATE,
                 request_burst: int = REQUEST_BURST) -> None:
        self._sock = sock
        self._ring = ring
        self._stats = stats
        self._rate = float(rate)
        self._burst = burst
        self._hooks = hooks
        self.client_bytes = client_bytes
        self.total_bytes = total_bytes
        self.stall_timeout = stall_timeout
        if not request_rate > 0 or not isinstance(request_burst, int) or request_burst < 1:
            raise ValueError(f"request_rate must be > 0 and request_burst a positive int, got "
                             f"{request_rate!r}, {request_burst!r}")
        self.request_rate = float(request_rate)
        self.request_burst = request_burst
        self._closing = False
        self._own_ctx: zmq.Context | None = None
        self._io_pending: set[int] = set()
        #: the replay socket's I/O threads running SCHED_BATCH at nice IO_NICE (see bind)
        self.io_threads: set[int] = set()
        self._mirror = _Mirror(ring.items)
        self._thread = threading.Thread(target=self._run, name="kvevents-replay", daemon=True)

    @classmethod
    def bind(cls, ctx: zmq.Context, endpoint: str, ring: _Ring, stats: PublisherStats,
             **kw: Any) -> "ReplayServer":
        """A ROUTER bound on ``endpoint`` (raises zmq.ZMQError; the socket is closed then).

        Except on ``inproc://`` (whose peers must share ``ctx``) the socket gets a context of its
        own, whose I/O thread (the one that reads every byte a replay client sends and writes
        every byte it is sent) runs SCHED_BATCH at the lowest CPU priority (``IO_NICE``): under
        hostile replay traffic on a busy machine the engine's threads get the CPU first. (Only
        that thread: this server's own thread takes the GIL, and a low-priority thread holding
        the GIL would stall the engine.)
        """
        own = not endpoint.startswith("inproc://")
        before = threads()
        if own:
            ctx = zmq.Context(io_threads=1)
            ctx.set(zmq.THREAD_NAME_PREFIX, IO_THREAD_PREFIX)
        sock = ctx.socket(zmq.ROUTER)  # the context's threads start with its first socket
        started = threads() - before if own else set()
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            # per-client message bound, a backstop: the byte accounting binds first
            sock.setsockopt(zmq.SNDHWM, kw.get("client_bytes", 4 << 20) // MSG_OVERHEAD + 2 * CHUNK)
            sock.setsockopt(zmq.RCVHWM, RCVHWM)  # unread requests per connection (see request_rate)
            sock.bind(endpoint)
        except zmq.ZMQError:
            sock.close(0)
            if own:
                ctx.term()
            raise
        server = cls(sock, ring, stats, **kw)
        server._own_ctx = ctx if own else None
        server._io_pending = started  # lowered by the server's thread once they named themselves
        return server

    def start(self) -> None:
        self._thread.start()

    def request_stop(self) -> None:
        """Serve nothing more: a replay in progress ends at its next chunk."""
        self._closing = True

    def stop(self, timeout: float = 2.0) -> None:
        """Stop serving and wait (up to ``timeout``) for the thread, which closes the socket."""
        self._closing = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        elif self._thread.ident is None:  # never started: the socket is still ours to close
            self._sock.close(0)
        if self._own_ctx is not None and not self._thread.is_alive():  # its one socket is closed
            self._own_ctx.term()
            self._own_ctx = None

    def _run(self) -> None:
        batch_thread()  # never preempts the engine thread when a request wakes it (see .sched)
        try:
            self._loop()
        finally:
            self._sock.close(0)

    # ---- the loop ------------------------------------------------------------------------------

    def _loop(self) -> None:
        sock = self._sock
        stats = self._stats
        buckets: dict[bytes, list[float]] = {}  # identity -> [tokens, last refill time]
        waiting: dict[bytes, int] = {}  # identity -> start seq of its pending request
        deferred: set[bytes] = set()  # identities whose pending request was already counted as limited
        replays: dict[bytes, _Replay] = {}
        mirror = self._mirror
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        busy = False  # a replay could send at once
        tries = 100
        rate, burst = self.request_rate, self.request_burst
        tokens, refilled = float(burst), time.monotonic()  # the global cap (see request_rate)
        resume = min(float(burst), max(1.0, rate * PAUSE))  # tokens a paused reader waits for
        paused = False
        while not self._closing:
            if self._io_pending and tries:
                tries -= 1
                lowered, self._io_pending = lower_io_threads(self._io_pending, f"{IO_THREAD_PREFIX}/ZMQbg/IO/", IO_NICE)
                self.io_threads |= lowered
            timeout = 0 if busy else 5 if replays else 20 if waiting else 200
            now = time.monotonic()
            tokens = min(float(burst), tokens + (now - refilled) * rate)
            refilled = now
            if paused and tokens >= resume:
                paused = False
            elif not paused and tokens < 1.0:
                paused = True
                stats.replay_throttled += 1
            if paused:  # read nothing: what was sent waits in libzmq's bounded pipes
                incoming = ()
                if not busy:
                    time.sleep(min(timeout / 1000, (resume - tokens) / rate))
            else:
                incoming, read = self._requests(int(tokens)) if poller.poll(timeout) else ((), 0)
                tokens -= read
            if incoming:
                for ident, start in incoming:
                    stats.replay_requests += 1
                    r = replays.get(ident)
                    if r is not None and r.outstanding >= self.client_bytes:
                        stats.replay_refused += 1  # its earlier answer sits unread: nothing more for it
                        continue
                    if ident in waiting or (r is not None and r.cursor is not None):
                        stats.replay_superseded += 1  # a newer request from the same client replaces it
                        if r is not None and r.cursor is not None:
                            r.cursor = None
                            self._finished(r)
                    waiting[ident] = start
            now = time.monotonic()
            if len(buckets) > MAX_CLIENTS:  # forget idle clients
                buckets = {k: v for k, v in buckets.items() if k in waiting or k in replays}
            for ident in list(waiting):
                bucket = buckets.setdefault(ident, [float(self._burst), now])
                bucket[0] = min(float(self._burst), bucket[0] + (now - bucket[1]) * self._rate)
                bucket[1] = now
                if bucket[0] < 1.0:
                    if ident not in deferred:
                        deferred.add(ident)
                        stats.replay_rate_limited += 1
                    continue
                bucket[0] -= 1.0
                deferred.discard(ident)
                start = waiting.pop(ident)
                r = replays.get(ident)
                if r is None and len(replays) >= MAX_CLIENTS:
                    stats.replay_refused += 1
                    continue
                items = self._ring.items
                end = items[-1][0] if items else -1
                if r is None:
                    replays[ident] = _Replay(ident, start, end, now)
                else:
                    r.restart(start, end, now)
            if not replays and mirror.items:
                mirror.clear()  # nothing to serve: keep no evicted batch alive
            busy = self._round(replays, now)
            stats.replay_active = sum(1 for r in replays.values() if r.cursor is not None)

    def _requests(self, budget: int) -> tuple[list, int]:
        """The well-formed requests waiting on the socket, oldest first (malformed ones counted),
        among at most ``budget`` messages read; and how many were read."""
        sock = self._sock
        out = []
        read = 0
        while read < budget:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            read += 1
            req = parse_replay_request(frames)
            if req is None:
                self._stats.replay_malformed += 1
            else:
                out.append(req)
        return out, read

    def _round(self, replays: dict[bytes, _Replay], now: float) -> bool:
        """One chunk to each replay that may send; True if any could send more at once."""
        stats = self._stats
        busy = False
        for ident, r in list(replays.items()):
            self._release(r, now)
            if r.cursor is None:
                if not r.chunks:
                    del replays[ident]  # done and drained
                continue
            if self._closing:
                return False
            if r.outstanding >= self.client_bytes or stats.replay_outstanding_bytes >= self.total_bytes:
                if now - r.progress > self.stall_timeout:
                    stats.replay_aborted += 1
                    if r.outstanding >= self.client_bytes:
                        stats.replay_stalled += 1  # it stopped reading
                    r.cursor = None
                    self._finished(r)
                continue
            try:
                more = self._send_chunk(r)
            except zmq.Again:  # its pipe is at SNDHWM: nothing of this message was queued
                continue
            except zmq.ZMQError:  # EHOSTUNREACH: the client went away
                self._abort(r)
                continue
            r.progress = now
            busy = busy or more
        return busy

    def _abort(self, r: _Replay) -> None:
        self._stats.replay_aborted += 1
        r.cursor = None
        self._finished(r)

    def _release(self, r: _Replay, now: float) -> None:
        """Forget the chunks ZeroMQ has handed to the client's connection."""
        chunks = r.chunks
        while chunks:
            tracker = chunks[0][0]
            if tracker is None:  # untracked (cut short by SNDHWM): it left when the next tracked one did
                tracker = next((c[0] for c in chunks if c[0] is not None), None)
            if tracker is None or not tracker.done:
                break
            _, nbytes = chunks.popleft()
            r.outstanding -= nbytes
            self._stats.replay_outstanding_bytes -= nbytes
            r.progress = now

    def _chunk(self, r: _Replay) -> list:
        """The next batches of ``r`` from the ring (a snapshot: the live thread appends meanwhile)."""
        mirror = self._mirror
        mirror.sync()
        items = mirror.items
        i = bisect_left(items, r.cursor, lo=mirror.head, key=_seq_of)
        out = []
        nbytes = 0
        for item in items[i:i + CHUNK]:
            if item[0] > r.end or nbytes >= CHUNK_BYTES:
                break
            out.append(item)
            nbytes += len(item[2])
        return out

    def _send_chunk(self, r: _Replay) -> bool:
        """Send one chunk (or the end marker); True if more of ``r`` is ready to go."""
        sock = self._sock
        stats = self._stats
        ident = r.ident
        if r.ending:
            sock.send(ident, _MORE_NOW)
            sock.send(b"", _MORE)
            sock.send(b"", _MORE)
            sock.send(END_SEQ, _MORE)
            sock.send(b"")
            r.cursor = None
            stats.replays_completed += 1
            self._finished(r)
            return False
        chunk = self._chunk(r)
        if not chunk:
            r.ending = True
            return True
        nbytes = 0
        tracker = None
        last = len(chunk) - 1
        for k, (seq, topic, payload) in enumerate(chunk):
            if self._closing:
                break
            try:
                sock.send(ident, _MORE_NOW)  # zmq.Again here: nothing of it queued
            except zmq.Again:
                if not k:
                    raise
                r.chunks.append((None, nbytes))  # what did go is accounted, released with the next chunk
                r.outstanding += nbytes
                stats.replay_outstanding_bytes += nbytes
                return False
            sock.send(b"", _MORE)
            sock.send(topic, _MORE)
            sock.send(seq.to_bytes(SEQ_BYTES, "big"), _MORE)
            if k == last:
                # zero-copy and tracked: when ZeroMQ lets go of it, the whole chunk has left. A
                # Frame made with copy=False: send(copy=False) copies a payload under pyzmq's copy
                # threshold (64 KiB) and returns a tracker that is done at once
                tracker = sock.send(zmq.Frame(payload, track=True, copy=False), 0, copy=False, track=True)
            else:
                sock.send(payload)
            nbytes += len(payload) + len(topic) + MSG_OVERHEAD
            r.cursor = seq + 1
            r.served += 1
            stats.replay_batches_served += 1
        if tracker is not None:
            self._hold(r, tracker, nbytes)
        if r.cursor is not None and r.cursor > r.end:
            r.ending = True
        return True

    def _hold(self, r: _Replay, tracker, nbytes: int) -> None:
        """Count ``nbytes`` sent to ``r`` as outstanding until ``tracker`` says ZeroMQ let go of them
        (None: released with the next chunk)."""
        r.chunks.append((tracker, nbytes))
        r.outstanding += nbytes
        self._stats.replay_outstanding_bytes += nbytes

    def _finished(self, r: _Replay) -> None:
        hooks = self._hooks()
        if hooks is not None:
            hooks.on_replay(r.start, r.served, r.t0)
