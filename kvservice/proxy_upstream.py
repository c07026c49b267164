"""The proxy's HTTP/1.1 client to the pods: warm keep-alive connections, the request written as
one head plus the client's body bytes (no copy, no re-encoding), and the answer read in bounded
pieces. Measured on this machine, a 28 KB POST costs ~10 us of CPU here against ~55 us through
aiohttp's client (``benchmarks/proxy.py``, docs/proxy.md).

Every failure is an :class:`UpstreamError` whose ``kind`` says where it happened — and so whether
the pod can have started the request: ``refused`` and ``connect_timeout`` happen before a byte of
it was written (``safe``); ``first_byte_timeout``, ``total_timeout``, ``failed`` (the connection
closed, or an answer that is not HTTP) after. ``cut``: the answer's body ended early.

Bounds: an answer's head is at most ``MAX_HEAD`` bytes; a connection stops reading from its pod
while more than ``HIGH`` bytes wait to be passed on, so a slow client never makes the proxy
hold a large answer. Runs on the event-loop thread only.
"""

from __future__ import annotations

import asyncio

__all__ = ["Answer", "Pool", "UpstreamError", "MAX_HEAD"]

MAX_HEAD = 64 << 10
HIGH = 1 << 20  #: buffered answer bytes above which a connection stops reading
LOW = 256 << 10  #: ... and below which it reads again
_SIZE, _DATA, _CRLF, _TRAILER = range(4)  #: the chunked decoder's states


class UpstreamError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.safe = kind in ("refused", "connect_timeout")


class _Conn(asyncio.Protocol):
    __slots__ = ("t", "buf", "waiter", "eof", "paused", "idle_since")

    def __init__(self) -> None:
        self.t: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future | None = None
        self.eof = False
        self.paused = False
        self.idle_since = 0.0

    def connection_made(self, transport) -> None:
        self.t = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if len(self.buf) > HIGH and not self.paused:
            self.paused = True
            self.t.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False

    def connection_lost(self, exc) -> None:
        self.eof = True
        self._wake()

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def drained(self) -> None:
        if self.paused and len(self.buf) < LOW and self.t is not None:
            self.paused = False
            self.t.resume_reading()

    async def wait(self, idle: float, deadline: float | None, loop, before_head: bool) -> None:
        """Until more bytes (or the end) arrive; UpstreamError on a timeout."""
        t = idle
        if deadline is not None:
            t = min(t, deadline - loop.time())
        self.waiter = fut = loop.create_future()
        try:
            if t <= 0:
                raise TimeoutError
            async with asyncio.timeout(t):
                await fut
        except TimeoutError:
            if deadline is not None and loop.time() >= deadline - 1e-3:
                raise UpstreamError("total_timeout", "no whole answer within proxy.total_timeout") from None
            raise UpstreamError("first_byte_timeout" if before_head else "cut",
                                f"nothing from the pod for {idle:g} s (api.upstream_timeout)") from None
        finally:
            self.waiter = None

    def close(self) -> None:
        self.eof = True
        if self.t is not None:
            self.t.abort()  # the pod sees the connection go: it stops the request


class Answer:
    """An answer's status and head, and its body read piece by piece (:meth:`chunk`)."""

    __slots__ = ("conn", "pool", "status", "headers", "length", "left", "chunked", "until_eof", "keep", "done",
                 "_cstate", "_cleft", "idle", "deadline", "loop")

    def __init__(self, conn: _Conn, pool: "Pool", status: int, headers: list, length: int | None,
                 chunked: bool, keep: bool, idle: float, deadline: float | None, loop) -> None:
        self.conn = conn
        self.pool = pool
        self.status = status
        self.headers = headers  #: [(name, value)] as sent (str)
        self.length = length
        self.left = length if length is not None else 0
        self.chunked = chunked
        self.until_eof = length is None and not chunked
        self.keep = keep and not self.until_eof
        self.done = length == 0
        self._cstate = _SIZE  #: chunked: what the parser expects next
        self._cleft = 0  #: chunked: bytes left in the current chunk
        self.idle = idle
        self.deadline = deadline
        self.loop = loop

    def header(self, name: str) -> str:
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return ""

    async def chunk(self) -> bytes:
        """The next piece of the body (at most what is buffered); b"" at its end."""
        conn = self.conn
        while not self.done:
            data = self._take()
            if data:
                return data
            if self.done:
                break
            if conn.eof:
                if self.until_eof:
                    self.done = True
                    break
                raise UpstreamError("cut", "the pod closed the connection before the end of its answer")
            await conn.wait(self.idle, self.deadline, self.loop, False)
        return b""

    async def read(self, cap: int) -> bytes:
        parts = []
        n = 0
        while piece := await self.chunk():
            n += len(piece)
            if n > cap:
                raise UpstreamError("too_large", f"the answer is over {cap} bytes")
            parts.append(piece)
        return b"".join(parts)

    def _take(self) -> bytes:
        buf = self.conn.buf
        if not buf:
            return b""
        if not self.chunked:
            if self.until_eof:
                data = bytes(buf)
                buf.clear()
            else:
                n = min(self.left, len(buf))
                data = bytes(buf[:n])
                del buf[:n]
                self.left -= n
                self.done = self.left == 0
            self.conn.drained()
            return data
        return self._take_chunked(buf)

    def _take_chunked(self, buf: bytearray) -> bytes:
        out = []
        pos = 0
        end = len(buf)
        while not self.done:
            st = self._cstate
            if st == _SIZE:
                le = buf.find(b"\r\n", pos)
                if le < 0:
                    if end - pos > 1024:
                        raise UpstreamError("failed", "the pod's chunked answer has a malformed chunk size")
                    break
                size = bytes(buf[pos:le]).split(b";", 1)[0].strip()
                if not size or len(size) > 15 or size.strip(b"0123456789abcdefABCDEF"):
                    raise UpstreamError("failed", "the pod's chunked answer has a malformed chunk size")
                pos = le + 2
                self._cleft = int(size, 16)
                self._cstate = _DATA if self._cleft else _TRAILER
            elif st == _DATA:
                n = min(self._cleft, end - pos)
                if not n:
                    break
                out.append(bytes(buf[pos:pos + n]))
                pos += n
                self._cleft -= n
                if not self._cleft:
                    self._cstate = _CRLF
            elif st == _CRLF:
                if end - pos < 2:
                    break
                if buf[pos:pos + 2] != b"\r\n":
                    raise UpstreamError("failed", "the pod's chunked answer has a malformed chunk end")
                pos += 2
                self._cstate = _SIZE
            else:  # trailer lines, up to an empty one
                le = buf.find(b"\r\n", pos)
                if le < 0:
                    if end - pos > MAX_HEAD:
                        raise UpstreamError("failed", "the pod's chunked answer has over-long trailers")
                    break
                self.done = le == pos
                pos = le + 2
        del buf[:pos]
        self.conn.drained()
        return b"".join(out)

    def finish(self) -> None:
        """Back to the pool when read to its end on a reusable connection, else closed."""
        conn = self.conn
        if self.done and self.keep and not conn.eof and not conn.buf:
            self.pool.put(conn)
        else:
            conn.close()


class Pool:
    """One pod's connections: idle ones kept for ``keepalive`` s, most recently used first."""

    def __init__(self, host: str, port: int, keepalive: float, tls=None) -> None:
        self.tls = tls  #: an ssl.SSLContext for an https:// pod
        self.host = host
        self.port = port
        self.hostport = f"{host}:{port}".encode()
        self.keepalive = keepalive
        self.idle: list[_Conn] = []
        self.opened = 0  #: connections opened (for the metrics: a warm pool opens few)

    def put(self, conn: _Conn) -> None:
        now = conn.idle_since = asyncio.get_running_loop().time()
        idle = self.idle
        while idle and (idle[0].eof or now - idle[0].idle_since >= self.keepalive):
            idle.pop(0).close()  # the least recently used first: closed once expired or dead
        idle.append(conn)

    async def _get(self, connect_timeout: float, loop) -> _Conn:
        now = loop.time()
        while self.idle:
            conn = self.idle.pop()
            if not conn.eof and not conn.buf and now - conn.idle_since < self.keepalive:
                return conn
            conn.close()
        try:
            async with asyncio.timeout(connect_timeout):
                _t, conn = await loop.create_connection(_Conn, self.host, self.port, ssl=self.tls)
        except TimeoutError:
            raise UpstreamError("connect_timeout",
                                f"no connection within proxy.connect_timeout ({connect_timeout:g} s)") from None
        except OSError as exc:
            raise UpstreamError("refused", f"cannot connect: {exc.strerror or exc}") from None
        self.opened += 1
        return conn

    async def request(self, head: bytes, body: bytes, *, connect_timeout: float, idle: float,
                      total: float) -> Answer:
        """Send ``head`` (request line and headers, without Host and Content-Length) and ``body``;
        the answer once its head is in."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + total if total else None
        conn = await self._get(connect_timeout, loop)
        conn.t.writelines((head, b"Host: ", self.hostport, b"\r\nContent-Length: ", str(len(body)).encode(),
                           b"\r\n\r\n", body))
        try:
            while True:
                buf = conn.buf
                he = buf.find(b"\r\n\r\n")
                if he < 0:
                    if len(buf) > MAX_HEAD:
                        raise UpstreamError("failed", f"the pod's answer head is over {MAX_HEAD} bytes")
                    if conn.eof:
                        raise UpstreamError("failed", "the pod closed the connection without an answer")
                    await conn.wait(idle, deadline, loop, True)
                    continue
                head_bytes = bytes(buf[:he])
                del buf[:he + 4]
                answer = self._parse(conn, head_bytes, idle, deadline, loop)
                if answer is not None:
                    return answer  # else a 1xx interim answer: the real one follows
        except BaseException:
            conn.close()
            raise

    def _parse(self, conn: _Conn, head: bytes, idle: float, deadline: float | None, loop) -> Answer | None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or len(parts[1]) != 3 or not parts[1].isdigit():
            raise UpstreamError("failed", f"the pod's answer is not HTTP/1.x: {lines[0][:80]!r}")
        status = int(parts[1])
        if 100 <= status < 200 and status != 101:
            return None
        headers = []
        length = None
        chunked = False
        keep = parts[0] == b"HTTP/1.1"
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name != name.strip():
                raise UpstreamError("failed", "the pod's answer has a malformed header line")
            k = name.decode("latin-1")
            v = value.strip().decode("latin-1")
            lk = k.lower()
            if lk == "content-length":
                if not v.isdigit() or len(v) > 18 or (length is not None and length != int(v)):
                    raise UpstreamError("failed", f"the pod's answer has a bad Content-Length: {v[:40]!r}")
                length = int(v)
            elif lk == "transfer-encoding":
                chunked = v.lower().rsplit(",", 1)[-1].strip() == "chunked"
                if not chunked:
                    raise UpstreamError("failed", f"the pod's answer has an unsupported Transfer-Encoding: {v[:40]!r}")
            elif lk == "connection":
                tokens = {t.strip() for t in v.lower().split(",")}
                keep = "close" not in tokens and (keep or "keep-alive" in tokens)
            headers.append((k, v))
        if chunked:
            length = None
        if status in (204, 304):
            length, chunked = 0, False
        return Answer(conn, self, status, headers, length, chunked, keep, idle, deadline, loop)

    def close(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle.clear()
