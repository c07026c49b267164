"""``kvevents demo --serve``: the router service as a proxy in front of SIMULATED engines, with a
load generator sending real HTTP requests through it.

N :class:`kvdemo.engine_http.EngineServer` (simulated engines; vLLM's default topic ``""``,
ZeroMQ PUB and replay sockets on ipc://) and one ``kvservice`` in ``--proxy`` mode that
knows them from a generated config. The load generator sends the demo's shared-prefix,
multi-turn workload as ``/v1/completions`` requests (token-id prompts, some streamed) to the
router, then prints where they went and what the router's index matched.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from .engine_http import EngineServer
from .nodes import EngineSizing, Node, make_node

__all__ = ["SimEngineFleet", "free_tcp_ports", "run_serve"]


def free_tcp_ports(n: int) -> list[int]:
    """``n`` distinct free loopback TCP ports (bound, then released)."""
    socks, ports = [], []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


@dataclass(slots=True)
class SimPod:
    name: str
    node: Node
    server: EngineServer
    endpoint: str
    replay_endpoint: str
    url: str = ""


@dataclass
class SimEngineFleet:
    """Simulated engines with HTTP servers, on an event loop thread of their own."""

    engines: int = 3
    model: str = "demo-model"
    topic: str = ""  #: vLLM's default
    sizing: EngineSizing = field(default_factory=EngineSizing)
    tokenizer: str | None = None
    root: Path | None = None

    def __post_init__(self) -> None:
        self._own_root = self.root is None
        self.root = Path(tempfile.mkdtemp(prefix="kvsim-")) if self.root is None else self.root
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="sim-engines-http", daemon=True)
        self.pods: list[SimPod] = []

    def start(self) -> "SimEngineFleet":
        self._thread.start()
        for i in range(self.engines):
            name = f"engine-{i}"
            ep, rep = f"ipc://{self.root}/{name}.pub", f"ipc://{self.root}/{name}.replay"
            node = make_node(name, self.root, self.sizing, model=self.model, topic=self.topic, endpoint=ep,
                             replay_endpoint=rep)
            server = EngineServer(node, self.model, tokenizer=self.tokenizer,
                                  max_tokens_limit=self.sizing.block_size * 2)
            pod = SimPod(name, node, server, ep, rep)
            pod.url = self.call(server.start())
            self.pods.append(pod)
        return self

    def call(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def kill(self, name: str) -> None:
        """Stop one engine's HTTP server (connections refused from now on), as a crashed pod."""
        pod = next(p for p in self.pods if p.name == name)
        self.call(pod.server.stop())

    def config(self, *, proxy: bool = True, port: int = 0, block_size: int | None = None) -> dict:
        """A service config (the dict a TOML file would hold) for these engines."""
        return {"router": {"model": self.model, "block_size": block_size or self.sizing.block_size,
                           "offload_chunk_blocks": {"CPU": self.sizing.offload_block_size // self.sizing.block_size,
                                                    "STORAGE": self.sizing.offload_block_size // self.sizing.block_size}},
                "api": {"port": port, "proxy": proxy, "down_for": 30.0},
                "pods": [{"name": p.name, "endpoint": p.endpoint, "replay_endpoint": p.replay_endpoint,
                          "http": p.url} for p in self.pods]}

    def close(self) -> None:
        for p in self.pods:
            try:
                self.call(p.server.stop(), timeout=10)
            except Exception:  # noqa: BLE001 — closing what is left; the others still get closed
                pass
            if p.node.publisher is not None:
                p.node.publisher.shutdown(timeout=0.5)
            p.node.shutdown_engine()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)


def run_serve(duration: float, engines: int, seed: int, out: TextIO, *, concurrency: int = 8,
              stream_every: int = 4) -> int:
    """The ``demo --serve`` run; exit code 0 when every request was answered by an engine."""
    from .loadgen import drive

    fleet = SimEngineFleet(engines=engines).start()
    try:
        return drive(fleet, duration, seed, out, concurrency=concurrency, stream_every=stream_every)
    finally:
        fleet.close()
