"""Hostile HTTP clients against the router service (issue 24), over real sockets on loopback:
slow bodies bounded by ``http.max_buffered_bytes``, heads and bodies cut short answered 408 at
``http.header_timeout`` / ``http.body_timeout``, idle keep-alive connections closed at
``http.idle_timeout`` (fast path and aiohttp's side), the connection cap with its reserve for
health probes, and bodies that break the JSON or the UTF-8 decoder answered 400 naming the
problem on every route (the proxy's included). Timeouts are configured sub-second; the tests
poll for the outcome (the deadlines only bound a failure)."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time

import pytest

from kvservice.config import from_dict

from .service_helpers import MODEL, InProcessService, wait_for
from .test_service_http_grammar import exchange

BODY = json.dumps({"model": MODEL, "token_ids": list(range(1, 40))}).encode()


def _cfg(tmp_path, http: dict, **api) -> object:
    return from_dict({"router": {"model": MODEL}, "api": {"port": 0, **api}, "http": http,
                      "subscriber": {"replay_timeout": 0.2},
                      "pods": [{"name": "a", "endpoint": f"ipc://{tmp_path}/a.pub", "http": "http://127.0.0.1:9"}]
                      }).validate()


@pytest.fixture(params=["asyncio", "uvloop"])  # uvloop: the service's default loop where installed
def start(request, tmp_path):
    started = []
    factory = pytest.importorskip("uvloop").new_event_loop if request.param == "uvloop" else asyncio.new_event_loop

    def _start(http: dict, **api) -> InProcessService:
        s = InProcessService(_cfg(tmp_path, http, **api), loop_factory=factory)
        started.append(s)
        return s

    yield _start
    for s in started:
        s.close()


def _connect(url: str) -> socket.socket:
    host, port = re.match(r"http://([^:]+):(\d+)", url).groups()
    return socket.create_connection((host, int(port)), timeout=10)


def _post(path: str, body: bytes, *, length: int | None = None) -> bytes:
    n = len(body) if length is None else length
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {n}\r\n\r\n"
            .encode() + body)


def _read_all(s: socket.socket, timeout: float = 10.0) -> bytes:
    """What the server sends until it closes the connection (the deadline bounds a failure)."""
    s.settimeout(timeout)
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def _metrics(svc) -> str:
    return svc.http.call("GET", "/metrics")[2].decode()


def _metric(svc, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", _metrics(svc), re.M)
    return float(m.group(1)) if m else 0.0


def _score_ok(svc) -> bool:
    status, _body = exchange(svc.url, _post("/v1/score", BODY))
    return status == 200


def test_slow_bodies_are_bounded_by_the_buffered_bytes_cap(start):
    cap = 256 << 10
    svc = start({"max_buffered_bytes": cap, "body_timeout": 60.0}, max_body_bytes=64 << 10)
    socks = []
    try:
        for _ in range(10):  # each declares 64 KiB and sends all but 16 bytes: 10 x 64 KiB > the cap
            s = _connect(svc.url)
            s.sendall(_post("/v1/score", b"[" * ((64 << 10) - 16), length=64 << 10))
            socks.append(s)
            wait_for(lambda: _metric(svc, "kvservice_http_buffered_bytes") > 0 or
                     _metric(svc, 'kvservice_http_limit_hits_total{limit="buffered_bytes"}') > 0, what="held")
            assert _metric(svc, "kvservice_http_buffered_bytes") <= cap
        assert _score_ok(svc)  # a well-behaved client is served meanwhile
        refused = wait_for(lambda: _metric(svc, 'kvservice_http_limit_hits_total{limit="buffered_bytes"}') >= 7,
                           what="refusals")
        assert refused
        answers = [_read_all(s, 0.5) if i >= 4 else b"" for i, s in enumerate(socks)]
        assert sum(a.startswith(b"HTTP/1.1 503 ") for a in answers) >= 6, answers
        assert any(b"max_buffered_bytes" in a for a in answers)
    finally:
        for s in socks:
            s.close()
    wait_for(lambda: _metric(svc, "kvservice_http_buffered_bytes") == 0, what="released")


def test_a_body_cut_short_is_answered_408_at_the_body_timeout(start):
    svc = start({"body_timeout": 0.3})
    for path in ("/v1/score", "/v1/explain"):
        with _connect(svc.url) as s:
            t0 = time.monotonic()
            s.sendall(_post(path, BODY[:-5], length=len(BODY)))
            got = _read_all(s)
            assert got.startswith(b"HTTP/1.1 408 "), got
            assert b"body_timeout" in got
            assert time.monotonic() - t0 >= 0.3
    assert _metric(svc, 'kvservice_http_limit_hits_total{limit="body_timeout"}') == 2
    assert _score_ok(svc)


def test_a_head_cut_short_or_never_sent_is_answered_408_at_the_header_timeout(start):
    svc = start({"header_timeout": 0.3})
    with _connect(svc.url) as a, _connect(svc.url) as b:
        a.sendall(b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Le")  # and then nothing
        for s in (a, b):  # b sends nothing at all
            got = _read_all(s)
            assert got.startswith(b"HTTP/1.1 408 ") and b"header_timeout" in got, got
    assert _metric(svc, 'kvservice_http_limit_hits_total{limit="header_timeout"}') == 2


@pytest.mark.parametrize("path", ["/v1/score", "/healthz"])  # the fast path's own / aiohttp's keep-alive
def test_an_idle_keep_alive_connection_is_closed_at_the_idle_timeout(start, path):
    svc = start({"idle_timeout": 0.3})
    with _connect(svc.url) as s:
        s.sendall(_post(path, BODY) if path != "/healthz" else b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        got = _read_all(s)  # the answer, then the close
        assert got.startswith(b"HTTP/1.1 200 ") and got.count(b"HTTP/1.1 ") == 1, got
    if path == "/v1/score":
        assert _metric(svc, 'kvservice_http_limit_hits_total{limit="idle_timeout"}') == 1


def test_the_connection_cap_keeps_a_reserve_for_health_probes(start):
    svc = start({"max_connections": 4, "reserved_connections": 2, "header_timeout": 30.0})
    hold = [_connect(svc.url) for _ in range(4)]  # the cap, held by clients that send nothing
    try:
        hold[0].sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")  # accepted in order: all four are in
        hold[0].recv(65536)
        status, body = exchange(svc.url, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == 200, body
        status, body = exchange(svc.url, b"GET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status in (200, 503) and b"ready" in body
        status, body = exchange(svc.url, _post("/v1/score", BODY))
        assert status == 503 and b"max_connections" in body, body
        extra = [_connect(svc.url) for _ in range(3)]  # past the reserve: the oldest reserved one goes
        try:
            assert _read_all(extra[0]) == b""
            status, _ = exchange(svc.url, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
            assert status == 200  # a fresh probe still gets in
        finally:
            for s in extra:
                s.close()
    finally:
        for s in hold:
            s.close()
    wait_for(lambda: _metric(svc, 'kvservice_http_limit_hits_total{limit="connections"}') >= 2, what="counted")
    assert _score_ok(svc)


DEEP = b'{"model": "m", "token_ids": ' + b"[" * 500_000 + b"]" * 500_000 + b"}"
BAD_UTF8 = b'{"model": "m\xff\xfe", "token_ids": [1, 2, 3]}'


@pytest.mark.parametrize("fast", [True, False])
def test_undecodable_bodies_are_400_naming_the_problem_on_every_route(start, fast):
    svc = start({}, max_body_bytes=2 << 20, proxy=True, fast_path=fast)
    for path in ("/v1/score", "/v1/pick", "/v1/explain", "/v1/completions", "/v1/chat/completions"):
        for body, word in ((DEEP, "deep"), (BAD_UTF8, "UTF-8"), (b'{"model": "m", "prompt": "\xc3"}', "UTF-8")):
            status, answer = exchange(svc.url, _post(path, body))
            assert status == 400, (path, word, status, answer[:300])
            assert word in json.loads(answer)["error"]["message"], (path, answer[:300])
    assert _metric(svc, "kvservice_internal_errors_total") == 0


def test_http_settings_are_validated_with_one_line_naming_the_key(tmp_path):
    from kvevents.errors import ConfigError

    for http, key in (({"header_timeout": -1}, "http.header_timeout"), ({"max_connections": "many"}, "http.max_connections"),
                      ({"max_buffered_bytes": 10}, "http.max_buffered_bytes"), ({"bogus": 1}, "http.bogus")):
        with pytest.raises(ConfigError, match=re.escape(key)) as exc:
            _cfg(tmp_path, http)
        assert "\n" not in str(exc.value)


def test_expect_100_continue_gets_its_interim_answer_then_the_route_s(start):
    """A client that waits for ``100 Continue`` before sending its body (curl's large uploads) is
    not left waiting while the front holds the request."""
    svc = start({})
    for path in ("/v1/score", "/v1/explain"):
        with _connect(svc.url) as s:
            s.sendall(_post(path, b"").replace(b"Content-Length: 0", b"Content-Length: %d\r\nExpect: 100-continue"
                                               % len(BODY)))
            s.settimeout(10)
            got = s.recv(65536)
            assert got.startswith(b"HTTP/1.1 100 Continue\r\n\r\n"), got
            s.sendall(BODY)
            status, _body = _answer_after_interim(s, got[len(b"HTTP/1.1 100 Continue\r\n\r\n"):])
            assert status == 200


def _answer_after_interim(s: socket.socket, buf: bytes) -> tuple[int, bytes]:
    """The final answer, past any further ``100 Continue`` (aiohttp may send its own)."""
    while True:
        while buf.startswith(b"HTTP/1.1 100 "):
            if b"\r\n\r\n" not in buf:
                break
            buf = buf.split(b"\r\n\r\n", 1)[1]
        if b"\r\n\r\n" in buf and not buf.startswith(b"HTTP/1.1 100 "):
            head, rest = buf.split(b"\r\n\r\n", 1)
            n = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))
            if len(rest) >= n:
                return int(head.split(b" ", 2)[1]), rest[:n]
        chunk = s.recv(65536)
        assert chunk, buf
        buf += chunk


def test_the_default_connection_cap_leaves_descriptors_for_the_process_and_the_probes(monkeypatch):
    import resource

    from kvservice import http_limits

    for soft, cap in ((1024, 1024 - 128 - 8), (20000, 20000 - 2500 - 8), (100, 16)):
        monkeypatch.setattr(http_limits.resource, "getrlimit", lambda _which, s=soft: (s, resource.RLIM_INFINITY))
        assert http_limits.HttpConfig().connection_cap() == cap
    assert http_limits.HttpConfig(max_connections=50).connection_cap() == 50
