"""The HTTP API (aiohttp; JSON by msgspec): scoring, pods, health, metrics, the OpenAPI document.

Every answer that is not a 2xx is a JSON ``{"error": {type, field, message, status}}``; an
unexpected exception is a 500 with that shape (no traceback), counted and logged.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from pathlib import Path

import msgspec
from aiohttp import web

from consumers.keys import json_request
from kvevents.errors import ConfigError, KVEventsError

from .ingest import Fleet
from .metrics import HttpMetrics, render_service_metrics
from .openapi import openapi_document
from .schema import ApiError, ScoreRequest, decode, error_body, token_ids_of
from .tokens import LocalTokenizer, RemoteTokenizer, TokenizerBase

__all__ = ["API_KEY", "PROXY_KEY", "build_app", "read_token"]

log = logging.getLogger("kvservice")
_JSON = "application/json"
#: routes that answer without a token (liveness and readiness probes)
OPEN_ROUTES = frozenset({"/healthz", "/readyz"})


def _ORDER(s):  # noqa: N802 — the answer's pod order: best total, then lower load, then name
    return (-s.total, s.load, s.pod)
API_KEY: web.AppKey = web.AppKey("api", object)
PROXY_KEY: web.AppKey = web.AppKey("proxy", object)


def read_token(path: str) -> str:
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ConfigError(f"--api-token-file {path!r}: {exc.strerror}") from None
    if not token:
        raise ConfigError(f"--api-token-file {path!r} is empty")
    return token


def json_response(obj: object, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), status=status, content_type=_JSON)


def error_response(status: int, message: str, field: str | None = None, kind: str = "invalid_request",
                   headers: dict | None = None) -> web.Response:
    return web.Response(body=error_body(status, message, field, kind), status=status, content_type=_JSON,
                        headers=headers)


class Api:
    def __init__(self, fleet: Fleet, *, token: str | None = None, tokenizer: TokenizerBase | None = None) -> None:
        self.fleet = fleet
        self.token = token
        self.metrics = HttpMetrics()
        self.tokenizer = tokenizer
        self.internal_errors = 0
        self.telemetry = None  # kvservice.metrics.Telemetry once the service runs
        self.proxy = None  # kvservice.proxy.Proxy in --proxy mode
        self.fast_site = None  # kvservice.fasthttp.FastSite (every connection's front) once serving
        #: /v1/pods' per-pod entry counts (KVRouter.entries_by_pod, O(index)) are reused while the
        #: router's batches/entries/pods are unchanged, or for at most this many seconds under load
        self.pods_cache_s = 1.0
        self._by_pod: tuple[tuple, float, dict] | None = None

    # ---- middleware ------------------------------------------------------------------------
    @web.middleware
    async def middleware(self, request: web.Request, handler) -> web.StreamResponse:
        t0 = time.perf_counter()
        route = request.match_info.route.resource
        name = route.canonical if route is not None else "unmatched"
        status = 500
        try:
            if self.token is not None and request.path not in OPEN_ROUTES:
                got = request.headers.get("Authorization", "")
                if not (got.startswith("Bearer ") and hmac.compare_digest(got[7:].strip(), self.token)):
                    resp = error_response(401, "a bearer token is required (Authorization: Bearer <token>)",
                                          "Authorization", "unauthorized", {"WWW-Authenticate": "Bearer"})
                    status = 401
                    return resp
            try:
                resp = await handler(request)
            except ApiError as exc:
                resp = error_response(exc.status, str(exc), exc.field, exc.kind)
            except web.HTTPRequestEntityTooLarge:
                resp = error_response(413, f"the request body is over the limit of {self.fleet.cfg.api.max_body_bytes} bytes", None,
                                      "body_too_large")
            except web.HTTPException as exc:
                if exc.status < 400:
                    raise
                resp = error_response(exc.status, exc.reason, None, "http_error")
            except KVEventsError as exc:  # the router's input errors (RouterInputError) are the caller's
                resp = error_response(400, str(exc), None)
            status = resp.status
            return resp
        except asyncio.CancelledError:  # the client hung up: its own abort (499), not the server's 500
            status = 499
            raise
        except Exception:  # noqa: BLE001 — never a traceback to the client
            self.internal_errors += 1
            log.exception("internal error on %s %s (counted)", request.method, request.path)
            status = 500
            return error_response(500, "internal error (logged on the server)", None, "internal_error")
        finally:
            self.metrics.observe(name, request.method, status, time.perf_counter() - t0)

    # ---- helpers ---------------------------------------------------------------------------
    async def read_json(self, request: web.Request, kind: type):
        if request.content_type not in (_JSON, "application/octet-stream", ""):
            raise ApiError(415, f"content-type must be {_JSON}, got {request.content_type!r}", "content-type")
        return decode(await request.read(), kind)

    def model_of(self, req) -> str:
        return self.model_named(req.model)

    def model_named(self, model: str | None) -> str:
        """The model a request asks for (None: the fleet's only one); ApiError 400/404 otherwise."""
        models = self.fleet.models
        if model is None:
            if len(models) == 1:
                return next(iter(models))
            raise ApiError(400, f"model is required: the fleet serves {sorted(models)!r}", "model")
        if model not in models:
            raise ApiError(404, f"model {model!r} is not served by any configured pod (known: {sorted(models)!r})",
                           "model", "unknown_model")
        return model

    async def tokens_of(self, req: ScoreRequest, model: str, token_ids=None):
        """The prompt's token ids: ``token_ids`` (already read by :func:`token_ids_of`), or the
        prompt/messages tokenized."""
        given = [k for k, v in (("token_ids", token_ids), ("prompt", req.prompt), ("messages", req.messages))
                 if v is not None]
        if len(given) != 1:
            raise ApiError(400, "give exactly one of token_ids, prompt or messages" +
                           (f" (got {', '.join(given)})" if given else ""), given[1] if len(given) > 1 else "token_ids")
        if token_ids is not None:
            if not token_ids:
                raise ApiError(400, "token_ids is empty", "token_ids")
            return token_ids
        if req.prompt is not None and not req.prompt:
            raise ApiError(400, "prompt is empty", "prompt")
        if req.messages is not None and not req.messages:
            raise ApiError(400, "messages is empty", "messages")
        if self.tokenizer is None:
            raise ApiError(400, "prompt/messages need a tokenizer: start the service with --tokenizer or give "
                           "pods an http URL", "prompt" if req.prompt is not None else "messages")
        return await self.tokenizer.encode(model, req.prompt, req.messages)

    # ---- routes ----------------------------------------------------------------------------
    def _score_answer(self, req: ScoreRequest, model: str, tokens) -> bytes:
        """The /v1/score answer, both routes': written in C by ``Scorer.score_json`` over the
        native index; else (another index backend, or a call the tracer samples, whose span
        needs the Scores) ``score()``'s Scores sorted and encoded by msgspec, the reference it
        is tested against."""
        router = self.fleet.router
        with self.fleet.lock:
            out = router.scorer.score_json(tokens, req.lora_name, model=model, load=req.load)
            if out is not None:
                return out
            scores = router.score(tokens, req.lora_name, model=model, load=req.load)
        pods = sorted(scores.values(), key=_ORDER)
        return msgspec.json.encode({
            "model": model, "prompt_tokens": len(tokens), "pick": pods[0].pod if pods else None,
            "pods": pods})  # consumers.Score Structs: msgspec encodes them as they are

    def _pick_answer(self, req: ScoreRequest, model: str, tokens) -> bytes:
        with self.fleet.lock:
            pod = self.fleet.router.pick(tokens, req.lora_name, model=model, load=req.load)
        return msgspec.json.encode({"model": model, "pick": pod, "prompt_tokens": len(tokens)})

    def fast_answer(self, route: str, body: bytes | memoryview) -> bytes | None:
        """The JSON answer of a hot route for a raw body (kvservice.fasthttp), without awaiting:
        None when the body needs the tokenizer; an exception for anything that is an error (the
        caller then hands the request to aiohttp, which answers it with the error JSON).

        A body of the common shape (model, lora_name, token_ids) is read in one C pass
        (``json_request``), anything else by msgspec's typed decode; the answer is the aiohttp
        route's (:meth:`_score_answer`, :meth:`_pick_answer`)."""
        got = json_request(body) if json_request is not None else None
        if got is None:
            req = decode(body, ScoreRequest)
            if req.prompt is not None or req.messages is not None:
                return None
            tokens = token_ids_of(req)
            if not tokens:
                return None
        else:
            req = ScoreRequest(model=got[0], lora_name=got[1])
            tokens = got[2]
        model = self.model_named(req.model)
        if route != "/v1/score":
            return self._pick_answer(req, model, tokens)
        return self._score_answer(req, model, tokens)

    async def score(self, request: web.Request) -> web.Response:
        req = await self.read_json(request, ScoreRequest)
        token_ids = token_ids_of(req)
        model = self.model_of(req)
        tokens = await self.tokens_of(req, model, token_ids)
        return web.Response(body=self._score_answer(req, model, tokens), content_type=_JSON)

    async def pick(self, request: web.Request) -> web.Response:
        req = await self.read_json(request, ScoreRequest)
        token_ids = token_ids_of(req)
        model = self.model_of(req)
        tokens = await self.tokens_of(req, model, token_ids)
        return web.Response(body=self._pick_answer(req, model, tokens), content_type=_JSON)

    async def explain(self, request: web.Request) -> web.Response:
        req = await self.read_json(request, ScoreRequest)
        token_ids = token_ids_of(req)
        model = self.model_of(req)
        tokens = await self.tokens_of(req, model, token_ids)
        with self.fleet.lock:
            exp = self.fleet.router.explain(tokens, req.lora_name, model=model)
        return json_response({"model": model, "prompt_tokens": len(tokens),
                              "pods": {pod: [msgspec.structs.asdict(e) if isinstance(e, msgspec.Struct) else
                                             _plain(e) for e in es] for pod, es in exp.items()}})

    async def pods(self, request: web.Request) -> web.Response:
        view = self.fleet.pods_view()
        with self.fleet.lock:
            router = self.fleet.router
            counters = router.counters()
            by_tier = router.entries_by_tier()
            key = tuple(counters.get(k) for k in ("batches", "entries", "keys", "pods", "resets", "purges"))
            now = time.monotonic()
            cached = self._by_pod
            if cached is None or (cached[0] != key and now - cached[1] >= self.pods_cache_s):
                cached = self._by_pod = (key, now, router.entries_by_pod())
        by_pod = cached[2]
        for p in view["pods"]:
            p["entries_by_tier"] = by_pod.get(p["name"]) or {tier: 0 for tier in by_tier}
        view["router"] = {"entries": counters.get("entries"), "entries_by_tier": by_tier, "keys": counters.get("keys"),
                          "errors": counters.get("errors", {}), "batches": counters.get("batches")}
        proxy = getattr(self, "proxy", None)
        if proxy is not None:
            down = proxy.down_pods()
            for p in view["pods"]:
                p["proxy_down"] = p["name"] in down
        return json_response(view)

    async def healthz(self, request: web.Request) -> web.Response:
        return json_response({"status": "alive"})

    async def readyz(self, request: web.Request) -> web.Response:
        fleet = self.fleet
        waiting = sorted(st.name for st in fleet.pods.values() if st.configured and not st.synced_once)
        if fleet.ready:
            return json_response({"ready": True})
        return json_response({"ready": False, "waiting_for": waiting}, status=503)

    async def metrics_route(self, request: web.Request) -> web.Response:
        text = render_service_metrics(self)
        return web.Response(body=text, content_type="text/plain", charset="utf-8",
                            headers={"X-Content-Type": "text/plain; version=0.0.4"})

    async def openapi(self, request: web.Request) -> web.Response:
        return json_response(openapi_document(proxy=request.app[PROXY_KEY] is not None))


def _plain(obj):
    from dataclasses import asdict, is_dataclass

    return asdict(obj) if is_dataclass(obj) else obj


def make_tokenizer(fleet: Fleet, path: str | None, timeout: float) -> TokenizerBase | None:
    if path:
        return LocalTokenizer(path)
    urls: dict[str, list[str]] = {}
    for p in fleet.cfg.pods:
        model = fleet.cfg.pod_model(p)
        if p.http and model:
            urls.setdefault(model, []).append(p.http.rstrip("/"))
    return RemoteTokenizer(urls, timeout) if urls else None


def build_app(fleet: Fleet, *, token: str | None = None, tokenizer: TokenizerBase | None = None,
              proxy: object | None = None) -> web.Application:
    """The aiohttp application (the caller runs it and starts/stops the fleet)."""
    api = Api(fleet, token=token, tokenizer=tokenizer)
    app = web.Application(middlewares=[api.middleware], client_max_size=fleet.cfg.api.max_body_bytes)
    app[API_KEY] = api
    app[PROXY_KEY] = proxy
    r = app.router
    r.add_post("/v1/score", api.score)
    r.add_post("/v1/pick", api.pick)
    r.add_post("/v1/explain", api.explain)
    r.add_get("/v1/pods", api.pods)
    r.add_get("/healthz", api.healthz)
    r.add_get("/readyz", api.readyz)
    r.add_get("/metrics", api.metrics_route)
    r.add_get("/openapi.json", api.openapi)
    if proxy is not None:
        proxy.install(app, api)  # type: ignore[attr-defined]

    async def on_cleanup(_app) -> None:
        if api.tokenizer is not None:
            await api.tokenizer.close()

    app.on_cleanup.append(on_cleanup)
    return app
