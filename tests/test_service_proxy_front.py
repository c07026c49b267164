"""The proxy on the service's client fronts (kvservice.fasthttp answers the common proxied request
on its own transport; aiohttp the rest): answers in request order behind a proxied request, a
proxied request is never cut by the front's idle sweep, and both fronts give a client the same
answer (real HTTP over loopback, a fake engine)."""

from __future__ import annotations

import json
import socket

import pytest

from kvservice.config import from_dict

from .service_helpers import InProcessService, wait_for
from .test_service_proxy_faults import MODEL, FakeEngine

BODY = json.dumps({"model": MODEL, "prompt": [1, 2, 3]}).encode()


def _service(url: str, fast: bool, tmp_path, http: dict | None = None) -> InProcessService:
    cfg = {"router": {"model": MODEL}, "api": {"port": 0, "proxy": True, "upstream_timeout": 30.0, "fast_path": fast},
           **({"http": http} if http else {}),
           "pods": [{"name": "p0", "endpoint": f"ipc://{tmp_path}/p0.pub", "http": url}]}
    return InProcessService(from_dict(cfg).validate())


def _connect(svc) -> socket.socket:
    host, port = svc.url.split("//")[1].rstrip("/").split(":")
    s = socket.create_connection((host, int(port)), timeout=20)
    return s


def _post(path: bytes = b"/v1/completions", body: bytes = BODY) -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (path, len(body), body))


class Reader:
    """HTTP/1.1 answers read one by one off a socket (Content-Length or chunked bodies)."""

    def __init__(self, s: socket.socket) -> None:
        self.s = s
        self.buf = b""

    def _fill(self) -> None:
        data = self.s.recv(65536)
        if not data:
            raise EOFError("the server closed the connection")
        self.buf += data

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self._fill()
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _take(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def answer(self) -> tuple[int, dict, bytes]:
        status = int(self._line().split()[1])
        headers = {}
        while line := self._line():
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        if headers.get("transfer-encoding") == "chunked":
            body = b""
            while size := int(self._line().split(b";")[0], 16):
                body += self._take(size)
                self._take(2)
            self._line()
        else:
            body = self._take(int(headers.get("content-length", "0")))
        return status, headers, body


@pytest.mark.parametrize("fast", [True, False], ids=["lean-front", "aiohttp-front"])
def test_requests_behind_a_proxied_one_are_answered_in_order(fast, tmp_path) -> None:
    eng = FakeEngine("hang")
    svc = _service(eng.url, fast, tmp_path)
    try:
        s = _connect(svc)
        health = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
        # the first request waits at the pod; one more came in the same write, two after it
        s.sendall(_post() + health)
        assert eng.entered.wait(10)
        s.sendall(_post() + health)
        if fast:  # the lean front holds what came behind the proxied request, unread, until it is answered
            held = f"kvservice_http_buffered_bytes {2 * len(health) + len(_post())}\n"
            wait_for(lambda: held in svc.http.call("GET", "/metrics")[2].decode(), what="the later requests held")
        eng.loop.call_soon_threadsafe(eng.release.set)
        r = Reader(s)
        answers = [r.answer() for _ in range(4)]
        assert [a[0] for a in answers] == [200] * 4
        assert [a[1].get("x-kvevents-pod") for a in answers] == ["p0", None, "p0", None]
        assert json.loads(answers[0][2])["choices"] and json.loads(answers[1][2]) == json.loads(answers[3][2])
        assert eng.posts == 2
        s.close()
    finally:
        svc.close()
        eng.close()


def test_a_proxied_request_outlives_the_fronts_idle_timeouts(tmp_path) -> None:
    """The front's sweep closes connections idle past ``http.idle_timeout`` / ``header_timeout``;
    a connection waiting for its proxied answer is not idle (the proxy's own timeouts bound it)."""
    eng = FakeEngine("hang")
    svc = _service(eng.url, True, tmp_path, {"idle_timeout": 0.2, "header_timeout": 0.2})
    try:
        s = _connect(svc)
        s.sendall(_post())
        assert eng.entered.wait(10)
        idle = _connect(svc)  # sends nothing: the sweep closes it after header_timeout
        assert idle.recv(65536).startswith(b"HTTP/1.1 408")
        # the sweep has run past both timeouts since the proxied request began: still open
        eng.loop.call_soon_threadsafe(eng.release.set)
        status, headers, _body = Reader(s).answer()
        assert status == 200 and headers["x-kvevents-pod"] == "p0"
        idle.close()
        s.close()
    finally:
        svc.close()
        eng.close()


@pytest.mark.parametrize("stream", [False, True])
def test_both_fronts_give_the_same_answer(stream, tmp_path) -> None:
    eng = FakeEngine("ok")
    answers = []
    try:
        for fast in (True, False):
            svc = _service(eng.url, fast, tmp_path)
            try:
                s = _connect(svc)
                body = json.dumps({"model": MODEL, "prompt": [1, 2, 3], "stream": stream}).encode()
                s.sendall(_post(body=body))
                status, headers, data = Reader(s).answer()
                s.close()
                answers.append((status, headers.get("content-type"), headers.get("x-kvevents-pod"),
                                headers.get("x-kvevents-attempts"), data))
                wait_for(lambda: 'route="/v1/completions"' in svc.http.call("GET", "/metrics")[2].decode(),
                         what="the proxied request counted under its route")
            finally:
                svc.close()
        assert answers[0] == answers[1]
        assert answers[0][0] == 200 and (b"data: [DONE]" in answers[0][4]) == stream
    finally:
        eng.close()
