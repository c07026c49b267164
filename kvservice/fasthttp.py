"""The HTTP front of every client connection: a lean HTTP/1.1 reader that answers the two hot
routes (``POST /v1/score``, ``POST /v1/pick``) itself, frames every other request and hands it to
aiohttp on the same connection, and bounds every connection (``[http]``, docs/http-limits.md).

Why: aiohttp costs ~70 us of the one event loop per request on this machine (request object,
header multidict, router, middleware, response object, stream writer) where the score itself
costs ~20 us; at 16 closed-loop clients that stack is most of the latency. This protocol reads
a request's head with a few ``bytes`` operations and answers the common, well-formed case
itself, in one ``transport.write``:

* ``POST /v1/score`` or ``/v1/pick``, ``HTTP/1.1``, one ``Content-Length`` within
  ``api.max_body_bytes``, no ``Transfer-Encoding``/``Expect``/``Upgrade``, ``Connection``
  absent, keep-alive or close (answered, then closed), a JSON (or octet-stream, or no) content
  type, the bearer token when one is required, and a body the API answers without awaiting
  anything (``token_ids``, not ``prompt``/``messages``, which need the tokenizer).

**One grammar** (:mod:`kvservice.http_head`): a head that breaks a rule aiohttp's parser also
enforces is answered 400 here, naming the rule; one this reader cannot vouch for (another HTTP
version, a chunked or upgraded request, ``Expect``...) goes to aiohttp unread, and the
connection stays with aiohttp's parser ("opaque").

**The proxy** (``--proxy``): ``POST /v1/completions`` and ``/v1/chat/completions`` of the same
common shape are served by a task per request (:meth:`kvservice.proxy.Proxy.serve`, answering
on this transport through :class:`kvservice.proxy_exchange.FastExchange`); requests that arrive
behind it on the connection are held (counted in ``max_buffered_bytes``) and read once it is
answered, so answers keep their order. A client that hangs up cancels it. While it runs, the
connection is not idle: the proxy's own timeouts bound it.

**Hand-off.** Anything else — another route, a wrong token, a body that fails to decode or
validate, a prompt to tokenize — is given to aiohttp's protocol (one per connection, made on the
first hand-off) as the complete request bytes, after this reader has received them all; the
connection keeps this protocol in front (the transport's protocol), which frames each later
request the same way and forwards it whole. Answers already written come first (they were
written synchronously, before the hand-off), so pipelined requests keep their order; once a
connection has handed a request off, every later request on it goes to aiohttp too.

**Bounds** (:class:`kvservice.http_limits.HttpConfig`): the head within ``header_timeout`` of
its first byte, the body within ``body_timeout`` of the head, ``idle_timeout`` between requests
(aiohttp's keepalive_timeout once handed off; an opaque connection: without a byte from the
client), at most ``max_connections`` open (past it, ``reserved_connections`` more for
``GET /healthz``/``/readyz`` only, the oldest dropped first), at most ``max_buffered_bytes``
held for unfinished requests across all connections, a head within ``max_head_bytes``, a body
within ``api.max_body_bytes``. Each hit is counted (``kvservice_http_limit_hits_total{limit}``)
and answered 408/413/431/503 where nothing else is pending on the connection, else closed. The
timeouts are kept by one sweep over the connections (a few per timeout; the hot path only bumps
a request count). A client that does not read its answers pauses reading (asyncio flow control).

Counted like aiohttp's answers: ``kvservice_http_requests_total{route,method,status}`` and the
latency histogram by route (:class:`kvservice.metrics.HttpMetrics`). Runs on the event-loop
thread only (like every aiohttp handler).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time

from aiohttp import web

from .http_head import BROKEN, HEAD, DateHeader, broken, misfit
from .http_limits import Bounds, HttpConfig
from .proxy_exchange import JSON_HEADERS, FastExchange
from .schema import error_body

__all__ = ["FastHttp", "FastSite"]

log = logging.getLogger("kvservice")

_OK_TYPES = frozenset({b"application/json", b"application/octet-stream", b""})
_PROBES = (b"/healthz", b"/readyz")
#: the proxy's routes (``--proxy``), answered by a task per request (kvservice.proxy)
_PROXIED = frozenset({"/v1/completions", "/v1/chat/completions"})
_REASONS = {400: "Bad Request", 408: "Request Timeout", 413: "Payload Too Large", 431: "Request Header Fields Too Large",
            503: "Service Unavailable"}
class FastHttp(asyncio.Protocol):
    """One client connection: hot routes answered here, the rest framed and handed to aiohttp."""

    __slots__ = ("site", "transport", "buf", "need", "paused", "proto", "opaque", "nreq", "nin", "held",
                 "reserve", "seen", "since", "cont", "task", "blocked", "waiter")

    def __init__(self, site: "FastSite") -> None:
        self.site = site
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.need = 0  #: bytes ``buf`` must hold before parsing again (a body still arriving)
        self.paused = False
        self.proto = None  #: aiohttp's protocol, once a request was handed off
        self.opaque = False  #: aiohttp parses this connection's bytes itself from here on
        self.nreq = 0  #: requests received whole (the sweep's sign of progress)
        self.nin = 0  #: bytes received while opaque (idem)
        self.held = 0  #: bytes of an unfinished request counted in ``site.buffered``
        self.reserve = 0  #: 1: admitted past the cap, for a health probe; 2: its probe arrived
        self.seen = None  #: (phase, progress) at the last sweep that saw it change
        self.since = 0.0
        self.cont = -1  #: ``nreq`` when "100 Continue" was last written (Expect: 100-continue)
        self.task: asyncio.Task | None = None  #: the proxied request in flight (later ones wait in ``buf``)
        self.blocked = False  #: the transport's buffer is over its high-water mark (the client does not read)
        self.waiter: asyncio.Future | None = None  #: a proxied answer's writer, waiting for ``blocked`` to clear

    # ---- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport) -> None:
        self.transport = transport
        self.site.bounds.admit(self)

    def connection_lost(self, exc) -> None:
        self.site.bounds.drop(self)
        self._hold(0)
        self.transport = None
        self._unblock(ConnectionResetError("the client closed the connection"))
        if self.task is not None:
            self.task.cancel()  # the client hung up: its proxied request is cancelled (and so the pod's work)
        if self.proto is not None:
            self.proto.connection_lost(exc)

    def pause_writing(self) -> None:  # the client does not read: stop reading its requests
        self.blocked = True
        if self.proto is not None:
            self.proto.pause_writing()
        elif not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self._unblock(None)
        if self.proto is not None:
            self.proto.resume_writing()
        elif self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    def _unblock(self, exc: BaseException | None) -> None:
        self.blocked = False
        w = self.waiter
        if w is not None and not w.done():
            w.set_exception(exc) if exc is not None else w.set_result(None)

    async def drain(self) -> None:
        """Until the client has read enough of what was written (a proxied answer's flow control)."""
        if self.blocked:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None

    def eof_received(self) -> bool:
        return False  # close; a request cut short is not answered (nothing to answer it with)

    def data_received(self, data: bytes) -> None:
        if self.opaque:
            self.nin += len(data)
            return self.proto.data_received(data)
        buf = self.buf
        if self.task is not None:  # pipelined behind a proxied request: read once it is answered
            buf += data
            return self._hold(len(buf))
        if buf:
            buf += data
            if len(buf) < self.need:
                return self._hold(len(buf))
            old = len(buf) - len(data)
            if not self.need and buf.find(b"\r\n\r\n", max(0, old - 3)) < 0:
                return self._more_head(old)
            data = bytes(buf)
            buf.clear()
        self.need = 0
        n = len(data)
        pos = 0
        site = self.site
        cap = site.max_head
        while pos < n:
            he = data.find(b"\r\n\r\n", pos, pos + cap + 4)
            if he < 0:
                if n - pos > cap:
                    return self._refuse(431, "head_too_large", f"the request head is over http.max_head_bytes ({cap})")
                if broken(data[pos:]):
                    return self._bad(data, pos, BROKEN)
                break
            m = HEAD.fullmatch(data, pos, he)
            if m is None:  # off the common shape: a rule broken (400), or for aiohttp's parser to judge
                why = misfit(data[pos:he])
                return self._bad(data, pos, why) if why else self._opaque(data[pos:])
            method, target, version, block = m.groups()
            length = -1
            hosts = 0
            ctype = b""
            auth = None
            close = False
            fast = True
            chunked = unsure = expect = False
            lines = block.split(b"\r\n")
            for i in range(1, len(lines)):  # lines[0] is empty (the block starts with CRLF)
                name, _, value = lines[i].partition(b":")
                name = name.lower()
                value = value.strip(b" \t")
                if name == b"content-length":
                    # at most 18 digits: int() refuses over 4,300, and no body is that long
                    if length >= 0 or not value.isdigit() or len(value) > 18:
                        return self._bad(data, pos, "Content-Length must be given once, as a decimal number")
                    length = int(value)
                elif name == b"host":
                    hosts += 1
                elif name == b"content-type":
                    ctype = value
                elif name == b"authorization":
                    auth = value
                elif name == b"connection":
                    value = value.lower()
                    if value == b"close":
                        close = True
                    elif value != b"keep-alive":
                        fast = False
                elif name == b"transfer-encoding":
                    chunked = True
                elif name == b"expect":  # aiohttp answers it (417 unless 100-continue)
                    fast = False
                    expect = value.lower() == b"100-continue"
                elif name == b"upgrade":
                    unsure = True
            if hosts != 1:
                if version == b"HTTP/1.1":
                    return self._bad(data, pos, "an HTTP/1.1 request needs exactly one Host header")
                unsure = True
            if chunked:
                if length >= 0:
                    return self._bad(data, pos, "Content-Length and Transfer-Encoding together")
                unsure = True
            if unsure:
                return self._opaque(data[pos:])
            if self.reserve:
                if self.reserve == 2 or method != b"GET" or target.partition(b"?")[0] not in _PROBES:
                    return self._refuse(503, "connections", "the server is at its connection limit "
                                        "(http.max_connections): only GET /healthz and /readyz are answered")
                self.reserve = 2
            if length > site.max_body:
                return self._refuse(413, "body_too_large", f"the request body is over the limit of {site.max_body} bytes")
            end = he + 4 + (length if length > 0 else 0)
            if end > n:
                self.need = end - pos
                if expect and self.proto is None and self.cont != self.nreq:  # nothing else pending
                    self.cont = self.nreq
                    self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                break
            self.nreq += 1
            route = site.routes.get(target) if fast and self.proto is None else None
            if route is not None and method == b"POST" and version == b"HTTP/1.1":
                token = site.token
                if token is None or (auth is not None and auth.startswith(b"Bearer ")
                                     and hmac.compare_digest(auth[7:].strip(), token)):
                    if route in _PROXIED:  # answered by the proxy's task; later requests are held for it
                        self.task = site.loop.create_task(self._proxied(route, data[he + 4:end], lines, close))
                        pos = end
                        break
                    answer = site.answer(route, memoryview(data)[he + 4:end], close) if (  # the body, not copied
                        not ctype or ctype.partition(b";")[0].strip().lower() in _OK_TYPES) else None
                    if answer is not None:
                        self.transport.write(answer)
                        if close:
                            self.transport.close()  # after the answer is flushed; what followed is not read
                            return self._hold(0)
                        pos = end
                        continue
            self._aio().data_received(data[pos:end])
            pos = end
        if pos < n:
            buf += data[pos:] if pos else data
            self._hold(len(buf))
        elif self.held:
            self._hold(0)

    def _more_head(self, old: int) -> None:
        """More of a head still incomplete (``buf[old:]`` new): refused as soon as it breaks the
        grammar or the size cap (aiohttp's parser stops at the first bad byte too), else held."""
        buf = self.buf
        if len(buf) > self.site.max_head:
            return self._refuse(431, "head_too_large", f"the request head is over http.max_head_bytes "
                                f"({self.site.max_head})")
        if broken(buf[old - 1 if old and buf[old - 1] == 13 else old:]):  # a CR left pending: judged now
            return self._bad(bytes(buf), 0, BROKEN)
        self._hold(len(buf))

    # ---- the proxy ---------------------------------------------------------------------------
    async def _proxied(self, route: str, body: bytes, lines: list, close: bool) -> None:
        """A proxied request (kvservice.proxy), answered on this connection; then the requests
        that arrived behind it."""
        site = self.site
        api = site.api
        t0 = time.perf_counter()
        ex = FastExchange(self, lines, close)
        status = 500
        try:
            await api.proxy.serve(ex, body, route == "/v1/chat/completions")
            status = ex.status
        except asyncio.CancelledError:  # the client hung up: its own abort (499), as on aiohttp's side
            status = 499
            raise
        except Exception:  # noqa: BLE001 — never a traceback to the client
            api.internal_errors += 1
            log.exception("internal error on POST %s (counted)", route)
            if ex.status:
                ex.abort()  # the answer had started: cut, not ended cleanly
            else:
                ex.whole(500, JSON_HEADERS, error_body(500, "internal error (logged on the server)", None,
                                                       "internal_error"))
        finally:
            self.task = None
            api.metrics.observe(route, "POST", status, time.perf_counter() - t0)
        t = self.transport
        if t is None:
            return
        if close:
            t.close()  # after the answer is flushed; what followed is not read
            self.buf.clear()
            return self._hold(0)
        if self.buf:  # requests pipelined behind this one, in order
            data = bytes(self.buf)
            self.buf.clear()
            self._hold(0)
            self.data_received(data)

    # ---- hand-off ----------------------------------------------------------------------------
    def _aio(self):
        """aiohttp's protocol for this connection (made on the first hand-off)."""
        proto = self.proto
        if proto is None:
            site = self.site
            site.handoffs += 1
            proto = self.proto = site.slow()
            proto.connection_made(self.transport)
            if self.paused:  # aiohttp's writer now waits for the client instead
                self.paused = False
                self.transport.resume_reading()
                proto.pause_writing()
        return proto

    def _opaque(self, rest: bytes) -> None:
        """Give this request onwards to aiohttp's parser, for the rest of the connection."""
        self.buf.clear()
        self._hold(0)
        if self.transport is None or self.transport.is_closing():
            return
        proto = self._aio()
        self.opaque = True
        self.nin = len(rest)
        proto.data_received(rest)

    def _bad(self, data: bytes, pos: int, message: str) -> None:
        """A head aiohttp's parser refuses too: answered 400 here (nothing else pending), else
        given to aiohttp to answer in order."""
        if self.proto is not None:
            return self._opaque(data[pos:])
        self.site.api.metrics.observe("malformed", "-", 400, 0.0)
        self._answer_close(400, message, "malformed_request")
        self.buf.clear()
        self._hold(0)

    def _refuse(self, status: int, limit: str, message: str) -> None:
        """A limit hit: counted; answered ``status`` when nothing else is pending, and closed."""
        site = self.site
        site.bounds.limit_hits[limit] += 1
        site.api.metrics.observe("limit", "-", status, 0.0)
        if self.proto is None:
            self._answer_close(status, message, "limit_" + limit)
        elif self.transport is not None:
            self.transport.close()
        self.buf.clear()
        self._hold(0)

    def _answer_close(self, status: int, message: str, kind: str) -> None:
        t = self.transport
        if t is None or t.is_closing():
            return
        body = error_body(status, message, None, kind)
        t.write(b"".join((f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: application/json; charset=utf-8\r\n"
                          f"Content-Length: {len(body)}\r\nConnection: close\r\n".encode(), b"Date: ",
                          self.site.date(), b"\r\nServer: kvevents\r\n\r\n", body)))
        t.close()

    def _hold(self, n: int) -> None:
        """Count ``n`` bytes of an unfinished request as held (``http.max_buffered_bytes``)."""
        bounds = self.site.bounds
        bounds.buffered += n - self.held
        self.held = n
        if n and bounds.buffered > bounds.max_buffered:
            self._refuse(503, "buffered_bytes", "the server holds too many bytes of unfinished requests "
                         "(http.max_buffered_bytes): retry later")

    def expire(self, limit: str) -> None:
        """A timeout (the sweep): 408 for a request cut short when nothing else is pending, else
        closed."""
        if limit == "idle_timeout" or self.proto is not None:
            self.site.bounds.limit_hits[limit] += 1
            self.buf.clear()
            self._hold(0)
            if self.transport is not None:
                self.transport.close()
            return
        self._refuse(408, limit, f"the request was not received within http.{limit} "
                     f"({getattr(self.site.bounds.limits, limit)} s)")


class FastSite(web.TCPSite):
    """A TCPSite whose connections start on :class:`FastHttp`; ``api`` (a
    :class:`kvservice.api.Api`) answers the hot routes via :meth:`Api.fast_answer` (``fast``
    False: every request goes to aiohttp, the bounds still apply)."""

    def __init__(self, runner: web.AppRunner, api, host: str | None, port: int | None, *, fast: bool = True,
                 **kw) -> None:
        super().__init__(runner, host, port, **kw)
        self.api = api
        cfg = api.fleet.cfg
        self.bounds = Bounds(getattr(cfg, "http", None) or HttpConfig())  #: the connections and their limits
        self.handoffs = 0  #: connections given to aiohttp (another route, an error, a prompt...)
        self.max_body = cfg.api.max_body_bytes
        self.max_head = self.bounds.max_head
        self.token = api.token.encode() if api.token is not None else None
        self.routes = {b"/v1/score": "/v1/score", b"/v1/pick": "/v1/pick"} if fast else {}
        if fast and api.proxy is not None:
            self.routes.update((r.encode(), r) for r in _PROXIED)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.slow = None  # aiohttp's protocol factory (web.Server), set by start()
        self._date = DateHeader()

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with the runner
        self.slow = self._runner.server
        loop = self.loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: FastHttp(self), self._host, self._port,
                                                backlog=self._backlog, reuse_address=self._reuse_address,
                                                reuse_port=self._reuse_port)
        self._bound_port = self._server.sockets[0].getsockname()[1] if self._server.sockets else self._port
        self.bounds.start(loop)

    async def stop(self) -> None:
        self.bounds.stop()
        await super().stop()
        for c in list(self.bounds.conns):  # aiohttp closes the handed-off ones itself
            if c.transport is not None and c.proto is None:
                c.transport.close()

    def date(self) -> bytes:
        """The ``Date`` header's value (formatted once a second)."""
        return self._date.get()

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
                         str(len(out)).encode(), b"\r\nDate: ", self.date(),
                         b"\r\nServer: kvevents\r\nConnection: close\r\n\r\n" if close else b"\r\nServer: kvevents\r\n\r\n",
                         out))
