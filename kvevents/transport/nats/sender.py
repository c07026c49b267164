"""Publishing to the stream with pipelined acknowledgements, in order, exactly once.

A :class:`PlaneSender` owns a NATS connection on a :class:`LoopThread`. Producers (the bridge's
loop, the ``nats`` publisher) hand it messages from their own thread; at most ``window``
messages are unacknowledged at a time (``put`` waits for room: backpressure, counted in
``stats['window_waits']``; ``try_put`` refuses instead). Messages leave in the order they were
put. A failed or missing acknowledgement (the server restarted, the connection dropped) stops
new sends; once the connection is back every unacknowledged message is sent again, in order,
one at a time: those the server already stored come back as duplicates (same ``Nats-Msg-Id``)
and are dropped by the stream, the others are stored. Nothing is given up on.

The send path is our own, not nats-py's ``publish_async``: each message is one HPUB frame whose
reply subject is ``<our ack inbox>.<ordinal>``, handed to the connection's outgoing buffer as
its parts (the frame line and headers, then the body's buffers: a packed body is a list of
length prefixes and payloads, never joined here), so a message's bytes are copied once, when
the connection writes its buffer out (nats-py's path copied a large body four to five times:
the pack, two concatenations, the buffer join, the partial-send remainder). Acknowledgements
arrive on one wildcard subscription and are matched by ordinal. The resend after a failure
uses nats-py's request path (``js.publish``), one message at a time.

Acknowledgements are read as JSON. One that says ``duplicate`` means the stream already holds a
message under this id: our own from an earlier send (a re-send), or someone else's stored first
(then ours was NOT stored). The sender reads the held message back and compares it with ours;
if it differs it counts ``not_stored`` and puts a GAP control message with reason ``forged``
for that message's batches into the stream (``forged_reports``), so no reader takes the other
message for the pod's. A held message it cannot read back is counted (``unverified_duplicates``).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import deque
from dataclasses import dataclass

from ...errors import DecodeError
from .loop import LoopThread, connect
from .wire import StreamSpec, parse_headers, plane_headers


def body_bytes(body) -> bytes:
    """A message body as one bytes object (a body may be a list of buffers, see the module doc)."""
    return body if isinstance(body, (bytes, bytearray)) else b"".join(body)


def parse_ack(data: bytes) -> dict | None:
    """A JetStream publish acknowledgement read as JSON (nats-server writes ``"duplicate": true``
    with a space: matching bytes missed it); None for an error or anything that is not an ack."""
    try:
        ack = json.loads(data)
    except (ValueError, TypeError):
        return None
    if not isinstance(ack, dict) or "error" in ack or not isinstance(ack.get("seq"), int):
        return None
    return ack


def body_len(body) -> int:
    return len(body) if isinstance(body, (bytes, bytearray)) else sum(map(len, body))


@dataclass(slots=True)
class Outgoing:
    subject: str
    body: bytes | list  #: bytes, or a list of buffers sent back to back (a packed body)
    headers: dict[str, str]
    ordinal: int = 0
    sent_at: float = 0.0
    future: object = None
    acked: bool = False
    windowed: bool = True  #: holds a place in the window (a report the sender adds itself may not)


class PlaneSender:
    def __init__(self, url: str, stream: StreamSpec | None = None, *, window: int = 512, ack_timeout: float = 5.0,
                 name: str = "kvevents-plane", on_not_stored=None) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self.url = url
        self.stream = stream or StreamSpec()
        self.window = window
        self.ack_timeout = ack_timeout
        self.stats = {"sent": 0, "acked": 0, "duplicates": 0, "resent": 0, "ack_failures": 0, "window_waits": 0,
                      "reordered": 0, "disconnects": 0, "reconnects": 0, "errors": 0, "bytes": 0,
                      "not_stored": 0, "unverified_duplicates": 0, "forged_reports": 0}
        #: called on the sender's loop with an :class:`Outgoing` whose id the stream already held
        #: for a DIFFERENT message (a forgery under our id): ours was not stored (see ``_verify``)
        self.on_not_stored = on_not_stored
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
        self._ack_prefix = f"{self.nc.new_inbox()}."
        self._ack_wait: dict[int, Outgoing] = {}  #: ordinal -> message sent on the fast path, not yet acknowledged
        await self.nc.subscribe(f"{self._ack_prefix}*", cb=self._on_ack_msg)
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
            nc = self.nc
            sent = 0
            while self._queue and not self._failed:
                out = self._queue.popleft()
                if not nc.is_connected or nc.is_reconnecting:
                    self._queue.appendleft(out)
                    self._failed = True
                    self.stats["ack_failures"] += 1
                    break
                out.sent_at = time.monotonic()
                out.future = out.ordinal
                self._ack_wait[out.ordinal] = out
                self._frame(nc, out)
                self._inflight.append(out)
                sent += 1
                if nc._pending_data_size >= self.FLUSH_BYTES:  # noqa: SLF001
                    # write out now and wait: one huge buffer would be joined, then sent from a
                    # buffer whose every partial send moves all the rest (quadratic)
                    if not await self._flush(nc, True):
                        break
            if sent:
                self.stats["sent"] += sent
                await self._flush(nc, False)

    FLUSH_BYTES = 1 << 20  #: outgoing bytes buffered before the pump waits for them to be written

    async def _flush(self, nc, wait: bool) -> bool:
        try:
            await nc._flush_pending(force_flush=wait)  # noqa: SLF001 - nats-py's writer task writes the buffer
            return True
        except Exception:
            self._failed = True  # what was buffered goes out with the reconnect; the resync re-sends it
            return False

    def _frame(self, nc, out: Outgoing) -> None:
        """One HPUB frame into the connection's outgoing buffer, as parts (copied once, when written)."""
        hdr = "NATS/1.0\r\n" + "".join(f"{k}: {v}\r\n" for k, v in out.headers.items()) + "\r\n"
        body = out.body
        parts = body if type(body) is list else [body]
        size = body_len(body)
        head = f"HPUB {out.subject} {self._ack_prefix}{out.ordinal} {len(hdr)} {len(hdr) + size}\r\n{hdr}".encode()
        pending = nc._pending  # noqa: SLF001 - nats-py's outgoing buffer (a list of bytes its writer joins)
        pending.append(head)
        pending.extend(parts)
        pending.append(b"\r\n")
        nc._pending_data_size += len(head) + size + 2  # noqa: SLF001
        self.stats["bytes"] += size

    async def _on_ack_msg(self, msg) -> None:
        """An acknowledgement of a fast-path message, JSON: ``{"stream":..,"seq":..[,"duplicate": true]}``
        or ``{"error":{...}}``; matched to its message by the ordinal in the reply subject."""
        try:
            ordinal = int(msg.subject[len(self._ack_prefix):])
        except ValueError:
            return
        out = self._ack_wait.pop(ordinal, None)
        if out is None or out.future != ordinal or out.acked:
            return  # abandoned by a resync (it re-sent the message itself)
        ack = parse_ack(msg.data)
        if ack is None:
            if not self._failed:
                self.stats["ack_failures"] += 1
            self._failed = True
            self._wake.set()
            return
        out.acked = True
        if ack.get("duplicate") is True:
            self.stats["duplicates"] += 1
            self._check_duplicate(out, ack["seq"])
        self._settle()

    def _check_duplicate(self, out: Outgoing, seq: int) -> None:
        """A duplicate ack says the stream already holds a message under our id, at ``seq``:
        ours (a re-send), or another's stored first (a forgery: ours was NOT stored)."""
        self._lt.loop.create_task(self._verify(out, seq))

    async def _verify(self, out: Outgoing, seq: int) -> None:
        try:
            held = await self.js.get_msg(self.stream.name, seq)
        except Exception:
            self.stats["unverified_duplicates"] += 1  # purged meanwhile, or no permission to read it
            return
        hdrs = held.headers or {}
        if held.data == body_bytes(out.body) and all(hdrs.get(k) == v for k, v in out.headers.items()):
            return  # our own message, stored by an earlier send
        self.stats["not_stored"] += 1
        self._report_not_stored(out)
        if self.on_not_stored is not None:
            try:
                self.on_not_stored(out)
            except Exception:
                self.stats["errors"] += 1

    def _report_not_stored(self, out: Outgoing) -> None:
        """Tell every reader that the batches of ``out`` are not in the stream: a GAP control
        message with reason ``forged`` for them (readers deliver it even for seqs they delivered:
        what they applied there was not the pod's)."""
        try:
            m = parse_headers(out.headers)
        except DecodeError:
            return  # not a plane message: nothing to report it as
        if m.kind != "batch":
            return  # a control message: its loss is the forger's message's meaning, nothing to say
        h = plane_headers("gap", m.pod, m.topic, m.rank, m.seq, m.run, m.count, "forged", m.model)
        gap = self._make(out.subject, b"", h)
        gap.windowed = self._room.acquire(blocking=False)  # on the loop: never wait for room here
        self.stats["forged_reports"] += 1
        self._enqueue(gap)

    def _settle(self) -> None:
        inflight = self._inflight
        while inflight and inflight[0].acked:
            if inflight.popleft().windowed:
                self._room.release()
            self.stats["acked"] += 1

    def _sweep(self) -> None:
        """An acknowledgement that never came (lost with a connection) counts as failed."""
        if self._inflight and not self._failed:
            head = self._inflight[0]
            if not head.acked and time.monotonic() - head.sent_at > self.ack_timeout:
                self.stats["ack_failures"] += 1
                self._failed = True

    async def _resync(self) -> None:
        """Send every unacknowledged message again, in order, one at a time, until all are stored."""
        self._ack_wait.clear()  # late acknowledgements of what is re-sent below are ignored
        for out in self._inflight:
            out.future = None
        self._inflight.extend(self._queue)
        self._queue.clear()
        pending = [o for o in self._inflight if not o.acked]
        seen_dup = False
        while pending and not self._closed:
            out = pending[0]
            try:
                ack = await self.js.publish(out.subject, body_bytes(out.body), headers=out.headers,
                                            timeout=self.ack_timeout)
            except Exception:
                await asyncio.sleep(0.2)  # the connection is still down: nats-py reconnects by itself
                continue
            pending.pop(0)
            self.stats["resent"] += 1
            if ack.duplicate:
                self.stats["duplicates"] += 1
                seen_dup = True
                self._check_duplicate(out, ack.seq)
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
