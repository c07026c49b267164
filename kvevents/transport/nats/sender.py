"""Publishing to the stream with pipelined acknowledgements, in order, exactly once.

A :class:`PlaneSender` owns a NATS connection on a :class:`LoopThread`. Producers (the bridge's
loop, the ``nats`` publisher) hand it messages from their own thread; at most ``window``
messages are unacknowledged at a time (``put`` waits for room: backpressure, counted in
``stats['window_waits']``; ``try_put`` refuses instead). Messages leave in the order they were
put. A failed or missing acknowledgement (the server restarted, the connection dropped) stops
new sends; once the connection is back every unacknowledged message is sent again, in order,
one at a time: those the server already stored come back as duplicates (same ``Nats-Msg-Id``)
and are dropped by the stream, the others are stored. Nothing is given up on.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from dataclasses import dataclass

from ._loop import LoopThread, connect
from .wire import StreamSpec


@dataclass(slots=True)
class Outgoing:
    subject: str
    body: bytes
    headers: dict[str, str]
    ordinal: int = 0
    sent_at: float = 0.0
    future: object = None
    acked: bool = False


class PlaneSender:
    def __init__(self, url: str, stream: StreamSpec | None = None, *, window: int = 512, ack_timeout: float = 5.0,
                 name: str = "kvevents-plane") -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self.url = url
        self.stream = stream or StreamSpec()
        self.window = window
        self.ack_timeout = ack_timeout
        self.stats = {"sent": 0, "acked": 0, "duplicates": 0, "resent": 0, "ack_failures": 0, "window_waits": 0,
                      "reordered": 0, "disconnects": 0, "reconnects": 0, "errors": 0, "bytes": 0}
        self._room = threading.Semaphore(window)
        self._lt = LoopThread(name)
        self._inflight: deque[Outgoing] = deque()
        self._queue: deque[Outgoing] = deque()
        self._ordinal = 0
        self._failed = False
        self._closed = False
        self._lock = threading.Lock()
        self.nc = None
        self.js = None
        self._lt.start(self._start())

    # ---- on the loop thread ---------------------------------------------------------------

    def _event(self, what: str) -> None:
        self.stats[what] += 1

    async def _start(self) -> None:
        self.nc = await connect(self.url, "kvevents-plane-sender", on_event=self._event)
        self.js = self.nc.jetstream(publish_async_max_pending=self.window + 1)
        await self.stream.ensure(self.js)
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._pump())

    async def _pump(self) -> None:
        while not self._closed:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=min(1.0, self.ack_timeout / 2))
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            self._sweep()
            if self._failed:
                await self._resync()
                continue
            while self._queue and not self._failed:
                out = self._queue.popleft()
                try:
                    out.sent_at = time.monotonic()
                    fut = await self.js.publish_async(out.subject, out.body, headers=out.headers)
                except Exception:
                    self._queue.appendleft(out)
                    self._failed = True
                    self.stats["ack_failures"] += 1
                    break
                out.future = fut
                self._inflight.append(out)
                self.stats["sent"] += 1
                self.stats["bytes"] += len(out.body)
                fut.add_done_callback(lambda f, o=out: self._on_ack(o, f))

    def _on_ack(self, out: Outgoing, fut) -> None:
        if out.future is not fut or out.acked:
            return  # abandoned by a resync
        if fut.cancelled() or fut.exception() is not None:
            if not self._failed:
                self.stats["ack_failures"] += 1
            self._failed = True
            self._wake.set()
            return
        out.acked = True
        if getattr(fut.result(), "duplicate", False):
            self.stats["duplicates"] += 1
        self._settle()

    def _settle(self) -> None:
        inflight = self._inflight
        while inflight and inflight[0].acked:
            inflight.popleft()
            self.stats["acked"] += 1
            self._room.release()

    def _sweep(self) -> None:
        """An acknowledgement that never came (lost with a connection) counts as failed."""
        if self._inflight and not self._failed:
            head = self._inflight[0]
            if not head.acked and time.monotonic() - head.sent_at > self.ack_timeout:
                self.stats["ack_failures"] += 1
                self._failed = True

    async def _resync(self) -> None:
        """Send every unacknowledged message again, in order, one at a time, until all are stored."""
        for out in self._inflight:
            fut, out.future = out.future, None
            if fut is not None and not fut.done():
                fut.cancel()
        self._inflight.extend(self._queue)
        self._queue.clear()
        pending = [o for o in self._inflight if not o.acked]
        seen_dup = False
        while pending and not self._closed:
            out = pending[0]
            try:
                ack = await self.js.publish(out.subject, out.body, headers=out.headers, timeout=self.ack_timeout)
            except Exception:
                await asyncio.sleep(0.2)  # the connection is still down: nats-py reconnects by itself
                continue
            pending.pop(0)
            self.stats["resent"] += 1
            if ack.duplicate:
                self.stats["duplicates"] += 1
                seen_dup = True
            elif seen_dup and out.ordinal <= self._last_dup_ordinal:
                self.stats["reordered"] += 1
            if ack.duplicate:
                self._last_dup_ordinal = out.ordinal
            out.acked = True
        self._failed = False
        self._settle()

    _last_dup_ordinal = -1

    def _enqueue(self, out: Outgoing) -> None:
        self._queue.append(out)
        self._wake.set()

    # ---- from any thread ------------------------------------------------------------------

    def _make(self, subject: str, body: bytes, headers: dict[str, str]) -> Outgoing:
        with self._lock:
            self._ordinal += 1
            return Outgoing(subject, body, headers, self._ordinal)

    def put(self, subject: str, body: bytes, headers: dict[str, str]) -> None:
        """Queue one message; waits while ``window`` messages are unacknowledged."""
        if not self._room.acquire(blocking=False):
            self.stats["window_waits"] += 1
            while not self._room.acquire(timeout=0.5):
                if self._closed:
                    raise RuntimeError("PlaneSender is closed")
        self._lt.loop.call_soon_threadsafe(self._enqueue, self._make(subject, body, headers))

    def put_many(self, items: list[tuple[str, bytes, dict[str, str]]]) -> None:
        """Queue several messages with one wake-up of the loop (the bridge's per-poll batch)."""
        outs = []
        for subject, body, headers in items:
            if not self._room.acquire(blocking=False):
                if outs:
                    self._lt.loop.call_soon_threadsafe(self._enqueue_many, outs)
                    outs = []
                self.stats["window_waits"] += 1
                while not self._room.acquire(timeout=0.5):
                    if self._closed:
                        raise RuntimeError("PlaneSender is closed")
            outs.append(self._make(subject, body, headers))
        if outs:
            self._lt.loop.call_soon_threadsafe(self._enqueue_many, outs)

    def _enqueue_many(self, outs: list[Outgoing]) -> None:
        self._queue.extend(outs)
        self._wake.set()

    def try_put(self, subject: str, body: bytes, headers: dict[str, str]) -> bool:
        """Queue one message if the window has room; False (nothing queued) if not."""
        if not self._room.acquire(blocking=False):
            return False
        self._lt.loop.call_soon_threadsafe(self._enqueue, self._make(subject, body, headers))
        return True

    def unacked(self) -> int:
        return self.window - self._room._value  # noqa: SLF001 - a count for health, read without the lock

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued message is acknowledged; False if ``timeout`` passed first."""
        deadline = time.monotonic() + timeout
        got = 0
        while got < self.window:
            left = deadline - time.monotonic()
            if left <= 0 or not self._room.acquire(timeout=left):
                break
            got += 1
        for _ in range(got):
            self._room.release()
        return got == self.window

    def call(self, coro, timeout: float | None = 30.0):
        """Run a coroutine on the sender's loop (it may use ``self.js``)."""
        return self._lt.call(coro, timeout)

    def close(self, timeout: float = 5.0) -> bool:
        """Flush (up to ``timeout``), then close the connection. True if everything was acknowledged."""
        if self._closed:
            return True
        clean = self.flush(timeout)
        self._closed = True
        self._lt.close_connection(self.nc, before=self._wake.set)
        return clean
