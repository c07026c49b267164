"""A lean HTTP/1.1 front for the two hot routes (``POST /v1/score``, ``POST /v1/pick``), with
everything else handed to aiohttp on the same connection.

Why: aiohttp costs ~70 us of the one event loop per request on this machine (request object,
header multidict, router, middleware, response object, stream writer) where the score itself
costs ~20 us; at 16 closed-loop clients that stack is most of the latency. This protocol reads
a request's head with a few ``bytes`` operations and answers the common, well-formed case
itself, synchronously, in one ``transport.write``:

* ``POST /v1/score`` or ``/v1/pick``, ``HTTP/1.1``, one ``Content-Length`` within
  ``api.max_body_bytes``, no ``Transfer-Encoding``/``Expect``/``Upgrade``, ``Connection``
  absent, keep-alive or close (answered, then closed), a JSON (or octet-stream, or no) content type, the bearer token when
  one is required, and a body the API answers without awaiting anything (``token_ids``, not
  ``prompt``/``messages``, which need the tokenizer).

Anything else — another route, HTTP/1.0, a chunked body, a wrong token, a body that fails to
decode or validate, a prompt to tokenize, an over-long head — is **handed off**: the connection
is given to aiohttp's own protocol (``transport.set_protocol``) together with the bytes of the
request and whatever followed it, so aiohttp parses them from the start and answers exactly as
it always did (the 401, 413, 415 and 4xx error JSON, the async tokenizer, the proxy routes).
A connection handed off stays with aiohttp. Answers already written come first (they were
written synchronously, before the hand-off), so pipelined requests keep their order.

Counted like aiohttp's answers: ``kvservice_http_requests_total{route,method,status}`` and the
latency histogram by route (:class:`kvservice.metrics.HttpMetrics`), from the same clock
points (route handling only, not the socket). Bounds: a head is at most ``MAX_HEAD`` bytes and
a body at most ``max_body_bytes`` (else hand-off, where aiohttp answers 413/431); a client that
does not read its answers pauses reading once the transport's write buffer is over its high
water mark (asyncio flow control), so nothing grows without bound.

Runs on the event-loop thread only (like every aiohttp handler).
"""

from __future__ import annotations

import asyncio
import hmac
import time
from email.utils import formatdate

from aiohttp import web

__all__ = ["FastHttp", "FastSite", "MAX_HEAD"]

#: the most bytes of request line + headers read before giving the connection to aiohttp
MAX_HEAD = 8192
_OK_TYPES = frozenset({b"application/json", b"application/octet-stream", b""})


class _Date:
    """The ``Date`` header, formatted once a second."""

    __slots__ = ("sec", "value")

    def __init__(self) -> None:
        self.sec = -1
        self.value = b""

    def get(self) -> bytes:
        now = int(time.time())
        if now != self.sec:
            self.sec = now
            self.value = formatdate(now, usegmt=True).encode()
        return self.value


class FastHttp(asyncio.Protocol):
    """One client connection: hot routes answered here, the rest handed to aiohttp."""

    __slots__ = ("site", "transport", "buf", "need", "paused", "handed")

    def __init__(self, site: "FastSite") -> None:
        self.site = site
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.need = 0  #: bytes ``buf`` must hold before parsing again (a body still arriving)
        self.paused = False
        self.handed = False

    # ---- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.site.conns.add(self)

    def connection_lost(self, exc) -> None:
        self.site.conns.discard(self)
        self.transport = None

    def pause_writing(self) -> None:  # the client does not read: stop reading its requests
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    def eof_received(self) -> bool:
        return False  # close; a request cut short is not answered (nothing to answer it with)

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        if buf:
            buf += data
            if len(buf) < self.need:
                return
            data = bytes(buf)
            buf.clear()
        self.need = 0
        n = len(data)
        pos = 0
        site = self.site
        while pos < n:
            he = data.find(b"\r\n\r\n", pos, pos + MAX_HEAD + 4)
            if he < 0:
                if n - pos > MAX_HEAD:
                    return self._handoff(data[pos:])
                break
            le = data.find(b"\r\n", pos, he + 2)
            parts = data[pos:le].split(b" ")
            route = site.routes.get(parts[1]) if len(parts) == 3 else None
            if route is None or parts[0] != b"POST" or parts[2] != b"HTTP/1.1":
                return self._handoff(data[pos:])
            length = -1
            ctype = b""
            auth = None
            close = False
            for line in data[le + 2:he].split(b"\r\n"):
                name, sep, value = line.partition(b":")
                name = name.lower()
                if not sep or name != name.strip() or not name:
                    return self._handoff(data[pos:])  # obs-fold, a space before ':', no ':'
                value = value.strip()
                if name == b"content-length":
                    # at most 18 digits: int() refuses over 4,300, and no body is that long
                    if length >= 0 or not value.isdigit() or len(value) > 18:
                        return self._handoff(data[pos:])
                    length = int(value)
                elif name == b"content-type":
                    ctype = value
                elif name == b"authorization":
                    auth = value
                elif name == b"connection":
                    value = value.lower()
                    if value == b"close":
                        close = True
                    elif value != b"keep-alive":
                        return self._handoff(data[pos:])
                elif name in (b"transfer-encoding", b"expect", b"upgrade"):
                    return self._handoff(data[pos:])
            if length < 0 or length > site.max_body:
                return self._handoff(data[pos:])
            if ctype and ctype.partition(b";")[0].strip().lower() not in _OK_TYPES:
                return self._handoff(data[pos:])
            token = site.token
            if token is not None and not (auth is not None and auth.startswith(b"Bearer ")
                                          and hmac.compare_digest(auth[7:].strip(), token)):
                return self._handoff(data[pos:])
            end = he + 4 + length
            if end > n:
                self.need = end - pos
                break
            answer = site.answer(route, memoryview(data)[he + 4:end], close)  # the body, not copied
            if answer is None:
                return self._handoff(data[pos:])
            self.transport.write(answer)
            if close:
                self.transport.close()  # after the answer is flushed; what followed is not read
                return
            pos = end
        if pos < n:
            buf += data[pos:] if pos else data

    # ---- hand-off ----------------------------------------------------------------------------
    def _handoff(self, rest: bytes) -> None:
        """Give the connection, and ``rest`` (this request onwards), to aiohttp's protocol."""
        t = self.transport
        self.buf.clear()
        self.handed = True
        self.site.conns.discard(self)
        self.site.handoffs += 1
        if t is None or t.is_closing():
            return
        if self.paused:
            self.paused = False
            t.resume_reading()
        proto = self.site.slow()
        t.set_protocol(proto)
        proto.connection_made(t)
        if rest:
            proto.data_received(rest)


class FastSite(web.TCPSite):
    """A TCPSite whose connections start on :class:`FastHttp`; ``api`` (a
    :class:`kvservice.api.Api`) answers the hot routes via :meth:`Api.fast_answer`."""

    def __init__(self, runner: web.AppRunner, api, host: str | None, port: int | None, **kw) -> None:
        super().__init__(runner, host, port, **kw)
        self.api = api
        self.conns: set[FastHttp] = set()
        self.handoffs = 0  #: connections given to aiohttp (another route, an error, a prompt...)
        self.max_body = api.fleet.cfg.api.max_body_bytes
        self.token = api.token.encode() if api.token is not None else None
        self.routes = {b"/v1/score": "/v1/score", b"/v1/pick": "/v1/pick"}
        self.slow = None  # aiohttp's protocol factory (web.Server), set by start()
        self._date = _Date()

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with the runner
        self.slow = self._runner.server
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: FastHttp(self), self._host, self._port,
                                                backlog=self._backlog, reuse_address=self._reuse_address,
                                                reuse_port=self._reuse_port)
        self._bound_port = self._server.sockets[0].getsockname()[1] if self._server.sockets else self._port

    async def stop(self) -> None:
        await super().stop()
        for c in list(self.conns):  # aiohttp closes the handed-off ones itself
            if c.transport is not None:
                c.transport.close()
        self.conns.clear()

    def answer(self, route: str, body: bytes | memoryview, close: bool = False) -> bytes | None:
        """The whole HTTP answer for a hot route, or None to hand the request to aiohttp."""
        t0 = time.perf_counter()
        api = self.api
        try:
            out = api.fast_answer(route, body)
        except Exception:  # noqa: BLE001 — aiohttp answers it again, with the error JSON
            return None
        if out is None:
            return None
        api.metrics.observe(route, "POST", 200, time.perf_counter() - t0)
        return b"".join((b"HTTP/1.1 200 OK\r\nContent-Type: application/json; charset=utf-8\r\nContent-Length: ",
                         str(len(out)).encode(), b"\r\nDate: ", self._date.get(),
                         b"\r\nServer: kvevents\r\nConnection: close\r\n\r\n" if close else b"\r\nServer: kvevents\r\n\r\n",
                         out))
