"""One HTTP grammar (issue 24): the lean front (kvservice.fasthttp) accepts exactly the request
heads aiohttp's own parser accepts. A differential test feeds the same corpus of heads — well
formed, malformed by hand, and mutated at random — to aiohttp's HttpRequestParser (what the
service's aiohttp side parses with) and, over real HTTP on loopback, to the service on the
fast-path route ``/v1/score`` and on an aiohttp route (``/v1/explain``): a head aiohttp refuses
is answered 400 on both routes, one it accepts is answered as aiohttp would (200 here) on both.
Malformed requests are counted by status (route ``malformed``) and logged without a traceback."""

from __future__ import annotations

import asyncio
import logging
import random
import re
import socket
from unittest import mock

import pytest
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.http_parser import HttpRequestParser

from kvservice.config import from_dict

from .service_helpers import MODEL, InProcessService

BODY = b'{"model": "m", "token_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]}'


def head(path: str = "/v1/score", *, line: bytes | None = None, headers: list[bytes] | None = None) -> bytes:
    """A request head (with its blank line) for BODY."""
    first = line if line is not None else b"POST " + path.encode() + b" HTTP/1.1"
    hs = headers if headers is not None else [b"Host: x", b"Content-Type: application/json",
                                             b"Content-Length: %d" % len(BODY), b"X-Pad: abc"]
    return first + b"\r\n" + b"\r\n".join(hs) + b"\r\n\r\n"


def _hand_corpus() -> list[bytes]:
    cl = b"Content-Length: %d" % len(BODY)
    base = [b"Host: x", b"Content-Type: application/json", cl]
    out = [head()]
    for extra in (b"X-Pad: a\x00b", b"X-Pad: a\rb", b"X-Pad: a\x01b", b"X-Pad: a\x7fb", b"X-Pad: a\x1bb",
                  b"X-Pad: a\xffb", b"X-Pad: a\tb", b"X-Pad:", b"X Pad: a", b"X-Pad : a", b" X-Pad: a", b"\tX-Pad: a",
                  b"X-Pad a", b":a", b"X(Pad): a", b"X-Pad: a\x0bb", b"X\x00Pad: a", b"X-P\xe9d: a", b"Host: y",
                  cl, b"Content-Length: +5", b"Transfer-Encoding: chunked", b"Transfer-Encoding: identity"):
        out.append(head(headers=base + [extra]))
    out.append(head(headers=[b"Content-Type: application/json", cl]))  # no Host
    out.append(head(headers=[b"Host:", b"Content-Type: application/json", cl]))  # an empty Host is allowed
    out.append(head(headers=[b"Host: x", b"Content-Length: 0%d" % len(BODY)]))  # a leading 0
    out.append(head(headers=[b"Host: x", b"Content-Length: %d " % len(BODY)]))  # trailing space
    out.append(head(headers=[b"Host: x", b"Content-Length: 9 9"]))
    out.append(head(headers=[b"Host: x", b"Content-Length:"]))
    out.append(head(headers=[b"Host: x", b"Content-Length: -1"]))
    out.append(head(headers=[b"Host: x", b"Content-Length: 0x10"]))
    bare = head().replace(b"\r\n", b"\n")
    out.append(bare)
    h = head()
    for i in range(h.count(b"\r\n")):  # a bare LF / a bare CR at each line end in turn
        at = [m.start() for m in re.finditer(b"\r\n", h)][i]
        out.append(h[:at] + b"\n" + h[at + 2:])
        out.append(h[:at] + b"\r" + h[at + 2:])
    for line in (b"POST  /v1/score HTTP/1.1", b"POST /v1/score  HTTP/1.1", b"POST /v1/score HTTP/1.1 ",
                 b"post /v1/score HTTP/1.1", b"POST /v1/score HTTP/1.0", b"POST /v1/score HTTP/2.0",
                 b"POST /v1/score http/1.1", b"POST /v1/sc\x00ore HTTP/1.1", b"POST /v1/sc ore HTTP/1.1",
                 b"PO\x01ST /v1/score HTTP/1.1", b"POST\t/v1/score HTTP/1.1", b"POST /v1/score?x=1 HTTP/1.1"):
        out.append(head(line=line))
    return out


def _mutated(n: int, seed: int) -> list[bytes]:
    """Random damage to the head: a byte from a hostile set inserted, replaced or deleted."""
    rnd = random.Random(seed)
    good = head()
    cut = good.index(b"Content-Length")  # keep the path and the length intact: the damage is elsewhere
    bytes_ = [0, 1, 9, 10, 13, 32, 58, 127, 128, 255, 0x22, 0x28, 0x2C, 0x3B, 0x40, 0x7B]
    out = []
    for _ in range(n):
        h = bytearray(good)
        at = rnd.randrange(len(b"POST /v1/score HTTP/1.1\r\n"), cut)
        op = rnd.randrange(3)
        if op == 0:
            h.insert(at, rnd.choice(bytes_))
        elif op == 1:
            h[at] = rnd.choice(bytes_)
        else:
            del h[at]
        out.append(bytes(h))
    return out


CORPUS = _hand_corpus() + _mutated(120, 20261127)


def aiohttp_verdict(raw: bytes) -> bool | None:
    """True: aiohttp's parser accepts the head (POST, Content-Length as sent); False: it refuses
    it (400); None: something else (not a message yet...)."""
    loop = asyncio.new_event_loop()
    try:
        p = HttpRequestParser(mock.Mock(), loop, 2**16, max_line_size=8190, max_field_size=8190)
        try:
            msgs, _up, _tail = p.feed_data(raw + BODY)
        except HttpProcessingError:
            return False
        return True if msgs else None
    finally:
        loop.close()


def exchange(url: str, raw: bytes, timeout: float = 10.0) -> tuple[int | None, bytes]:
    """Send ``raw`` on a new connection; the answer's status and body (None: closed, no answer)."""
    host, port = re.match(r"http://([^:]+):(\d+)", url).groups()
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(raw)
        buf = b""
        while True:
            if b"\r\n\r\n" in buf:
                h, rest = buf.split(b"\r\n\r\n", 1)
                m = re.search(rb"(?i)content-length: *(\d+)", h)
                if m and len(rest) >= int(m.group(1)):
                    return int(h.split(b" ", 2)[1]), rest[:int(m.group(1))]
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                return (int(buf.split(b" ", 2)[1]) if buf.startswith(b"HTTP/1.") else None), buf
            buf += chunk


@pytest.fixture(scope="module", params=["asyncio", "uvloop"])
def svc(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("grammar")
    cfg = from_dict({"router": {"model": MODEL}, "api": {"port": 0},
                     "subscriber": {"replay_timeout": 0.2},
                     "pods": [{"name": "a", "endpoint": f"ipc://{d}/a.pub"}]}).validate()
    factory = pytest.importorskip("uvloop").new_event_loop if request.param == "uvloop" else asyncio.new_event_loop
    s = InProcessService(cfg, loop_factory=factory)
    try:
        yield s
    finally:
        s.close()


def _metric(svc, route: str, status: int) -> int:
    _s, _h, text = svc.http.call("GET", "/metrics")
    m = re.search(rf'kvservice_http_requests_total{{route="{route}",method="[^"]*",status="{status}"}} (\d+)',
                  text.decode())
    return int(m.group(1)) if m else 0


def test_the_corpus_holds_both_verdicts():
    verdicts = [aiohttp_verdict(h) for h in CORPUS]
    assert verdicts.count(True) >= 20 and verdicts.count(False) >= 40, verdicts


@pytest.mark.parametrize("i", range(len(CORPUS)))
def test_fast_route_and_aiohttp_route_answer_a_head_as_aiohttps_parser_does(svc, i):
    raw = CORPUS[i]
    want = aiohttp_verdict(raw)
    got = {}
    for path in (b"/v1/score", b"/v1/explain"):
        status, body = exchange(svc.url, raw.replace(b"/v1/score", path, 1) + BODY)
        got[path] = status
        if want is False:
            assert status == 400, (path, raw, status, body[:200])
        elif want is True:  # answered by the route (415: a damaged Content-Type, on both)
            assert status in (200, 415), (path, raw, status, body[:200])
    assert len(set(got.values())) == 1, (raw, got)


def test_the_same_bytes_get_the_same_answer_on_both_routes(svc):
    """The issue's example: a bare LF, a NUL in a value, no Host — 200 on /v1/score and 400 on
    /v1/explain before; 400 on both now, naming what was wrong."""
    for raw in (head(headers=[b"Host: x", b"X-Pad: a\nContent-Length: %d" % len(BODY)]),
                head(headers=[b"Host: x", b"X-Pad: a\x00b", b"Content-Length: %d" % len(BODY)]),
                head(headers=[b"Content-Length: %d" % len(BODY)])):
        got = {p: exchange(svc.url, raw.replace(b"/v1/score", p, 1) + BODY)[0] for p in (b"/v1/score", b"/v1/explain")}
        assert got == {b"/v1/score": 400, b"/v1/explain": 400}, (raw, got)
    status, body = exchange(svc.url, head(headers=[b"Content-Length: %d" % len(BODY)]) + BODY)
    assert b"Host" in body


def test_malformed_requests_are_counted_by_status_without_a_traceback(svc, caplog):
    before = _metric(svc, "malformed", 400)
    caplog.set_level(logging.DEBUG)
    bad = [head(headers=[b"Host: x", b"X-Pad: a\x00b", b"Content-Length: %d" % len(BODY)]) + BODY,  # refused by the front
           b"GARBAGE\r\n\r\n",  # refused by aiohttp's parser (an unknown method line)
           b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}"]
    for raw in bad:
        status, _body = exchange(svc.url, raw)
        assert status == 400, raw
    assert _metric(svc, "malformed", 400) == before + len(bad)
    noisy = [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    assert not noisy, [r.getMessage() for r in noisy]


def test_a_head_broken_early_is_refused_before_it_ends(svc):
    """Sent in pieces and never finished, a head is refused at its first bad byte (as aiohttp's
    parser does), not held until the header timeout."""
    for raw in (b"POST /v1/score HTTP/1.1\r\nHost: x\nX-Pad: a", b"POST /v1/score HTTP/1.1\r\nHost: x\r\nX: a\x00",
                b"POST /v1/score HTTP/1.1\r\nHost: x\r\nX: a\rb"):
        host, port = re.match(r"http://([^:]+):(\d+)", svc.url).groups()
        with socket.create_connection((host, int(port)), timeout=10) as s:
            for i in range(0, len(raw), 3):
                try:
                    s.sendall(raw[i:i + 3])
                except OSError:
                    break
            got = b""
            while True:
                try:
                    chunk = s.recv(65536)
                except ConnectionResetError:
                    break
                if not chunk:
                    break
                got += chunk
        assert got.startswith(b"HTTP/1.1 400 "), (raw, got)


def test_a_malformed_request_after_a_handed_off_one_is_400_and_counted(svc):
    """On a connection already handed to aiohttp (its first request was another route), a
    malformed head is aiohttp's to answer: 400, in order after the first answer, counted."""
    before = _metric(svc, "malformed", 400)
    host, port = re.match(r"http://([^:]+):(\d+)", svc.url).groups()
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n" + head(headers=[b"Host: x", b"X: a\x00b", b"Content-Length: 2"]) + b"{}")
        got = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
    assert got.startswith(b"HTTP/1.1 200 ") and b" 400 Bad Request\r\n" in got.split(b"\r\n\r\n", 1)[1], got
    assert _metric(svc, "malformed", 400) == before + 1
