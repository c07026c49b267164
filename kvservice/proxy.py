"""The OpenAI-compatible proxy: ``/v1/completions`` and ``/v1/chat/completions``.

Each request is tokenized the way the engine does (token-id prompts read in C; else a local
tokenizer or a pod's ``/tokenize``), scored by the router, and forwarded unchanged (the same body
bytes) to the pod where its cost — uncached prompt tokens plus the live load this proxy put on
the pod — is lowest (:mod:`kvservice.proxy_policy`). The answer, JSON or a ``text/event-stream``,
passes through in bounded chunks, with ``x-kvevents-pod``, ``x-kvevents-matched-tokens`` and
``x-kvevents-attempts``. Settings: :class:`kvservice.proxy_config.ProxyConfig` (``[proxy]``).

The retry-safety rule: a request is sent to another pod only when the first cannot have started
it — the TCP connection was refused or never opened (or the pod answered one of
``proxy.retry_statuses``). Once any byte of the request may have reached a pod (a timeout
waiting for the answer, a connection dropped after sending) the request is never re-sent: the
client gets a 502/504 naming the pod. Upstream statuses pass through as they are and are
counted as they are. A stream the pod cuts reaches the client as an SSE error event; a small
non-streamed answer cut short as a 502, a large one already under way as a cut connection. The
pods are reached through :mod:`kvservice.proxy_upstream` (warm keep-alive connections). A client that hangs up or stops
reading is the client's: the upstream request is cancelled, the slot released, the pod's
health untouched, counted ``client_abort``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import secrets
import ssl
import time
from typing import Annotated
from urllib.parse import urlsplit

import msgspec
from aiohttp import web

from consumers.keys import json_tokens

from .proxy_config import ProxyConfig
from .proxy_exchange import JSON_HEADERS, AioExchange
from .proxy_policy import Admission, Affinity, Overloaded, PodState, RetryBudget, backoff, order_pods
from .proxy_upstream import Answer, Pool, UpstreamError
from .schema import ApiError, error_body

__all__ = ["Proxy"]

log = logging.getLogger("kvservice")
#: request headers passed on to the pod (the body goes byte for byte)
_PASS = frozenset({"content-type", "accept", "user-agent", "x-request-id", "traceparent", "tracestate"})
#: answer headers not copied back (hop-by-hop, or recomputed by the server)
_DROP = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive", "server", "date", "te", "trailer",
                   "upgrade", "proxy-connection", "proxy-authenticate"})
#: outcomes that count against a pod's circuit breaker
#: a non-streamed answer up to this size is read whole and sent with its head in one write;
#: a larger one passes through in chunks as they come
_WHOLE = 64 << 10
_POD_FAULTS = frozenset({"refused", "connect_timeout", "first_byte_timeout", "total_timeout", "failed",
                         "status_5xx", "cut_midstream"})


class _Body(msgspec.Struct, forbid_unknown_fields=False):
    """The fields the proxy reads; everything else is skipped by msgspec's C decoder and passed
    on in the original bytes. ``prompt``/``messages`` stay raw: token ids are read in C."""

    model: object = None
    prompt: msgspec.Raw = msgspec.Raw(b"")
    messages: msgspec.Raw = msgspec.Raw(b"")
    lora_name: object = None
    add_generation_prompt: object = True


_BODY = msgspec.json.Decoder(_Body)
_ANY = msgspec.json.Decoder()
_ITEMS = msgspec.json.Decoder(list[msgspec.Raw])
_IDS = msgspec.json.Decoder(list[Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]])


class _Retry(Exception):
    """The attempt failed in a way that cannot have started the request: try the next pod."""


class Proxy:
    def __init__(self, fleet, api_cfg, cfg: ProxyConfig | None = None) -> None:
        self.fleet = fleet
        self.api_cfg = api_cfg
        self.cfg = cfg = cfg if cfg is not None else ProxyConfig()
        self.pods: dict[str, PodState] = {}
        self.by_model: dict[str, list[PodState]] = {}
        for p in fleet.cfg.pods:
            if p.http:
                st = PodState(p.name, p.http.rstrip("/"), fleet.cfg.pod_model(p))
                self.pods[p.name] = st
                self.by_model.setdefault(st.model, []).append(st)
        self.targets = {n: p.url for n, p in self.pods.items()}
        #: (pod, chat) -> the request line, with the path prefix of the pod's URL
        self._lines = {(n, chat): f"POST {urlsplit(p.url).path.rstrip('/')}{path} HTTP/1.1\r\n".encode()
                       for n, p in self.pods.items()
                       for chat, path in ((False, "/v1/completions"), (True, "/v1/chat/completions"))}
        self.outcomes: dict[tuple[str, str], int] = {}  #: (pod, outcome) -> attempts
        self.statuses: dict[tuple[str, int], int] = {}  #: (pod, upstream status) -> answers
        self.retries = 0
        self.no_pod = 0
        self.bad_requests = 0
        self.tokenize_s = 0.0  #: time spent tokenizing (sum), apart from forwarding
        self.admission = Admission(cfg.max_concurrency, cfg.max_queue, cfg.queue_timeout)
        self.budget = RetryBudget(cfg.retry_budget_ratio, cfg.retry_budget_burst)
        self.affinity = Affinity(cfg.affinity_max_sessions) if cfg.affinity_header else None
        self.rnd = random.Random()
        self.pools: dict[str, Pool] = {}
        for name, st in self.pods.items():
            u = urlsplit(st.url)
            tls = ssl.create_default_context() if u.scheme == "https" else None
            self.pools[name] = Pool(u.hostname or "", u.port or (443 if tls else 80), cfg.keepalive_timeout, tls)
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
        for pool in self.pools.values():
            pool.close()

    def _count(self, pod: PodState, outcome: str) -> None:
        k = (pod.name, outcome)
        self.outcomes[k] = self.outcomes.get(k, 0) + 1
        if outcome in _POD_FAULTS:
            if pod.failure(self.cfg.breaker_failures, self.api_cfg.down_for, time.monotonic()):
                log.warning("pod %r: circuit breaker open for %.1fs after %d failure(s) in a row (last: %s)",
                            pod.name, self.api_cfg.down_for, pod.failures, outcome)
        elif outcome == "ok":
            pod.success()

    # ---- routes ----------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._aio(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._aio(request, chat=True)

    async def _aio(self, request: web.Request, chat: bool) -> web.StreamResponse:
        """A request aiohttp parsed (the lean front's others: kvservice.fasthttp)."""
        ex = AioExchange(request)
        await self.serve(ex, await request.read(), chat)
        return ex.response

    async def serve(self, ex, raw: bytes, chat: bool) -> None:
        """One proxied request (``ex``: its client side, kvservice.proxy_exchange), answered."""
        try:
            await self._handle(ex, raw, chat)
        except ApiError as exc:
            ex.whole(exc.status, JSON_HEADERS, error_body(exc.status, str(exc), exc.field, exc.kind))

    def _parse(self, raw: bytes, chat: bool) -> tuple[_Body, object]:
        """The body's fields, and the token ids (an array, from C) or the text/messages to tokenize."""
        if not raw:
            raise ApiError(400, "the request body is empty: send a JSON object")
        try:
            if not raw.isascii():
                raw.decode("utf-8")  # the pod gets these exact bytes: never invalid UTF-8
            if not chat and (found := _token_prompt(raw)) is not None:
                return found
            body = _BODY.decode(raw)
        except msgspec.ValidationError:
            try:
                _ANY.decode(raw)
            except (msgspec.DecodeError, RecursionError) as exc:
                raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
            raise ApiError(400, "the request body must be a JSON object") from None
        except msgspec.DecodeError as exc:
            raise ApiError(400, f"the request body is not valid JSON: {exc}") from None
        except UnicodeDecodeError as exc:
            raise ApiError(400, f"the request body is not valid UTF-8 (byte {exc.start})") from None
        except RecursionError:
            raise ApiError(400, "the request body nests too deeply") from None
        if not isinstance(body.model, str):
            raise ApiError(400, "model must be a string", "model")
        if chat:
            msgs = _raw_value(body.messages)
            if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
                raise ApiError(400, "messages must be a non-empty array of objects", "messages")
            return body, msgs
        return body, _prompt(body.prompt, batch=True)

    async def _tokenize(self, body: _Body, what: object, model: str, chat: bool):
        """The prompt text or the chat's messages through the tokenizer."""
        tok = self.api.tokenizer
        field = "messages" if chat else "prompt"
        if tok is None:
            raise ApiError(400, f"{field}: no tokenizer (start with --tokenizer, or give pods an http URL)", field)
        t0 = time.perf_counter()
        try:
            if chat:
                return await tok.encode(model, messages=what, add_generation_prompt=bool(body.add_generation_prompt))
            return await tok.encode(model, prompt=what)
        finally:
            self.tokenize_s += time.perf_counter() - t0

    async def _handle(self, ex, raw: bytes, chat: bool) -> None:
        try:
            body, what = self._parse(raw, chat)
        except ApiError:
            self.bad_requests += 1
            raise
        model = body.model
        pods = self.by_model.get(model)
        if pods is None:
            if model in self.fleet.models:
                self.no_pod += 1
                raise ApiError(503, f"model {model!r}: no pod with an http URL to forward to", "model", "no_pod")
            raise ApiError(404, f"model {model!r} is not served by any configured pod", "model", "unknown_model")
        tokens = what if not chat and not isinstance(what, str) else await self._tokenize(body, what, model, chat)
        self.budget.deposit()
        adm = self.admission
        if not adm.try_enter():
            try:
                await adm.enter()
            except Overloaded as exc:
                return self._refuse(ex, exc.reason)
        try:
            await self._route(ex, raw, body, model, pods, tokens, chat)
        finally:
            adm.leave()

    def _refuse(self, ex, reason: str) -> None:
        c = self.cfg
        msg = (f"the proxy is at its limit of {c.max_concurrency} requests in flight and {c.max_queue} waiting"
               if reason == "queue_full" else
               f"no slot within proxy.queue_timeout ({c.queue_timeout:g} s); {c.max_concurrency} requests in flight")
        ex.whole(c.overload_status, [*JSON_HEADERS, ("Retry-After", str(c.retry_after))],
                 error_body(c.overload_status, msg, None, "overloaded"))

    async def _route(self, ex, raw: bytes, body: _Body, model: str, pods: list[PodState], tokens, chat: bool):
        cfg = self.cfg
        now = time.monotonic()
        matched: dict[str, int] = {}
        lora = body.lora_name if isinstance(body.lora_name, str) else None
        fleet = self.fleet
        with fleet.lock:
            scores = fleet.router.score(tokens, lora, model=model)
        for name, s in scores.items():
            if s.matched_tokens:
                matched[name] = s.matched_tokens
        order = order_pods(pods, len(tokens), matched, cfg, self.rnd, now)
        session = None
        if self.affinity is not None and order:
            session = ex.header(cfg.affinity_header)
            pinned = self.affinity.get(session) if session else None
            if pinned is not None:
                least = min(p.in_flight for p in order)
                for i, p in enumerate(order):
                    if p.name == pinned and p.in_flight <= least + cfg.affinity_max_imbalance:
                        self.affinity.hits += 1
                        order.insert(0, order.pop(i))
                        break
                else:
                    self.affinity.moved += 1
        if not order:
            self.no_pod += 1
            wait = min((p.open_until for p in pods), default=now) - now
            return ex.whole(503, [*JSON_HEADERS, ("Retry-After", str(max(1, round(wait))))],
                            error_body(503, f"model {model!r}: every pod's circuit breaker is open", "model", "no_pod"))
        passed = [f"{k}: {v}\r\n" for k, v in ex.items() if k.lower() in _PASS]
        if self.forward_authorization and (auth := ex.header("Authorization")) is not None:
            passed.append(f"Authorization: {auth}\r\n")
        headers = "".join(passed).encode("utf-8", "surrogateescape")
        last = ""
        tried = 0
        for pod in order[:1 + cfg.max_retries]:
            if tried:
                if not self.budget.take():
                    last += "; no retry: the retry budget is spent"
                    break
                self.retries += 1
                await asyncio.sleep(backoff(tried, cfg.retry_backoff, cfg.retry_backoff_max, self.rnd))
            tried += 1
            if pod.open_until:
                pod.probing = True  # half-open: this request is the probe
            decision = {"x-kvevents-pod": pod.name, "x-kvevents-matched-tokens": str(matched.get(pod.name, 0)),
                        "x-kvevents-attempts": str(tried)}
            try:
                await self._attempt(ex, pod, self._lines[pod.name, chat] + headers, raw, decision,
                                           len(tokens))
            except _Retry as exc:
                last = f"{pod.name}: {exc}"
                continue
            if session:
                self.affinity.set(session, pod.name)
            return
        _error(ex, 502, f"model {model!r}: no pod could take the request ({tried} tried; last: {last})",
                      "upstream_error")

    async def _attempt(self, ex, pod: PodState, head: bytes, raw: bytes, decision: dict, n_tokens: int) -> None:
        pod.in_flight += 1
        pod.prefill += n_tokens
        prefill = n_tokens
        answer = None
        c = self.cfg
        try:
            try:
                answer = await self.pools[pod.name].request(
                    head, raw, connect_timeout=c.connect_timeout, idle=self.api_cfg.upstream_timeout,
                    total=c.total_timeout)
            except UpstreamError as exc:
                self._count(pod, exc.kind)
                if exc.safe:
                    raise _Retry(str(exc)) from None
                timeout = exc.kind.endswith("timeout")
                return _error(ex, 504 if timeout else 502, f"pod {pod.name!r}: {exc}; not retried (it may be running it)",
                              "upstream_timeout" if timeout else "upstream_error", decision)
            pod.prefill -= prefill
            prefill = 0
            status = answer.status
            k = (pod.name, status)
            self.statuses[k] = self.statuses.get(k, 0) + 1
            if status in c.retry_statuses:
                self._count(pod, "status_5xx" if status >= 500 else "retry_status")
                raise _Retry(f"answered {status}")
            await self._relay(ex, answer, pod, decision)
        except asyncio.CancelledError:  # the client hung up while the pod worked: cancel it there
            self._count(pod, "client_abort")
            raise
        finally:
            pod.in_flight -= 1
            pod.prefill -= prefill
            pod.probing = False  # a probe that ended neither way (the client left): the next one probes
            if answer is not None:
                answer.finish()  # read to its end: the connection stays warm; else closed (the pod stops)

    async def _relay(self, ex, answer: Answer, pod: PodState, decision: dict) -> None:
        out_headers = [(k, v) for k, v in answer.headers if (lk := k.lower()) not in _DROP and lk not in decision]
        out_headers += decision.items()
        streaming = answer.header("content-type").startswith("text/event-stream")
        length = answer.length
        cap = self.cfg.max_answer_bytes
        if not streaming and length is not None and length > cap:
            self._count(pod, "too_large")
            return _error(ex, 502, f"pod {pod.name!r}'s answer is {length} bytes, over proxy.max_answer_bytes ({cap})",
                          "answer_too_large", decision)
        if length is not None and length <= _WHOLE and not streaming:
            # a small answer (the common JSON one): read whole, written with its head in one send
            try:
                data = await answer.read(cap)
            except UpstreamError as exc:
                self._count(pod, "cut_midstream")
                log.warning("pod %r cut its answer: %s", pod.name, exc)
                return _error(ex, 502, f"pod {pod.name!r} cut its answer short ({exc})", "upstream_cut", decision)
            self._count(pod, "status_5xx" if answer.status >= 500 else "ok")
            return ex.whole(answer.status, out_headers, data)
        wt = self.cfg.client_write_timeout
        sent = 0
        try:
            async with asyncio.timeout(wt):
                await ex.start(answer.status, out_headers, length if not streaming else None)
            while True:
                try:
                    chunk = await answer.chunk()
                except UpstreamError as exc:
                    self._count(pod, "cut_midstream")
                    log.warning("pod %r cut its answer after %d bytes: %s", pod.name, sent, exc)
                    if streaming:  # the client learns it from the stream, not from a clean end
                        msg = f"pod {pod.name!r} cut the stream: {exc}"
                        async with asyncio.timeout(wt):
                            await ex.write(b"data: " + error_body(502, msg, None, "upstream_cut") + b"\n\n")
                            await ex.end()
                    else:
                        ex.abort()
                    return
                if not chunk:
                    break
                sent += len(chunk)
                if sent > cap and not streaming:
                    self._count(pod, "too_large")
                    log.warning("pod %r: answer over proxy.max_answer_bytes (%d); the client's connection is cut",
                                pod.name, cap)
                    return ex.abort()
                async with asyncio.timeout(wt):
                    await ex.write(chunk)
            async with asyncio.timeout(wt):
                await ex.end()
        except (ConnectionError, TimeoutError):
            self._count(pod, "client_abort")  # the client's doing: the pod's health is untouched
            return ex.abort()
        self._count(pod, "status_5xx" if answer.status >= 500 else "ok")

    # ---- status ----------------------------------------------------------------------------
    def down_pods(self) -> set[str]:
        now = time.monotonic()
        return {p.name for p in self.pods.values() if p.is_open(now)}

    def metric_lines(self) -> list[str]:
        from .metrics import proxy_metric_lines

        return proxy_metric_lines(self)


def _token_prompt(raw: bytes) -> tuple[_Body, object] | None:
    """The common completion body — a top-level ``"prompt"`` that is one flat array of token ids —
    read in one pass: the ids in C straight from the body, the rest (without the array) by
    msgspec. None for any other shape (then the whole body is decoded, which names any error).

    The array found by its key is cut out and replaced by a string only this process knows; the
    key was the top-level prompt exactly when msgspec then reads that string as the prompt (a
    ``"prompt"`` inside another value, or a second one, leaves another value there). Both parts are
    checked: the ids by the C reader (ints only), everything else by msgspec."""
    m = _PROMPT_AT.search(raw)
    if m is None or json_tokens is None:
        return None
    start = m.end() - 1
    stop = raw.find(b"]", start) + 1  # a flat array of ints holds no other ']'
    if not stop:
        return None
    ids = json_tokens(memoryview(raw)[start:stop])
    if ids is None or not len(ids):
        return None
    try:
        body = _BODY.decode(b"".join((raw[:start], _PLACEHOLDER, raw[stop:])))
    except (msgspec.DecodeError, RecursionError):
        return None
    if body.prompt != _PLACEHOLDER_RAW or not isinstance(body.model, str):
        return None
    return body, ids


#: where a body's ``"prompt": [`` is (its key, then the array's first byte)
_PROMPT_AT = re.compile(rb'"prompt"[ \t\r\n]*:[ \t\r\n]*\[')
_PLACEHOLDER = b'"kvevents-prompt-' + secrets.token_hex(12).encode() + b'"'
_PLACEHOLDER_RAW = msgspec.Raw(_PLACEHOLDER)

_PROMPT_ERROR = "prompt must be a non-empty string or array of token ids (ints in [0, 2^32)), or a batch of them"


def _prompt(p: msgspec.Raw, batch: bool):
    """A completion's prompt: token ids (read in C where built) or the text to tokenize; a batch
    of prompts is routed by its first one, split in C without decoding the rest."""
    if not len(p):
        raise ApiError(400, _PROMPT_ERROR, "prompt")
    lead = memoryview(p)[0]
    if lead == 0x22:  # '"': a text
        text = _ANY.decode(p)
        if not text:
            raise ApiError(400, _PROMPT_ERROR, "prompt")
        return text
    if lead != 0x5B:  # not '['
        raise ApiError(400, _PROMPT_ERROR, "prompt")
    if json_tokens is not None:
        ids = json_tokens(p)
        if ids is not None and len(ids):
            return ids
    items = _ITEMS.decode(p)
    if not items:
        raise ApiError(400, _PROMPT_ERROR, "prompt")
    if batch and memoryview(items[0])[0] in (0x22, 0x5B):
        return _prompt(items[0], batch=False)
    try:
        return _IDS.decode(p)  # no C reader, or ids it refused: msgspec names the bad one
    except msgspec.ValidationError as exc:
        raise ApiError(400, f"{_PROMPT_ERROR}: {exc}", "prompt") from None


def _raw_value(raw: msgspec.Raw) -> object:
    if not len(raw):
        return None
    return _ANY.decode(raw)  # already checked by the body's decode: cannot fail


def _error(ex, status: int, message: str, kind: str, headers: dict | None = None) -> None:
    ex.whole(status, [*JSON_HEADERS, *headers.items()] if headers else JSON_HEADERS,
             error_body(status, message, None, kind))
