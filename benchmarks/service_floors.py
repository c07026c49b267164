"""The floors of ``benchmarks/service.py``'s score table: servers that answer every ``POST`` with a
fixed 13-byte JSON, each run as a process of its own (``service.py --floor-server`` /
``--raw-floor-server``) and driven by the same ``wrk`` right after the service.

* :func:`aiohttp_empty`: an empty aiohttp handler (reads the body): what a request costs aiohttp.
* :func:`raw_empty`: a bare ``asyncio.Protocol`` on uvloop (the service's loop): what a request
  costs the event loop and the sockets alone -- the floor of the service's fast path, which
  bypasses aiohttp.
"""

from __future__ import annotations


def aiohttp_empty() -> None:
    """aiohttp with one route that reads the body and answers a fixed JSON: no routing logic,
    no middleware, no metrics. What a request costs this HTTP stack on this machine."""
    import socket

    from aiohttp import web

    async def handler(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=b'{"pick":null}', content_type="application/json")

    app = web.Application(client_max_size=1 << 20)
    app.router.add_post("/v1/score", handler)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    print(f"http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    web.run_app(app, sock=sock, print=None, access_log=None, handle_signals=True)


def raw_empty() -> None:
    """The stack's own floor: a bare ``asyncio.Protocol`` on uvloop (the service's loop) that reads
    each request's head and ``Content-Length`` body and answers a fixed 13-byte JSON, in one
    ``transport.write``: no parsing beyond that, no routing, no metrics -- what any server on
    this loop pays per request (the fast path's floor, where the aiohttp handler is aiohttp's)."""
    import asyncio
    import socket

    try:
        import uvloop
        loop = uvloop.new_event_loop()
    except ImportError:  # the service falls back to asyncio's loop as well
        loop = asyncio.new_event_loop()
    body = b'{"pick":null}'
    answer = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)) + body

    class Empty(asyncio.Protocol):
        def connection_made(self, transport) -> None:
            self.t = transport
            self.buf = b""

        def data_received(self, data: bytes) -> None:
            buf = self.buf + data if self.buf else data
            pos, n, out = 0, len(buf), 0
            while True:
                he = buf.find(b"\r\n\r\n", pos)
                if he < 0:
                    break
                cl = buf.find(b"Content-Length:", pos, he)
                end = he + 4 + (int(buf[cl + 15:buf.find(b"\r\n", cl)]) if cl >= 0 else 0)
                if end > n:
                    break
                out += 1
                pos = end
            if out:
                self.t.write(answer * out)
            self.buf = buf[pos:]

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    print(f"http://127.0.0.1:{sock.getsockname()[1]}", flush=True)
    srv = loop.run_until_complete(loop.create_server(Empty, sock=sock))
    try:
        loop.run_forever()
    finally:
        srv.close()
