"""A SIMULATED engine behind a small OpenAI-compatible HTTP server.

This is not an inference engine: :class:`manager.engine_sim.SimEngine` schedules requests,
fills and evicts a simulated GPU prefix cache, offloads through the real tiered manager and
publishes real KV events over ZeroMQ, but the "model" writes made-up tokens. It speaks the
parts of vLLM's HTTP API a router needs — ``POST /v1/completions``, ``POST
/v1/chat/completions`` (both with ``stream: true`` as server-sent events), ``POST /tokenize``,
``GET /health``, ``GET /v1/models`` — so the router service can sit in front of it as it
would in front of ``vllm serve``. The contract with a real vLLM is its wire format (the
conformance tests) and this HTTP API.

Tokens: a local Hugging Face tokenizer when one is given (``tokenizer=PATH``), else a toy
word tokenizer (``crc32(word) % vocab``; chats rendered as ``<|role|>\\ncontent\\n`` lines).
Either way ``/tokenize`` answers with exactly the ids the engine schedules, which is what a
router without a local tokenizer asks for.

Threads: one engine thread owns the SimEngine (adds requests, steps, sees them finish); the
HTTP handlers run on an asyncio loop and hand requests over through a queue.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import re
import threading
import time
import zlib
from dataclasses import dataclass, field

import msgspec
from aiohttp import web

from .nodes import Node

__all__ = ["EngineServer", "SimTokenizer"]

_WORD = re.compile(r"\S+")


class SimTokenizer:
    """The toy tokenizer: a word is ``crc32(word) % vocab``."""

    def __init__(self, vocab: int = 32000) -> None:
        self.vocab = vocab

    def encode(self, text: str) -> list[int]:
        return [zlib.crc32(w.encode()) % self.vocab for w in _WORD.findall(text)]

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        parts = [f"<|{m.get('role', 'user')}|>\n{_content(m.get('content'))}\n" for m in messages]
        if add_generation_prompt:
            parts.append("<|assistant|>\n")
        return "".join(parts)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.encode(self.render_chat(messages, add_generation_prompt))


class _HFTokenizer:
    """A local Hugging Face tokenizer, through the router service's own loader (same ids)."""

    def __init__(self, path: str) -> None:
        from kvservice.tokens import LocalTokenizer

        self.tok = LocalTokenizer(path)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode_sync(prompt=text)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.tok.encode_sync(messages=messages, add_generation_prompt=add_generation_prompt)


def _content(c: object) -> str:
    if isinstance(c, list):  # OpenAI content parts: keep the text ones
        return "".join(p.get("text", "") for p in c if isinstance(p, dict))
    return "" if c is None else str(c)


@dataclass(slots=True)
class _Job:
    req_id: str
    tokens: list[int]
    max_tokens: int
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    added: float = field(default_factory=time.monotonic)


class _BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineServer:
    """Serve ``node``'s SimEngine over HTTP on ``host:port`` (0: a free port; see :attr:`url`)."""

    def __init__(self, node: Node, model: str, *, host: str = "127.0.0.1", port: int = 0,
                 tokenizer: str | None = None, max_tokens_limit: int = 64) -> None:
        self.node = node
        self.engine = node.engine
        self.model = model
        self.host, self.port = host, port
        self.tok = _HFTokenizer(tokenizer) if tokenizer else SimTokenizer()
        self.max_tokens_limit = max_tokens_limit
        self.requests = 0  #: completions served
        self._ids = itertools.count()
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._engine_thread = threading.Thread(target=self._engine_loop, name=f"sim-engine-{node.name}", daemon=True)
        self._runner: web.AppRunner | None = None
        self.url: str | None = None

    # ---- the engine thread -----------------------------------------------------------------
    def _engine_loop(self) -> None:
        eng = self.engine
        live: dict[str, _Job] = {}
        done: list[str] = []
        eng.on_request_finished.append(done.append)
        try:
            while not self._stop.is_set():
                try:
                    job = self._q.get(timeout=0.0 if eng.has_work() else 0.05)
                except queue.Empty:
                    job = None
                while job is not None:
                    try:
                        eng.add_request(job.req_id, job.tokens, max_new_tokens=job.max_tokens)
                        live[job.req_id] = job
                    except ValueError as exc:
                        job.loop.call_soon_threadsafe(_settle, job.future, exc)
                    try:
                        job = self._q.get_nowait()
                    except queue.Empty:
                        job = None
                if eng.has_work():
                    eng.step()
                    for rid in done:
                        j = live.pop(rid, None)
                        if j is not None:
                            j.loop.call_soon_threadsafe(_settle, j.future, None)
                    done.clear()
        finally:
            eng.on_request_finished.remove(done.append)

    async def _run(self, tokens: list[int], max_tokens: int) -> None:
        loop = asyncio.get_running_loop()
        job = _Job(f"http-{next(self._ids)}", tokens, max_tokens, loop, loop.create_future())
        self._q.put(job)
        await job.future

    # ---- HTTP --------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=8 << 20)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        return app

    async def start(self) -> str:
        self._engine_thread.start()
        self._runner = web.AppRunner(self.app(), access_log=None, shutdown_timeout=0.2)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self.url = f"http://{self.host}:{self.port}"
        return self.url

    async def stop(self) -> None:
        """Stop serving HTTP (connections are refused from here on) and stop the engine thread."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self._stop.set()
        if self._engine_thread.is_alive():
            await asyncio.get_running_loop().run_in_executor(None, self._engine_thread.join, 5.0)

    async def _body(self, request: web.Request) -> dict:
        try:
            body = msgspec.json.decode(await request.read())
        except msgspec.DecodeError as exc:
            raise _BadRequest(f"invalid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise _BadRequest("the body must be a JSON object")
        if body.get("model") not in (None, self.model):
            raise _BadRequest(f"model {body.get('model')!r} is not served here (this engine serves {self.model!r})",
                              "model")
        mt = body.get("max_tokens", body.get("max_completion_tokens", 16))
        if not isinstance(mt, int) or isinstance(mt, bool) or mt < 1:
            raise _BadRequest("max_tokens must be a positive integer", "max_tokens")
        body["max_tokens"] = min(mt, self.max_tokens_limit)
        return body

    @staticmethod
    def _error(exc: _BadRequest) -> web.Response:
        return web.json_response({"object": "error", "message": str(exc), "type": "BadRequestError",
                                  "param": exc.param, "code": 400}, status=400)

    def _prompt_tokens(self, body: dict) -> list[int]:
        p = body.get("prompt")
        if isinstance(p, list) and p and all(isinstance(t, int) for t in p):
            return p
        if isinstance(p, list) and len(p) == 1:
            p = p[0]
        if isinstance(p, list) and p and all(isinstance(t, int) for t in p):
            return p
        if not isinstance(p, str) or not p:
            raise _BadRequest("prompt must be a non-empty string or a list of token ids", "prompt")
        return self.tok.encode(p)

    def _chat_tokens(self, body: dict) -> list[int]:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            raise _BadRequest("messages must be a non-empty list of objects", "messages")
        return self.tok.encode_chat(msgs, bool(body.get("add_generation_prompt", True)))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, chat=True)

    async def _complete(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await self._body(request)
            tokens = self._chat_tokens(body) if chat else self._prompt_tokens(body)
            if not tokens:
                raise _BadRequest("the prompt has no tokens", "messages" if chat else "prompt")
            n = body["max_tokens"]
            await self._run(tokens, n)
        except _BadRequest as exc:
            return self._error(exc)
        except ValueError as exc:  # the engine refused it (too long for its GPU blocks)
            return self._error(_BadRequest(str(exc), "prompt"))
        self.requests += 1
        words = [f" tok{(tokens[-1] * 31 + i) % 997}" for i in range(n)]
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{self.node.name}-{self.requests}"
        created = int(time.time())
        usage = {"prompt_tokens": len(tokens), "completion_tokens": n, "total_tokens": len(tokens) + n}
        if not body.get("stream"):
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": "".join(words)},
                          "finish_reason": "length"}
            else:
                choice = {"index": 0, "text": "".join(words), "logprobs": None, "finish_reason": "length"}
            return web.json_response({"id": rid, "object": "chat.completion" if chat else "text_completion",
                                      "created": created, "model": self.model, "choices": [choice], "usage": usage})
        resp = web.StreamResponse(headers={"content-type": "text/event-stream", "cache-control": "no-cache"})
        await resp.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"
        for i, w in enumerate(words):
            last = i == len(words) - 1
            if chat:
                delta = {"role": "assistant", "content": w} if i == 0 else {"content": w}
                choice = {"index": 0, "delta": delta, "finish_reason": "length" if last else None}
            else:
                choice = {"index": 0, "text": w, "logprobs": None, "finish_reason": "length" if last else None}
            chunk = {"id": rid, "object": obj, "created": created, "model": self.model, "choices": [choice]}
            await resp.write(b"data: " + msgspec.json.encode(chunk) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            body = await self._body(request)
            tokens = self._chat_tokens(body) if "messages" in body else self._prompt_tokens(body)
        except _BadRequest as exc:
            return self._error(exc)
        return web.json_response({"tokens": tokens, "count": len(tokens),
                                  "max_model_len": self.engine.gpu.num_blocks * self.engine.block_size})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model",
                                                              "owned_by": "kvevents-sim"}]})


def _settle(fut: asyncio.Future, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


def main(argv: list[str] | None = None) -> int:
    """``python -m kvdemo.engine_http MODEL --port P --kv-events-config JSON``: one simulated engine,
    started the way ``vllm serve MODEL --port P --kv-events-config JSON`` starts a real one.
    SIGTERM/SIGINT stop it (exit 0)."""
    import argparse
    import json
    import shutil
    import signal
    import sys
    import tempfile
    from pathlib import Path

    from kvevents.config import EventPublisherFactory, KVEventsConfig
    from kvevents.errors import KVEventsError

    from .nodes import EngineSizing, make_node

    ap = argparse.ArgumentParser(prog="python -m kvdemo.engine_http",
                                 description="A SIMULATED engine (no model runs) with vLLM's KV events and an "
                                             "OpenAI-compatible HTTP API, standing in for `vllm serve`.")
    ap.add_argument("model")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--kv-events-config", default="{}", metavar="JSON", help="vLLM's KVEventsConfig as JSON")
    ap.add_argument("--tokenizer", help="a local Hugging Face tokenizer (else the toy word tokenizer)")
    ap.add_argument("--name", default="engine", help="name of the engine (its fs tier directory)")
    args = ap.parse_args(argv)
    try:
        kv = KVEventsConfig.from_dict(json.loads(args.kv_events_config))
        pub = EventPublisherFactory.create(kv) if kv.enable_kv_cache_events else None
    except (ValueError, KVEventsError) as exc:
        print(f"engine_http: error: --kv-events-config: {exc}", file=sys.stderr)
        return 2
    root = Path(tempfile.mkdtemp(prefix="kvsim-engine-"))
    node = make_node(args.name, root, EngineSizing(), model=args.model, publish=pub is not None, publisher=pub,
                     endpoint=kv.endpoint, replay_endpoint=kv.replay_endpoint, topic=kv.topic)
    server = EngineServer(node, args.model, host=args.host, port=args.port, tokenizer=args.tokenizer)

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        url = await server.start()
        print(f"simulated engine {args.name}: serving {args.model} on {url} (KV events: "
              f"{kv.endpoint if pub is not None else 'off'})", flush=True)
        await stop.wait()
        await server.stop()

    try:
        asyncio.run(run())
    finally:
        if pub is not None:
            pub.shutdown(timeout=0.5)
        node.shutdown_engine()
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
