"""A real nats-server with JetStream for the event-plane tests: a free loopback port, a fresh
store directory, torn down after; ``restart()`` keeps the port and the store (file storage)."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

import pytest

from kvevents.transport.nats.broker import find_nats_server
from tests.pubsub_helpers import free_tcp_port

NATS_SERVER = find_nats_server()


class NatsServer:
    def __init__(self, store: Path, config: str | None = None, users: list[dict] | None = None) -> None:
        from kvevents.transport.nats.permissions import auth_config

        self.store = store
        self.config = config  #: nats-server configuration text (e.g. ``max_pending: 1048576``), if any
        self.users = {u["user"]: u["password"] for u in users or []}
        if users:  #: users with per-subject permissions (kvevents.transport.nats.permissions)
            self.config = (config or "") + "\n" + auth_config(users)
        self.port = free_tcp_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log = store.parent / f"nats-{self.port}.log"

    def start(self, deadline: float = 15.0) -> None:
        args = [NATS_SERVER, "-js", "-a", "127.0.0.1", "-p", str(self.port), "-sd", str(self.store)]
        if self.config is not None:
            conf = self.store.parent / f"nats-{self.port}.conf"
            conf.write_text(self.config)
            args += ["-c", str(conf)]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=open(self.log, "ab"))
        end = time.monotonic() + deadline
        while time.monotonic() < end:  # ready once it accepts a connection and answers PING
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited: {self.log.read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.recv(4096)  # INFO
                    s.sendall(b"CONNECT {}\r\nPING\r\n")
                    answer = s.recv(4096)
                    if b"PONG" in answer or (self.users and b"Authorization Violation" in answer):
                        return
            except OSError:
                time.sleep(0.02)  # not listening yet: a short back-off between connection attempts
        raise RuntimeError("nats-server did not become ready")

    def url_as(self, user: str) -> str:
        """The server's URL with a user's credentials in it."""
        return f"nats://{user}:{self.users[user]}@127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture
def nats_server(tmp_path):
    if NATS_SERVER is None:
        pytest.fail("nats-server not found: install Debian's nats-server (the README's test command does)")
    srv = NatsServer(tmp_path / "js")
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def on_jetstream(url: str, fn):
    """``await fn(jetstream)`` on a short-lived client of ``url``; its result."""
    import asyncio

    import nats

    async def go():
        nc = await nats.connect(url)
        try:
            return await fn(nc.jetstream())
        finally:
            await nc.close()
    return asyncio.run(go())


def stream_state(url: str, stream: str = "KVEVENTS"):
    """(messages, last seq) of the stream, read with a short-lived client."""
    async def state(js):
        info = await js.stream_info(stream)
        return info.state.messages, info.state.last_seq
    return on_jetstream(url, state)


def wait_for(cond, what: str, deadline: float = 30.0, pump=None):
    """Poll ``cond()`` (running ``pump()`` between tries) until it is truthy; fail naming ``what``."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        if pump is not None:
            pump()
        else:
            time.sleep(0.02)  # polling observable state (stream info, a file): the interval of the poll
    raise AssertionError(f"timed out waiting for {what}")


def read_all(url: str, durable: str = "check", health: dict | None = None, **kw) -> list:
    """Every delivery the stream holds now, through a fresh JetStreamSource (its per-pod health
    into ``health`` if given)."""
    from kvevents.transport.nats.source import JetStreamSource

    _, last = stream_state(url)
    out = []
    with JetStreamSource(url, durable=durable, **kw) as src:
        wait_for(lambda: src.position >= last, f"reading the stream up to seq {last}", pump=lambda: out.extend(src.poll(50)))
        out.extend(src.poll(0))
        stats = src.stats()
        if health is not None:
            health.update(src.health())
    return out, stats


def forge(url: str, subject: str, headers: dict | None, body: bytes = b"", timeout: float = 5) -> dict:
    """Publish one message as an attacker would (a plain client, our headers or none); the ack as a dict."""
    import asyncio
    import json

    import nats

    async def go():
        nc = await nats.connect(url)
        try:
            reply = await nc.request(subject, body, timeout=timeout, headers=headers)
            return json.loads(reply.data)
        finally:
            await nc.close()
    return asyncio.run(go())
