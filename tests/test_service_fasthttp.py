"""The lean HTTP/1.1 front of the hot routes (kvservice.fasthttp) over real sockets on loopback:
the same answers as aiohttp, hand-off of everything else on the same connection (in order),
errors answered by aiohttp, requests arriving in pieces, Connection: close, and an index read
between two batches while ingest writes; on asyncio's event loop and on uvloop's (the
service's default where installed)."""

from __future__ import annotations

import json
import re
import socket
import threading

import pytest

from kvevents import ZmqEventPublisher
from kvservice.config import from_dict

from .service_helpers import MODEL, InProcessService, stored, wait_for

TOKS = list(range(2000, 2064))  # 4 blocks of 16


@pytest.fixture(params=["asyncio", "uvloop"])
def svc(request, tmp_path):
    pub = ZmqEventPublisher(f"ipc://{tmp_path}/a.pub", f"ipc://{tmp_path}/a.replay", topic="")
    (tmp_path / "token").write_text("s3cret\n")
    cfg = from_dict({"router": {"model": MODEL}, "api": {"port": 0, "max_body_bytes": 8192,
                                                         "api_token_file": str(tmp_path / "token")},
                     "pods": [{"name": "a", "endpoint": f"ipc://{tmp_path}/a.pub",
                               "replay_endpoint": f"ipc://{tmp_path}/a.replay"}]}).validate()
    if request.param == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        s = InProcessService(cfg, token="s3cret", loop_factory=uvloop.new_event_loop)
    else:
        s = InProcessService(cfg, token="s3cret")
    try:
        # the late-join replay done: subscribed, so what is published from now on is received
        wait_for(lambda: s.http.get("/readyz")[0] == 200, what="ready")
        yield s, pub
    finally:
        s.close()
        pub.shutdown(timeout=0.5)


def _req(path: str, body: object = None, *, method: str = "POST", token: str | None = "s3cret",
         headers: dict | None = None, raw: bytes | None = None) -> bytes:
    data = raw if raw is not None else (b"" if body is None else json.dumps(body).encode())
    h = {"Host": "x", "Content-Type": "application/json", "Content-Length": str(len(data))}
    if token is not None:
        h["Authorization"] = f"Bearer {token}"
    h.update(headers or {})
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in h.items()) + "\r\n"
    return head.encode() + data


class Conn:
    """One keep-alive connection; reads answers one by one (Content-Length framed)."""

    def __init__(self, url: str) -> None:
        host, port = re.match(r"http://([^:]+):(\d+)", url).groups()
        self.sock = socket.create_connection((host, int(port)), timeout=10)
        self.buf = b""

    def _fill(self) -> bool:
        chunk = self.sock.recv(65536)
        self.buf += chunk
        return bool(chunk)

    def answer(self) -> tuple[int, dict, bytes]:
        while b"\r\n\r\n" not in self.buf:
            assert self._fill(), "connection closed before an answer"
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.decode().split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        n = int(headers["content-length"])
        while len(self.buf) < n:
            assert self._fill(), "connection closed inside an answer"
        body, self.buf = self.buf[:n], self.buf[n:]
        return status, headers, body

    def closed(self) -> bool:
        return not self.buf and not self._fill()

    def close(self) -> None:
        self.sock.close()


class Metrics:
    """Reads /metrics over one connection (handed off once, at its first request, then kept by
    aiohttp: reading does not move the hand-off counter afterwards)."""

    def __init__(self, url: str) -> None:
        self.conn = Conn(url)
        self.conn.sock.sendall(_req("/metrics", method="GET"))
        self.conn.answer()

    def __call__(self, name: str) -> float:
        self.conn.sock.sendall(_req("/metrics", method="GET"))
        return _sum(self.conn.answer()[2].decode(), name)


def _sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _ready(svc, pub) -> None:
    pub.publish(stored(TOKS, [1, 2, 3, 4]))
    wait_for(lambda: svc.http.get("/v1/pods")[1]["router"]["entries"] >= 4, what="indexed")


def test_hot_routes_answer_like_aiohttp_and_are_counted(svc) -> None:
    s, pub = svc
    _ready(s, pub)
    _metric = Metrics(s.url)
    handoffs = _metric("kvservice_http_handoffs_total")
    scored = _metric( 'kvservice_http_requests_total{route="/v1/score",method="POST",status="200"}')
    fast = Conn(s.url)
    fast.sock.sendall(_req("/v1/score", {"model": MODEL, "token_ids": TOKS}))
    st, headers, body = fast.answer()
    assert st == 200 and headers["content-type"] == "application/json; charset=utf-8"
    fast.sock.sendall(_req("/v1/pick", {"token_ids": TOKS}))
    assert json.loads(fast.answer()[2]) == {"model": MODEL, "pick": "a", "prompt_tokens": 64}
    assert _metric("kvservice_http_handoffs_total") == handoffs  # both answered by the fast path
    # the same body on a connection aiohttp serves (handed off by its first request: another route)
    slow = Conn(s.url)
    slow.sock.sendall(_req("/healthz", method="GET") + _req("/v1/score", {"model": MODEL, "token_ids": TOKS}))
    assert slow.answer()[0] == 200
    st2, headers2, body2 = slow.answer()
    assert st2 == 200 and body2 == body and "aiohttp" in headers2.get("server", "")
    assert json.loads(body)["pods"][0]["tokens_by_tier"] == {"GPU": 64}
    assert _metric("kvservice_http_handoffs_total") == handoffs + 1
    after = _metric('kvservice_http_requests_total{route="/v1/score",method="POST",status="200"}')
    assert after == scored + 2  # one per path: the fast path counts like the middleware does
    fast.close()
    slow.close()


def test_pipelined_requests_keep_their_order_across_the_hand_off(svc) -> None:
    s, pub = svc
    _ready(s, pub)
    c = Conn(s.url)
    c.sock.sendall(_req("/v1/pick", {"token_ids": TOKS}) + _req("/readyz", method="GET", token=None)
                   + _req("/v1/pick", {"token_ids": [7] * 16}))
    a1, a2, a3 = c.answer(), c.answer(), c.answer()
    assert (a1[0], json.loads(a1[2])["pick"]) == (200, "a")
    assert a2[0] == 200 and json.loads(a2[2]) == {"ready": True}
    assert a3[0] == 200 and json.loads(a3[2])["prompt_tokens"] == 16
    c.close()


@pytest.mark.parametrize("request_bytes, status, field", [
    (_req("/v1/score", {"token_ids": ["x"]}), 400, "token_ids[0]"),
    (_req("/v1/score", {"model": "nope", "token_ids": TOKS}), 404, "model"),
    (_req("/v1/score", {"token_ids": TOKS, "extra": 1}), 400, "extra"),
    (_req("/v1/score", {"token_ids": TOKS}, token="wrong"), 401, "Authorization"),
    (_req("/v1/score", {"token_ids": TOKS}, token=None), 401, "Authorization"),
    (_req("/v1/score", {"token_ids": list(range(3000))}), 413, None),
    (_req("/v1/score", {"token_ids": TOKS}, headers={"Content-Type": "text/plain"}), 415, "content-type"),
    (_req("/v1/score", {"prompt": "hello"}), 400, "prompt"),  # no tokenizer here: aiohttp says so
    (_req("/v1/score", raw=b"{not json"), 400, None),
])
def test_errors_are_answered_by_aiohttp_with_the_error_json(svc, request_bytes, status, field) -> None:
    s, _pub = svc
    c = Conn(s.url)
    c.sock.sendall(request_bytes)
    st, _h, body = c.answer()
    err = json.loads(body)["error"]
    assert st == status and err["status"] == status and err["field"] == field
    c.close()


def test_a_request_in_pieces_and_connection_close(svc) -> None:
    s, pub = svc
    _ready(s, pub)
    data = _req("/v1/score", {"model": MODEL, "token_ids": TOKS}, headers={"Connection": "close"})
    c = Conn(s.url)
    c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for piece in (data[:7], data[7:40], data[40:-100], data[-100:-1], data[-1:]):
        c.sock.sendall(piece)
    st, headers, body = c.answer()
    assert st == 200 and headers["connection"] == "close" and json.loads(body)["pick"] == "a"
    assert c.closed()
    c.close()


def test_answers_see_the_index_between_two_batches_while_ingest_writes(svc) -> None:
    """Each batch extends pod a's cached chain by 4 blocks (64 tokens); a score read while
    ingest applies them must always see whole batches: matched tokens a multiple of 64, never
    going back."""
    s, pub = svc
    rounds = 20  # 1,280 token ids: within the 8 KiB body limit
    toks = list(range(5000, 5000 + rounds * 64))
    seen: list[int] = []
    bad: list[object] = []
    done = threading.Event()

    def client() -> None:
        c = Conn(s.url)
        while not done.is_set():
            c.sock.sendall(_req("/v1/score", {"token_ids": toks}))
            st, _h, body = c.answer()
            if st != 200:
                bad.append((st, body))
                break
            pods = json.loads(body)["pods"]
            seen.append(pods[0]["matched_tokens"] if pods else 0)
        c.close()

    pub.publish(stored([1] * 16, [1]))  # pod a synced (scored) before the chain starts
    wait_for(lambda: s.http.get("/v1/pods")[1]["router"]["entries"] >= 1, what="pod a indexed")
    t = threading.Thread(target=client, daemon=True)
    t.start()
    try:
        for i in range(rounds):
            hashes = list(range(10_000 + i * 4, 10_004 + i * 4))
            pub.publish(stored(toks[i * 64:(i + 1) * 64], hashes, parent=hashes[0] - 1 if i else None))
            if i % 4 == 0:  # the client reads this batch's answer while the rest is still to come
                # (waiting for that answer, not for any 2 answers: on a loaded machine those could
                # all come before ingest applied anything, and the chain lengths seen be too few)
                wait_for(lambda i=i: bad or (seen and seen[-1] >= (i + 1) * 64), timeout=20,
                         what="an answer seeing this batch")
        wait_for(lambda: bad or (seen and seen[-1] == rounds * 64), timeout=20, what="the whole chain scored")
    finally:
        done.set()
        t.join(10)
    assert not bad
    assert len(set(seen)) > 2  # answers were read while batches were being applied
    assert all(m % 64 == 0 for m in seen), sorted(set(m % 64 for m in seen))
    assert seen == sorted(seen)


@pytest.mark.parametrize("api, key", [({"event_loop": "trio"}, "api.event_loop"), ({"gil_switch_ms": 0}, "api.gil_switch_ms")])
def test_loop_and_switch_interval_settings_are_validated(api, key) -> None:
    from kvevents.errors import ConfigError

    with pytest.raises(ConfigError, match=key):
        from_dict({"router": {"model": MODEL}, "api": api, "pods": [{"name": "a", "endpoint": "ipc:///tmp/x"}]}).validate()


def test_a_content_length_too_long_for_an_int_is_answered_not_a_protocol_crash(svc) -> None:
    """A hostile Content-Length of thousands of digits (int() refuses more than 4,300) must not
    raise inside the fast front's data_received (asyncio would log a traceback and drop the
    connection): it is handed to aiohttp, which answers with an error status."""
    s, _pub = svc
    c = Conn(s.url)
    c.sock.sendall(_req("/v1/score", raw=b"{}", headers={"Content-Length": "9" * 5000}))
    st, _h, _body = c.answer()
    assert 400 <= st < 500
    c.close()
