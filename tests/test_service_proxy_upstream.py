"""The proxy's HTTP/1.1 client (kvservice.proxy_upstream) against scripted servers on loopback:
body framings (length, chunked split anywhere, until close), 1xx heads, keep-alive reuse, and the
kind of each failure (which decides whether a request may go to another pod)."""

from __future__ import annotations

import asyncio

import pytest

from kvservice.proxy_upstream import Pool, UpstreamError

HEAD = b"POST /v1/completions HTTP/1.1\r\n"


async def _server(script):
    """A server whose connections run ``script(reader, writer)``; returns (server, port, seen)."""
    seen = {"conns": 0, "requests": 0}

    async def handle(reader, writer):
        seen["conns"] += 1
        try:
            await script(reader, writer, seen)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    srv = await asyncio.start_server(handle, "127.0.0.1", 0)
    return srv, srv.sockets[0].getsockname()[1], seen


async def _read_request(reader, seen) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    n = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    body = await reader.readexactly(n)
    seen["requests"] += 1
    return body


def _run(script, check):
    async def go():
        srv, port, seen = await _server(script)
        pool = Pool("127.0.0.1", port, keepalive=5.0)
        try:
            await check(pool, seen)
        finally:
            pool.close()
            srv.close()
            await srv.wait_closed()

    asyncio.run(go())


async def _call(pool, idle=5.0, total=0.0):
    return await pool.request(HEAD, b'{"x": 1}', connect_timeout=2.0, idle=idle, total=total)


async def _body(answer) -> bytes:
    parts = []
    while piece := await answer.chunk():
        parts.append(piece)
    answer.finish()
    return b"".join(parts)


def test_chunked_split_at_every_byte_with_trailers_and_reuse() -> None:
    wire = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-A: 1\r\n\r\n" \
           b"5;ext=1\r\nhello\r\n1\r\n \r\nA\r\n0123456789\r\n0\r\nTrailer: t\r\n\r\n"

    async def script(reader, writer, seen):
        while True:
            await _read_request(reader, seen)
            for i in range(len(wire)):  # one byte per write, each flushed
                writer.write(wire[i:i + 1])
                await writer.drain()
                await asyncio.sleep(0)

    async def check(pool, seen):
        for _ in range(3):
            answer = await _call(pool)
            assert answer.status == 200 and answer.header("x-a") == "1" and answer.length is None
            assert await _body(answer) == b"hello 0123456789"
        assert seen == {"conns": 1, "requests": 3} and pool.opened == 1  # one warm connection

    _run(script, check)


def test_content_length_interim_1xx_and_connection_close() -> None:
    async def script(reader, writer, seen):
        await _read_request(reader, seen)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 3\r\n"
                     b"Connection: close\r\n\r\nabc")
        await writer.drain()

    async def check(pool, seen):
        answer = await _call(pool)
        assert answer.status == 201 and await _body(answer) == b"abc"
        assert not pool.idle  # the pod said close: not kept

    _run(script, check)


def test_a_body_until_close_and_a_204() -> None:
    async def script(reader, writer, seen):
        await _read_request(reader, seen)
        if seen["conns"] == 1:
            writer.write(b"HTTP/1.0 200 OK\r\n\r\nall of it")
        else:
            writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
            await writer.drain()
            await reader.read()

    async def check(pool, seen):
        answer = await _call(pool)
        assert await _body(answer) == b"all of it"
        answer = await _call(pool)
        assert answer.status == 204 and await _body(answer) == b"" and pool.idle

    _run(script, check)


@pytest.mark.parametrize("wire,kind", [
    (b"", "failed"),  # closed without an answer
    (b"SSH-2.0\r\n\r\n", "failed"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", "cut"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n", "failed"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", "failed"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", "failed"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "failed"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcXY", "failed"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nab", "cut"),
    (b"HTTP/1.1 200 OK\r\nBad Header\r\n\r\n", "failed"),
])
def test_malformed_or_cut_answers_are_typed_and_never_safe(wire, kind) -> None:
    async def script(reader, writer, seen):
        await _read_request(reader, seen)
        writer.write(wire)
        await writer.drain()

    async def check(pool, seen):
        with pytest.raises(UpstreamError) as err:
            await _body(await _call(pool))
        assert err.value.kind == kind and not err.value.safe
        assert not pool.idle

    _run(script, check)


def test_timeouts_are_told_apart() -> None:
    async def script(reader, writer, seen):
        await _read_request(reader, seen)
        if seen["requests"] == 2:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nab")
            await writer.drain()
        await asyncio.sleep(30)

    async def check(pool, seen):
        with pytest.raises(UpstreamError) as err:
            await _call(pool, idle=0.1)
        assert err.value.kind == "first_byte_timeout" and not err.value.safe
        answer = await _call(pool, idle=0.1)
        with pytest.raises(UpstreamError) as err:
            await _body(answer)
        assert err.value.kind == "cut"
        with pytest.raises(UpstreamError) as err:
            await _call(pool, idle=5.0, total=0.1)
        assert err.value.kind == "total_timeout"

    _run(script, check)


def test_a_refused_connection_is_the_only_safe_failure() -> None:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()

    async def go():
        pool = Pool("127.0.0.1", port, keepalive=5.0)
        with pytest.raises(UpstreamError) as err:
            await _call(pool)
        assert err.value.kind == "refused" and err.value.safe

    asyncio.run(go())


def test_a_connection_the_pod_closed_while_idle_is_not_reused() -> None:
    async def script(reader, writer, seen):
        await _read_request(reader, seen)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()  # then close: the pooled connection is dead

    async def check(pool, seen):
        assert await _body(await _call(pool)) == b"ok"
        for _ in range(100):  # the pool's connection sees the close
            if pool.idle and pool.idle[0].eof:
                break
            await asyncio.sleep(0.01)
        assert await _body(await _call(pool)) == b"ok"
        assert seen["requests"] == 2 and pool.opened == 2

    _run(script, check)
