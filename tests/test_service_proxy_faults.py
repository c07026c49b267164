"""The proxy's fault behaviour against fake engines that count the requests they get (real HTTP
over loopback): retries only where the pod cannot have started the request, statuses as they
are, streams cut upstream, clients that hang up or stop reading, the breaker, the queue, caps."""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import pytest
from aiohttp import web

from kvevents.errors import ConfigError
from kvservice.config import from_dict

from .service_helpers import InProcessService, wait_for

MODEL = "m"


class FakeEngine:
    """An OpenAI-ish server whose ``mode`` says how it answers ``POST /v1/completions``:
    ok, status500, status503, hang (until ``release``), drop (reads the request, closes the
    connection), cut (streams two events then drops), cut_json (half a JSON answer then drops),
    big (a JSON answer of ``size`` bytes), big_chunked (the same without a length), flood (SSE
    without end). ``posts`` counts requests that reached the handler; ``lost`` is set when a
    handler is cancelled (the proxy closed the connection)."""

    def __init__(self, mode: str = "ok", size: int = 0) -> None:
        self.mode = mode
        self.size = size
        self.posts = 0
        self.lost = threading.Event()
        self.entered = threading.Event()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self) -> str:
        self.release = asyncio.Event()
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        self.runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.posts += 1
        self.entered.set()
        mode = self.mode
        try:
            if mode == "hang":
                await self.release.wait()
            if mode in ("ok", "hang"):
                if body.get("stream"):
                    resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
                    await resp.prepare(request)
                    for i in range(3):
                        await resp.write(b'data: {"i": %d}\n\n' % i)
                    await resp.write(b"data: [DONE]\n\n")
                    return resp
                return web.json_response({"object": "text_completion", "choices": [{"text": "x"}]})
            if mode.startswith("status"):
                return web.json_response({"error": "engine says no"}, status=int(mode[6:]))
            if mode == "drop":
                request.transport.abort()
                await asyncio.sleep(3600)
            if mode == "cut":
                resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
                await resp.prepare(request)
                await resp.write(b'data: {"i": 0}\n\n')
                await resp.write(b'data: {"i": 1}\n\n')
                await asyncio.sleep(0.05)
                request.transport.abort()
                await asyncio.sleep(3600)
            if mode == "cut_json":
                resp = web.StreamResponse(headers={"content-type": "application/json"})
                resp.content_length = self.size or 1000
                await resp.prepare(request)
                await resp.write(b'{"choices": [')
                await asyncio.sleep(0.05)
                request.transport.abort()
                await asyncio.sleep(3600)
            if mode == "big":
                return web.Response(body=b"x" * self.size, content_type="application/json")
            if mode == "big_chunked":
                resp = web.StreamResponse(headers={"content-type": "application/json"})
                resp.enable_chunked_encoding()
                await resp.prepare(request)
                for _ in range(0, self.size, 65536):
                    await resp.write(b"x" * 65536)
                await resp.write_eof()
                return resp
            if mode == "flood":
                resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
                await resp.prepare(request)
                chunk = b"data: " + b"y" * 65536 + b"\n\n"
                while True:
                    await resp.write(chunk)
        except (asyncio.CancelledError, ConnectionError):
            self.lost.set()
            raise
        raise AssertionError(mode)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.release.set)
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there: connections are refused
    return port


@pytest.fixture(params=[True, False], ids=["lean-front", "aiohttp-front"])
def start(tmp_path, request):
    """The service with the proxy; every test runs on both client fronts (kvservice.fasthttp
    answers the common request itself; aiohttp the rest, e.g. with ``api.fast_path`` off)."""
    made: list = []

    def go(urls: list[str], api: dict | None = None, **proxy):
        cfg = {"router": {"model": MODEL},
               "api": {"port": 0, "proxy": True, "upstream_timeout": 5.0, "fast_path": request.param, **(api or {})},
               **({"proxy": proxy} if proxy else {}),
               "pods": [{"name": f"p{i}", "endpoint": f"ipc://{tmp_path}/p{i}.pub", "http": u}
                        for i, u in enumerate(urls)]}
        svc = InProcessService(from_dict(cfg).validate())
        made.append(svc)
        return svc

    yield go
    for svc in made:
        svc.close()


@pytest.fixture
def engines():
    made: list[FakeEngine] = []

    def go(*modes, size: int = 0):
        out = [FakeEngine(m, size) for m in modes]
        made.extend(out)
        return out

    yield go
    for e in made:
        e.close()


def _post(svc, body=None, raw=None, path="/v1/completions", timeout=10.0, headers=None):
    return svc.http.call("POST", path, {"model": MODEL, "prompt": [1, 2, 3], **(body or {})} if raw is None else None,
                         raw=raw, timeout=timeout, headers=headers)


def _metrics(svc) -> str:
    return svc.http.call("GET", "/metrics")[2].decode()


def _raw_stream(svc, body: dict) -> socket.socket:
    """A streamed request on a plain socket (to hang up on, or never read)."""
    host, port = svc.url.split("//")[1].rstrip("/").split(":")
    s = socket.create_connection((host, int(port)))
    data = json.dumps({"model": MODEL, "prompt": [1, 2, 3], "stream": True, **body}).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return s


# ---- retries: only where the pod cannot have started the request -----------------------------
@pytest.mark.parametrize("mode", ["hang", "drop"])
def test_a_post_the_pod_may_have_started_is_never_sent_twice(start, engines, mode) -> None:
    """Both pods take the request and then time out (hang) or drop the connection: whichever
    was tried, the request reached exactly one engine and the client is told which."""
    a, b = engines(mode, mode)
    svc = start([a.url, b.url], api={"upstream_timeout": 0.3})
    status, headers, data = _post(svc)
    assert a.posts + b.posts == 1
    err = json.loads(data)["error"]
    if mode == "hang":
        assert status == 504 and err["type"] == "upstream_timeout" and "not retried" in err["message"]
    else:
        assert status == 502 and err["type"] == "upstream_error" and "not retried" in err["message"]
    assert headers["x-kvevents-attempts"] == "1"
    outcome = "first_byte_timeout" if mode == "hang" else "failed"
    assert f'outcome="{outcome}"}} 1' in _metrics(svc)
    assert "kvservice_proxy_retries_total 0" in _metrics(svc)


def test_a_refused_connection_is_retried_on_another_pod(start, engines) -> None:
    (good,) = engines("ok")
    svc = start([f"http://127.0.0.1:{_closed_port()}", good.url], retry_backoff=0.0, breaker_failures=100)
    sent = 0
    while 'pod="p0",outcome="refused"' not in _metrics(svc):
        assert sent < 40, "the refused pod was never tried first"
        status, headers, _ = _post(svc)
        sent += 1
        assert status == 200 and headers["x-kvevents-pod"] == "p1"
    assert good.posts == sent  # every request served once, by the pod that could take it
    text = _metrics(svc)
    refused = int(text.split('kvservice_proxy_requests_total{pod="p0",outcome="refused"} ')[1].split()[0])
    assert f"kvservice_proxy_retries_total {refused}" in text


def test_the_retry_budget_bounds_retries(start, engines) -> None:
    svc = start([f"http://127.0.0.1:{_closed_port()}", f"http://127.0.0.1:{_closed_port()}"],
                retry_budget_burst=1, retry_budget_ratio=0.0, retry_backoff=0.0, breaker_failures=100)
    statuses = [_post(svc)[0] for _ in range(3)]
    assert statuses == [502, 502, 502]
    text = _metrics(svc)
    assert "kvservice_proxy_retries_total 1" in text and "kvservice_proxy_retry_budget_exhausted_total 2" in text


# ---- statuses as they are, and the breaker -------------------------------------------------
def test_an_upstream_500_passes_as_is_and_opens_the_breaker(start, engines) -> None:
    (bad,) = engines("status500")
    svc = start([bad.url], breaker_failures=2)
    for _ in range(2):
        status, _h, data = _post(svc)
        assert status == 500 and json.loads(data) == {"error": "engine says no"}
    text = _metrics(svc)
    assert 'kvservice_proxy_requests_total{pod="p0",outcome="status_5xx"} 2' in text
    assert 'kvservice_proxy_upstream_responses_total{pod="p0",status="500"} 2' in text
    assert 'outcome="ok"' not in text and 'kvservice_pod_down{pod="p0"} 1' in text
    status, headers, data = _post(svc)  # breaker open: not sent
    assert status == 503 and json.loads(data)["error"]["type"] == "no_pod" and int(headers["Retry-After"]) >= 1
    assert bad.posts == 2


def test_the_breaker_half_opens_for_one_probe(start, engines) -> None:
    (eng,) = engines("status500")
    svc = start([eng.url], api={"down_for": 0.2}, breaker_failures=1)
    assert _post(svc)[0] == 500
    assert _post(svc)[0] == 503  # open
    eng.mode = "ok"
    wait_for(lambda: 'kvservice_pod_down{pod="p0"} 0' in _metrics(svc), what="breaker half-open")
    assert _post(svc)[0] == 200  # the probe succeeds: closed again
    assert _post(svc)[0] == 200 and eng.posts == 3


def test_retry_statuses_are_tried_elsewhere(start, engines) -> None:
    shed, good = engines("status503", "ok")
    svc = start([shed.url, good.url], retry_statuses=[503], retry_backoff=0.0, breaker_failures=100)
    for _ in range(20):
        status, headers, _ = _post(svc)
        assert status == 200 and headers["x-kvevents-pod"] == "p1"
        if shed.posts:
            break
    assert shed.posts >= 1 and headers["x-kvevents-attempts"] == "2"


# ---- streams and answers -------------------------------------------------------------------
def test_a_stream_cut_upstream_reaches_the_client_as_an_error_event(start, engines) -> None:
    (eng,) = engines("cut")
    svc = start([eng.url])
    status, _h, data = _post(svc, {"stream": True})
    assert status == 200
    events = [line[6:] for line in data.decode().split("\n") if line.startswith("data: ")]
    assert events[:2] == ['{"i": 0}', '{"i": 1}'] and "[DONE]" not in events
    err = json.loads(events[-1])["error"]
    assert err["type"] == "upstream_cut" and "p0" in err["message"]
    assert 'kvservice_proxy_requests_total{pod="p0",outcome="cut_midstream"} 1' in _metrics(svc)


def test_a_json_answer_cut_upstream_is_an_error_for_the_client(start, engines) -> None:
    """Cut before anything was sent on (a small answer is read whole): a 502 naming the pod; cut
    after the head went out (a large answer passes in chunks): the client's connection is cut."""
    import http.client

    small, large = engines("cut_json", "cut_json", size=1 << 20)
    small.size = 0
    svc = start([small.url])
    status, _h, data = _post(svc)
    assert status == 502 and json.loads(data)["error"]["type"] == "upstream_cut"
    svc2 = start([large.url])
    with pytest.raises(http.client.IncompleteRead):
        _post(svc2)
    assert 'outcome="cut_midstream"} 1' in _metrics(svc) and 'outcome="cut_midstream"} 1' in _metrics(svc2)


def test_answers_over_the_cap_are_a_clear_error(start, engines) -> None:
    import http.client

    sized, chunked = engines("big", "big_chunked", size=1 << 20)
    svc = start([sized.url], max_answer_bytes=100_000)
    status, _h, data = _post(svc)
    assert status == 502 and "proxy.max_answer_bytes" in json.loads(data)["error"]["message"]
    svc2 = start([chunked.url], max_answer_bytes=100_000)
    with pytest.raises(http.client.IncompleteRead):
        _post(svc2)
    assert 'outcome="too_large"} 1' in _metrics(svc2)
    svc3 = start([sized.url])  # under the default cap: passed through whole, in chunks
    status, _h, data = _post(svc3)
    assert status == 200 and data == b"x" * (1 << 20)


# ---- the client's faults are the client's --------------------------------------------------
def _idle(svc) -> bool:
    t = _metrics(svc)
    return 'kvservice_proxy_in_flight{pod="p0"} 0' in t and 'kvservice_proxy_active{state="forwarding"} 0' in t


def test_a_client_hanging_up_mid_stream_is_the_clients(start, engines) -> None:
    (eng,) = engines("flood")
    svc = start([eng.url])
    s = _raw_stream(svc, {})
    assert s.recv(65536)  # the stream started
    s.close()
    assert eng.lost.wait(10)  # the proxy closed the pod's connection: the engine stops
    wait_for(lambda: _idle(svc), what="slot released")
    text = _metrics(svc)
    assert 'outcome="client_abort"} 1' in text and 'outcome="cut_midstream"' not in text
    assert 'kvservice_pod_down{pod="p0"} 0' in text
    eng.mode = "ok"
    assert _post(svc)[0] == 200


def test_a_client_hanging_up_before_the_answer_cancels_the_pods_request(start, engines) -> None:
    (eng,) = engines("hang")
    svc = start([eng.url])
    s = _raw_stream(svc, {"stream": False})
    assert eng.entered.wait(10)
    s.close()
    assert eng.lost.wait(10)
    wait_for(lambda: _idle(svc), what="slot released")
    assert 'outcome="client_abort"} 1' in _metrics(svc)


def test_a_client_that_never_reads_is_dropped_as_its_own_abort(start, engines) -> None:
    (eng,) = engines("flood")
    svc = start([eng.url], client_write_timeout=0.3)
    s = _raw_stream(svc, {})
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        assert eng.lost.wait(20)
        wait_for(lambda: _idle(svc), what="slot released")
        text = _metrics(svc)
        assert 'outcome="client_abort"} 1' in text and 'kvservice_pod_down{pod="p0"} 0' in text
        assert "kvservice_internal_errors_total 0" in text
    finally:
        s.close()


# ---- admission -----------------------------------------------------------------------------
def test_the_queue_is_bounded_and_refusals_say_when_to_retry(start, engines) -> None:
    from concurrent.futures import ThreadPoolExecutor

    (eng,) = engines("hang")
    svc = start([eng.url], max_concurrency=1, max_queue=1, overload_status=429, retry_after=2)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(_post, svc)
        assert eng.entered.wait(10)
        second = pool.submit(_post, svc)
        wait_for(lambda: 'kvservice_proxy_active{state="queued"} 1' in _metrics(svc), what="queued")
        status, headers, data = _post(svc)
        assert status == 429 and headers["Retry-After"] == "2"
        assert "max_queue" not in data.decode() and json.loads(data)["error"]["type"] == "overloaded"
        eng.loop.call_soon_threadsafe(eng.release.set)
        assert first.result(10)[0] == 200 and second.result(10)[0] == 200
    assert eng.posts == 2 and 'kvservice_proxy_rejected_total{reason="queue_full"} 1' in _metrics(svc)


def test_a_queued_request_waits_at_most_queue_timeout(start, engines) -> None:
    from concurrent.futures import ThreadPoolExecutor

    (eng,) = engines("hang")
    svc = start([eng.url], max_concurrency=1, queue_timeout=0.2)
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(_post, svc)
        assert eng.entered.wait(10)
        status, headers, _ = _post(svc)
        assert status == 503 and headers["Retry-After"] == "1"
        eng.loop.call_soon_threadsafe(eng.release.set)
        assert first.result(10)[0] == 200
    assert 'kvservice_proxy_rejected_total{reason="queue_timeout"} 1' in _metrics(svc)


# ---- picking without a KV signal ------------------------------------------------------------
def test_without_a_kv_signal_requests_spread_by_load_not_by_name(start, engines) -> None:
    pods = engines("ok", "ok", "ok")
    svc = start([e.url for e in pods])
    for i in range(30):
        assert _post(svc, {"prompt": [1000 + i, 7, 8]})[0] == 200
    assert all(e.posts for e in pods), [e.posts for e in pods]


def test_concurrent_requests_go_to_the_least_loaded_pods(start, engines) -> None:
    from concurrent.futures import ThreadPoolExecutor

    pods = engines("hang", "hang", "hang")
    svc = start([e.url for e in pods])
    with ThreadPoolExecutor(3) as pool:
        futs = [pool.submit(_post, svc) for _ in range(3)]
        wait_for(lambda: sum(e.posts for e in pods) == 3, what="three in flight")
        assert [e.posts for e in pods] == [1, 1, 1]
        for e in pods:
            e.loop.call_soon_threadsafe(e.release.set)
        assert [f.result(10)[0] for f in futs] == [200] * 3


def test_session_affinity_keeps_a_session_on_its_pod(start, engines) -> None:
    pods = engines("ok", "ok", "ok")
    svc = start([e.url for e in pods], affinity_header="x-session-id")
    first = _post(svc, headers={"x-session-id": "s1"})[1]["x-kvevents-pod"]
    for i in range(10):
        assert _post(svc, {"prompt": [i, 9]}, headers={"x-session-id": "s1"})[1]["x-kvevents-pod"] == first
    assert 'kvservice_proxy_affinity_total{result="kept"} 10' in _metrics(svc)


# ---- bad input and settings ----------------------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_malformed_bodies_are_a_4xx_naming_the_problem(start, engines, path) -> None:
    (eng,) = engines("ok")
    svc = start([eng.url])
    deep = b'{"model": "m", "prompt": [1], "x": ' + b"[" * 500_000 + b"]" * 500_000 + b"}"
    for raw, words in ((b'{"model": "m", ', "not valid JSON"), (b'{"model": "m", "prompt": "\xff\xfe"}', "UTF-8"),
                       (b'{"model": "m", "prompt": [1], "user": "\xc3"}', "UTF-8"), (deep, "nests too deeply"),
                       (b"[1, 2]", "JSON object")):
        status, _h, data = _post(svc, raw=raw, path=path)
        assert status == 400 and words in json.loads(data)["error"]["message"], (raw[:40], data)
    assert eng.posts == 0 and "kvservice_internal_errors_total 0" in _metrics(svc)


def test_proxy_settings_are_checked_with_the_key_named() -> None:
    base = {"router": {"model": MODEL}, "pods": [{"name": "a", "endpoint": "tcp://127.0.0.1:5557",
                                                  "http": "http://127.0.0.1:1"}]}
    for proxy, key in (({"max_retries": -1}, "proxy.max_retries"), ({"balance": "name"}, "proxy.balance"),
                       ({"connect_timeout": "3"}, "proxy.connect_timeout"), ({"nope": 1}, "proxy.nope"),
                       ({"overload_status": 500}, "proxy.overload_status"),
                       ({"retry_statuses": [200]}, "proxy.retry_statuses"),
                       ({"affinity_header": "a b"}, "proxy.affinity_header")):
        with pytest.raises(ConfigError, match=rf"^{key}\b"):
            from_dict({**base, "proxy": proxy})


def test_a_large_answer_passes_through_in_bounded_memory(start, engines) -> None:
    """32 MiB sent by the pod in 64 KiB chunks and read by the client in 64 KiB pieces: the proxy
    holds a bounded part of it, never the whole (Python allocations traced in this process,
    where the proxy, the engine and the client all run)."""
    import tracemalloc
    import urllib.request

    size = 32 << 20
    (eng,) = engines("big_chunked", size=size)
    svc = start([eng.url])
    req = urllib.request.Request(svc.url + "/v1/completions", method="POST",
                                 data=json.dumps({"model": MODEL, "prompt": [1, 2]}).encode(),
                                 headers={"content-type": "application/json"})
    tracemalloc.start()
    try:
        got = 0
        with urllib.request.urlopen(req, timeout=30) as r:
            while chunk := r.read(65536):
                got += len(chunk)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert got == size
    assert peak < size // 4, f"peak {peak >> 20} MiB of Python allocations for a {size >> 20} MiB answer"


def test_prompts_of_every_shape_are_read_or_refused_by_name(start, engines) -> None:
    (eng,) = engines("ok")
    svc = start([eng.url])
    for prompt in ([5, 6, 7], [[5, 6, 7], [8]], [[5, 6, 7], "text"]):
        assert _post(svc, {"prompt": prompt})[0] == 200, prompt
    for prompt in ([], [-1, 2], [1, 2 ** 40], [1, "a"], 7, None, [[]], ""):
        status, _h, data = _post(svc, {"prompt": prompt})
        err = json.loads(data)["error"]
        assert status == 400 and err["field"] == "prompt", (prompt, data)
    assert eng.posts == 3
    assert 'kvservice_proxy_connections_opened_total{pod="p0"} 1' in _metrics(svc)  # kept warm
