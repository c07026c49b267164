"""Helpers for the service tests: run the router service in a thread or a subprocess, talk HTTP."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

from kvevents import BlockStored, KVEventBatch

from kvservice.cli import serve

MODEL = "m"


class Http:
    def __init__(self, base: str, token: str | None = None) -> None:
        self.base = base.rstrip("/")
        self.token = token

    def call(self, method: str, path: str, body: object = None, *, raw: bytes | None = None,
             headers: dict | None = None, timeout: float = 10.0) -> tuple[int, dict, bytes]:
        h = {"content-type": "application/json"}
        if self.token:
            h["Authorization"] = f"Bearer {self.token}"
        h.update(headers or {})
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.base + path, data=data, method=method, headers=h)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, dict(r.headers), r.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read()

    def json(self, method: str, path: str, body: object = None, **kw) -> tuple[int, object]:
        status, headers, data = self.call(method, path, body, **kw)
        return status, json.loads(data) if data else None

    def get(self, path: str, **kw):
        return self.json("GET", path, **kw)

    def post(self, path: str, body: object, **kw):
        return self.json("POST", path, body, **kw)


def wait_for(pred, timeout: float = 10.0, what="condition"):
    """Poll ``pred`` (no fixed sleeps as synchronisation: the deadline only bounds a failure).
    ``what`` names the condition: a string, or a callable giving it at the failure (state then)."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what() if callable(what) else what}")
        time.sleep(0.01)


class InProcessService:
    """``kvservice.cli.serve`` on an event loop in a background thread."""

    def __init__(self, cfg, token: str | None = None, *, loop_factory=asyncio.new_event_loop) -> None:
        self.cfg = cfg
        self.loop = loop_factory()
        self.started = threading.Event()
        self.error: BaseException | None = None
        self.url: str | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        if not self.started.wait(20):
            raise AssertionError("service did not start")
        if self.error is not None:
            raise self.error
        self.http = Http(self.url, token)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.stop_ev = asyncio.Event()

        def announce(line: str) -> None:
            self.url = line.split()[4]
            self.started.set()

        try:
            self.loop.run_until_complete(serve(self.cfg, self.stop_ev, announce=announce))
        except BaseException as exc:  # noqa: BLE001 — handed to the test thread
            self.error = exc
        finally:
            self.started.set()

    @property
    def app_state(self):
        return self

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop_ev.set)
        self.thread.join(10)
        self.loop.close()


def start_subprocess(args: list[str]) -> tuple[subprocess.Popen, str]:
    """``python -m kvservice ARGS --port 0``; returns the process and its base URL."""
    p = subprocess.Popen([sys.executable, "-m", "kvservice", "--port", "0", *args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if not line.startswith("kvevents router: listening on"):
        p.kill()
        raise AssertionError(f"service did not start: {line!r} {p.stderr.read()[-2000:]}")
    return p, line.split()[4]


def stored(tokens: list[int], hashes: list[int], parent: int | None = None, medium: str = "GPU") -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=[BlockStored(block_hashes=hashes, parent_block_hash=parent,
                                                            token_ids=tokens, block_size=16, lora_id=None,
                                                            medium=medium, lora_name=None)])
