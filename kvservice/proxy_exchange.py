"""The client's side of one proxied request, for :class:`kvservice.proxy.Proxy`: the request's
headers in, the answer out — whole (:meth:`whole`) or passed through as it comes (:meth:`start`,
:meth:`write`, :meth:`end`), or cut (:meth:`abort`).

Two fronts carry a client's request, and the proxy's logic is the same for both:

* :class:`FastExchange` — the common request (``POST``, HTTP/1.1, a ``Content-Length`` body, no
  ``Expect``/``Upgrade``), framed by :class:`kvservice.fasthttp.FastHttp` and answered on its
  transport: the answer's head and body in one write, a stream in HTTP/1.1 chunks, flow control
  from the transport (a client that stops reading holds the writer, bounded by
  ``proxy.client_write_timeout``);
* :class:`AioExchange` — every other request, through aiohttp's request and response objects.
"""

from __future__ import annotations

from http import HTTPStatus

from aiohttp import web

__all__ = ["AioExchange", "FastExchange", "JSON_HEADERS"]

JSON_HEADERS = [("Content-Type", "application/json")]
_REASONS = {s.value: s.phrase for s in HTTPStatus}


class AioExchange:
    """A request aiohttp parsed; the answer is aiohttp's response object (:attr:`response`)."""

    __slots__ = ("request", "response", "status")

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None
        self.status = 0

    def items(self):
        return self.request.headers.items()

    def header(self, name: str) -> str | None:
        return self.request.headers.get(name)

    def whole(self, status: int, headers: list, body: bytes) -> None:
        self.status = status
        self.response = web.Response(body=body, status=status, headers=headers)

    async def start(self, status: int, headers: list, length: int | None) -> None:
        self.status = status
        resp = self.response = web.StreamResponse(status=status, headers=headers)
        if length is not None:
            resp.content_length = length
        await resp.prepare(self.request)

    async def write(self, chunk: bytes) -> None:
        await self.response.write(chunk)

    async def end(self) -> None:
        await self.response.write_eof()

    def abort(self) -> None:
        t = self.request.transport
        if t is not None:
            t.abort()  # no clean end: the client sees the answer cut


class FastExchange:
    """A request the lean front framed (``lines``: its head's header lines, ``bytes``); the
    answer written on the connection's transport. ``close``: the client asked for
    ``Connection: close`` (the connection is closed after the answer)."""

    __slots__ = ("conn", "lines", "close", "status", "chunked", "_items")

    def __init__(self, conn, lines: list, close: bool) -> None:
        self.conn = conn  #: the kvservice.fasthttp.FastHttp connection
        self.lines = lines
        self.close = close
        self.status = 0
        self.chunked = False
        self._items: list | None = None

    def items(self) -> list:
        items = self._items
        if items is None:
            items = self._items = []
            for line in self.lines:
                name, sep, value = line.partition(b":")
                if sep:
                    items.append((name.decode("latin-1"), value.strip(b" \t").decode("latin-1")))
        return items

    def header(self, name: str) -> str | None:
        name = name.lower()
        for k, v in self.items():
            if k.lower() == name:
                return v
        return None

    def _head(self, status: int, headers: list, framing: bytes) -> bytes:
        self.status = status
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}\r\n"]
        lines += [f"{k}: {v}\r\n" for k, v in headers]
        head = "".join(lines).encode("latin-1", "replace")
        return b"".join((head, framing, b"Date: ", self.conn.site.date(), b"\r\nServer: kvevents\r\n",
                         b"Connection: close\r\n\r\n" if self.close else b"\r\n"))

    def whole(self, status: int, headers: list, body: bytes) -> None:
        t = self.conn.transport
        if t is not None:
            t.write(self._head(status, headers, b"Content-Length: %d\r\n" % len(body)) + body)

    async def start(self, status: int, headers: list, length: int | None) -> None:
        self.chunked = length is None
        framing = b"Transfer-Encoding: chunked\r\n" if self.chunked else b"Content-Length: %d\r\n" % length
        await self._send(self._head(status, headers, framing))

    async def write(self, chunk: bytes) -> None:
        if chunk:
            await self._send(b"%x\r\n%b\r\n" % (len(chunk), chunk) if self.chunked else chunk)

    async def end(self) -> None:
        if self.chunked:
            await self._send(b"0\r\n\r\n")

    async def _send(self, data: bytes) -> None:
        conn = self.conn
        t = conn.transport
        if t is None or t.is_closing():
            raise ConnectionResetError("the client closed the connection")
        t.write(data)
        await conn.drain()

    def abort(self) -> None:
        t = self.conn.transport
        if t is not None:
            t.abort()

