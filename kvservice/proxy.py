"""The OpenAI-compatible proxy: ``/v1/completions`` and ``/v1/chat/completions``.

Each request is tokenized the way the engine does (a local tokenizer, else a pod's
``/tokenize``), scored by the router, and forwarded unchanged (same body bytes) to the best
pod's OpenAI server; the answer — JSON, or a ``text/event-stream`` passed through chunk by
chunk — comes back with ``x-kvevents-pod`` and ``x-kvevents-matched-tokens``.

Order of candidates: the router's score (best first; ties: fewer requests in flight, then
name), then the model's pods the router has no score for, pods marked down last. A pod that
refuses the connection, times out, or answers 502/503/504 before any byte of the answer was
sent is marked down for ``down_for`` seconds and the next candidate is tried (counted:
``kvservice_proxy_retries_total``, ``kvservice_proxy_requests_total{outcome}``). Once a
stream has started it cannot move: a pod failing mid-stream ends that answer (counted as
``failed_midstream``) and is marked down.
"""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
from aiohttp import web

from .schema import ApiError, decode

__all__ = ["Proxy"]

log = logging.getLogger("kvservice")
_RETRY_STATUS = frozenset({502, 503, 504})
#: request headers passed on to the pod (the body goes byte for byte)
_PASS = ("content-type", "accept", "user-agent", "x-request-id", "traceparent", "tracestate")
#: answer headers not copied back (hop-by-hop, or recomputed by the server)
_DROP = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive", "content-encoding",
                   "server", "date"})


class Proxy:
    def __init__(self, fleet, api_cfg) -> None:
        self.fleet = fleet
        self.cfg = api_cfg
        self.targets: dict[str, str] = {p.name: p.http.rstrip("/") for p in fleet.cfg.pods if p.http}
        self.pod_model = {p.name: fleet.cfg.pod_model(p) for p in fleet.cfg.pods}
        self.down_until: dict[str, float] = {}
        self.in_flight: dict[str, int] = {}
        self.outcomes: dict[tuple[str, str], int] = {}  # (pod, ok/failed/timeout/status_5xx/failed_midstream)
        self.retries = 0
        self.no_pod = 0
        self.tokenize_s = 0.0  #: time spent tokenizing (sum), apart from forwarding
        self.tokenized = 0
        self._session: aiohttp.ClientSession | None = None
        self.api = None
        self.forward_authorization = True

    def install(self, app: web.Application, api) -> None:
        self.api = api
        api.proxy = self
        self.forward_authorization = api.token is None  # the client's token is the router's, then
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.on_cleanup.append(self._close)

    async def _close(self, _app) -> None:
        if self._session is not None:
            await self._session.close()

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            t = self.cfg.upstream_timeout
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=min(t, 5.0), sock_read=t),
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30), auto_decompress=False)
        return self._session

    def _count(self, pod: str, outcome: str) -> None:
        k = (pod, outcome)
        self.outcomes[k] = self.outcomes.get(k, 0) + 1

    def _mark_down(self, pod: str, why: str) -> None:
        first = self.down_until.get(pod, 0.0) < time.monotonic()
        self.down_until[pod] = time.monotonic() + self.cfg.down_for
        if first:
            log.warning("pod %r marked down for %.1fs: %s", pod, self.cfg.down_for, why)

    # ---- routes ----------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=True)

    async def _tokens(self, body: dict, model: str, chat: bool) -> list[int]:
        tok = self.api.tokenizer
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
                raise ApiError(400, "messages must be a non-empty array of objects", "messages")
            if tok is None:
                raise ApiError(400, "messages: no tokenizer (start with --tokenizer, or give pods an http URL)",
                               "messages")
            return await tok.encode(model, messages=msgs, add_generation_prompt=bool(body.get("add_generation_prompt",
                                                                                              True)))
        p = body.get("prompt")
        if isinstance(p, list) and len(p) >= 1 and not all(isinstance(t, int) for t in p):
            p = p[0]  # a batch of prompts: routed by its first one
        if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            return p
        if not isinstance(p, str) or not p:
            raise ApiError(400, "prompt must be a non-empty string or array of token ids", "prompt")
        if tok is None:
            raise ApiError(400, "prompt: no tokenizer (start with --tokenizer, or give pods an http URL)", "prompt")
        return await tok.encode(model, prompt=p)

    def _candidates(self, model: str, tokens: list[int], lora: str | None) -> tuple[list[str], dict]:
        fleet = self.fleet
        load = {p: float(n) for p, n in self.in_flight.items()}
        with fleet.lock:
            scores = fleet.router.score(tokens, lora, model=model, load=load)
        pods = [p for p, m in self.pod_model.items() if m == model and p in self.targets]
        now = time.monotonic()

        def key(p: str):
            s = scores.get(p)
            return (self.down_until.get(p, 0.0) > now, s is None, -(s.total if s else 0.0),
                    self.in_flight.get(p, 0), p)

        return sorted(pods, key=key), scores

    async def _handle(self, request: web.Request, chat: bool) -> web.StreamResponse:
        raw = await request.read()
        body = decode(raw, object)  # BadRequest (400) naming the problem: not JSON, too deep, not UTF-8
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        model = body.get("model")
        if not isinstance(model, str):
            raise ApiError(400, "model must be a string", "model")
        if model not in self.fleet.models:
            raise ApiError(404, f"model {model!r} is not served by any configured pod", "model", "unknown_model")
        t0 = time.perf_counter()
        tokens = await self._tokens(body, model, chat)
        self.tokenize_s += time.perf_counter() - t0
        self.tokenized += 1
        lora = body.get("lora_name") if isinstance(body.get("lora_name"), str) else None
        order, scores = self._candidates(model, tokens, lora)
        if not order:
            self.no_pod += 1
            raise ApiError(503, f"model {model!r}: no pod with an http URL to forward to", "model", "no_pod")
        headers = {k: v for k, v in request.headers.items() if k.lower() in _PASS}
        if self.forward_authorization and "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        path = "/v1/chat/completions" if chat else "/v1/completions"
        last = ""
        for i, pod in enumerate(order):
            if i:
                self.retries += 1
            s = scores.get(pod)
            decision = {"x-kvevents-pod": pod, "x-kvevents-matched-tokens": str(s.matched_tokens if s else 0),
                        "x-kvevents-attempts": str(i + 1)}
            self.in_flight[pod] = self.in_flight.get(pod, 0) + 1
            try:
                resp = await self._forward(request, pod, path, raw, headers, decision)
            except _Failed as exc:
                last = f"{pod}: {exc}"
                self._count(pod, exc.outcome)
                self._mark_down(pod, str(exc))
                continue
            finally:
                self.in_flight[pod] -= 1
            return resp
        raise ApiError(502, f"every pod of model {model!r} failed ({len(order)} tried; last: {last})", None,
                       "upstream_error")

    async def _forward(self, request: web.Request, pod: str, path: str, raw: bytes, headers: dict,
                       decision: dict) -> web.StreamResponse:
        url = self.targets[pod] + path
        try:
            up = await self.session().post(url, data=raw, headers=headers)
        except asyncio.TimeoutError:
            raise _Failed("timeout", "timed out connecting") from None
        except aiohttp.ClientError as exc:
            raise _Failed("failed", f"{type(exc).__name__}: {exc}") from None
        try:
            if up.status in _RETRY_STATUS:
                raise _Failed(f"status_{up.status}", f"answered {up.status}")
            out_headers = {k: v for k, v in up.headers.items() if k.lower() not in _DROP}
            out_headers.update(decision)
            ctype = up.headers.get("content-type", "")
            if not ctype.startswith("text/event-stream"):
                try:
                    data = await up.read()
                except asyncio.TimeoutError:
                    raise _Failed("timeout", "timed out reading the answer") from None
                except aiohttp.ClientError as exc:
                    raise _Failed("failed", f"{type(exc).__name__}: {exc}") from None
                self._count(pod, "ok")
                return web.Response(body=data, status=up.status, headers=out_headers)
            resp = web.StreamResponse(status=up.status, headers=out_headers)
            try:
                first = await up.content.readany()
            except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
                raise _Failed("timeout" if isinstance(exc, asyncio.TimeoutError) else "failed",
                              f"no first chunk: {type(exc).__name__}") from None
            await resp.prepare(request)
            try:
                if first:
                    await resp.write(first)
                async for chunk in up.content.iter_any():
                    await resp.write(chunk)
            except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
                self._count(pod, "failed_midstream")
                self._mark_down(pod, f"failed mid-stream: {type(exc).__name__}")
                return resp
            await resp.write_eof()
            self._count(pod, "ok")
            return resp
        finally:
            up.release()

    def down_pods(self) -> set[str]:
        now = time.monotonic()
        return {p for p, t in self.down_until.items() if t > now}

    def metric_lines(self) -> list[str]:
        out = ["# HELP kvservice_proxy_requests_total Proxied attempts by pod and outcome "
               "(ok, failed, timeout, status_5xx, failed_midstream)",
               "# TYPE kvservice_proxy_requests_total counter"]
        for (pod, outcome), n in sorted(self.outcomes.items()):
            out.append(f'kvservice_proxy_requests_total{{pod="{pod}",outcome="{outcome}"}} {n}')
        out += ["# HELP kvservice_proxy_retries_total Attempts on a next-best pod after a failure",
                "# TYPE kvservice_proxy_retries_total counter", f"kvservice_proxy_retries_total {self.retries}",
                "# HELP kvservice_proxy_no_pod_total Requests with no pod to forward to",
                "# TYPE kvservice_proxy_no_pod_total counter", f"kvservice_proxy_no_pod_total {self.no_pod}",
                "# HELP kvservice_proxy_tokenize_seconds_total Time spent tokenizing proxied requests",
                "# TYPE kvservice_proxy_tokenize_seconds_total counter",
                f"kvservice_proxy_tokenize_seconds_total {self.tokenize_s}",
                "# HELP kvservice_pod_down 1 while the proxy skips a pod that failed",
                "# TYPE kvservice_pod_down gauge"]
        now = time.monotonic()
        for pod in sorted(self.targets):
            out.append(f'kvservice_pod_down{{pod="{pod}"}} {int(self.down_until.get(pod, 0.0) > now)}')
        return out


class _Failed(Exception):
    def __init__(self, outcome: str, message: str) -> None:
        super().__init__(message)
        self.outcome = outcome
