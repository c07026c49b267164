"""The HTTP front's bounds (``[http]`` in the config file): read timeouts, the idle keep-alive
timeout, the connection cap with its reserve for health probes, the bytes held for unfinished
requests; their counters; and the logger given to aiohttp's protocol so that a malformed request
it refuses is counted by status and logged in one line, not with a traceback.

Enforced by :class:`kvservice.fasthttp.FastSite` on every connection (``docs/http-limits.md``).
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections import deque
from typing import Annotated

import msgspec
from msgspec import Meta

__all__ = ["Bounds", "HttpConfig", "LIMITS", "QuietProtocolLog", "auto_max_connections", "runner_kwargs"]

log = logging.getLogger("kvservice")

#: the limit names counted in ``kvservice_http_limit_hits_total{limit}``
LIMITS = ("header_timeout", "body_timeout", "idle_timeout", "connections", "buffered_bytes", "head_too_large",
          "body_too_large")


#: seconds, in (0, 1 day]
Timeout = Annotated[float, Meta(gt=0, le=86400)]


class HttpConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``[http]``: every connection's bounds (seconds, counts, bytes)."""

    #: seconds from a request's first byte to the end of its head (request line + headers)
    header_timeout: Timeout = 10.0
    #: seconds from the end of a request's head to the last byte of its body
    body_timeout: Timeout = 30.0
    #: seconds a keep-alive connection may sit with no request (also aiohttp's keepalive_timeout)
    idle_timeout: Timeout = 75.0
    #: open client connections at most; 0: from the descriptor limit (RLIMIT_NOFILE), see
    #: :func:`auto_max_connections`
    max_connections: Annotated[int, Meta(ge=0)] = 0
    #: connections admitted past ``max_connections`` for ``GET /healthz`` / ``/readyz`` only
    reserved_connections: Annotated[int, Meta(ge=1)] = 8
    #: bytes held at once, all connections together, for requests not yet fully received
    max_buffered_bytes: Annotated[int, Meta(ge=65536)] = 128 << 20
    #: the longest request head (request line + headers) read
    max_head_bytes: Annotated[int, Meta(ge=1024, le=1 << 20)] = 16384

    def connection_cap(self) -> int:
        return self.max_connections or auto_max_connections(self.reserved_connections)


#: the sweep's phases of a connection: the limit it is held to (an HttpConfig attribute)
_PHASES = ("idle_timeout", "header_timeout", "body_timeout", "idle_timeout", "idle_timeout")


class Bounds:
    """The open connections (:class:`kvservice.fasthttp.FastHttp`) of one site and their bounds:
    the connection cap and its reserve (:meth:`admit`), the bytes held for unfinished requests
    (``buffered``, kept by the connections), and the timeouts, kept by :meth:`sweep`, run a few
    times per shortest timeout: a connection whose phase and progress have not changed for its
    phase's timeout is expired (``FastHttp.expire``). Event-loop thread only."""

    def __init__(self, limits: HttpConfig) -> None:
        self.limits = limits
        self.conns: set = set()
        self.reserve: deque = deque()  #: connections admitted past the cap, oldest first
        self.limit_hits = dict.fromkeys(LIMITS, 0)
        self.buffered = 0  #: bytes held for unfinished requests, all connections
        self.max_buffered = limits.max_buffered_bytes
        self.max_head = limits.max_head_bytes
        self.max_conns = limits.connection_cap()
        self.every = min(1.0, max(0.01, min(limits.header_timeout, limits.body_timeout, limits.idle_timeout) / 4))
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tick: asyncio.TimerHandle | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._tick = loop.call_later(self.every, self.sweep)

    def stop(self) -> None:
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None

    def admit(self, conn) -> None:
        """A new connection: within the cap, or one of the reserve (the oldest reserve dropped)."""
        if len(self.conns) - len(self.reserve) >= self.max_conns:
            conn.reserve = 1
            self.reserve.append(conn)
            if len(self.reserve) > self.limits.reserved_connections:
                old = self.reserve.popleft()
                old.reserve = 0
                self.limit_hits["connections"] += 1
                if old.transport is not None:
                    old.transport.close()
        self.conns.add(conn)

    def drop(self, conn) -> None:
        """A connection closed."""
        self.conns.discard(conn)
        if conn.reserve:
            try:
                self.reserve.remove(conn)
            except ValueError:
                pass

    def sweep(self) -> None:
        """Expire the connections past a timeout: a phase (0 idle, 1 head, 2 body, 3 opaque, 4
        answers unread) and its progress unchanged for that phase's seconds."""
        now = self._loop.time()
        lim = self.limits
        try:
            for c in list(self.conns):
                t = c.transport
                if c.task is not None:
                    continue  # a proxied request in flight: the proxy's own timeouts bound it
                if c.opaque:
                    key = (3, c.nin)
                elif c.buf:
                    key = (2 if c.need else 1, c.nreq)
                elif t is not None and t.get_write_buffer_size():  # answers the client does not read
                    key = (4, c.nreq, t.get_write_buffer_size())
                elif c.proto is not None:
                    continue  # between requests: aiohttp's keep-alive timeout
                else:  # before the first request: its head is late
                    key = (0 if c.nreq else 1, c.nreq)
                if key != c.seen:
                    c.seen = key
                    c.since = now
                    continue
                limit = _PHASES[key[0]]
                if now - c.since >= getattr(lim, limit):
                    c.expire(limit)
        finally:
            self._tick = self._loop.call_later(self.every, self.sweep)


def runner_kwargs(limits: HttpConfig, metrics) -> dict:
    """web.AppRunner's keyword arguments for aiohttp's side of the connections: the idle
    keep-alive timeout, and the logger that counts what its parser refuses."""
    return {"keepalive_timeout": limits.idle_timeout, "logger": QuietProtocolLog(metrics)}


def auto_max_connections(reserve: int) -> int:
    """The connection cap for ``max_connections = 0``: the soft descriptor limit less what the
    process keeps for itself (its files, ZeroMQ sockets, the proxy's upstream connections: an
    eighth of the limit, at least 128) and less the health probes' reserve; at least 16."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(16, soft - max(128, soft // 8) - reserve)


class QuietProtocolLog:
    """The ``logger`` of aiohttp's RequestHandler: a request aiohttp's parser refuses (a
    ``HttpProcessingError``: malformed head, bad method, too long a line...) is counted in the
    request metrics under route ``malformed`` with its status and logged in one line; anything
    else goes to the service's logger unchanged (with its traceback)."""

    def __init__(self, metrics) -> None:
        self.metrics = metrics

    def _refused(self, kw: dict) -> bool:
        from aiohttp.http_exceptions import HttpProcessingError

        exc = kw.get("exc_info")
        if not isinstance(exc, HttpProcessingError):
            return False
        status = exc.code if isinstance(exc.code, int) and 400 <= exc.code < 600 else 400
        self.metrics.observe("malformed", "-", status, 0.0)
        log.debug("malformed request refused (%d): %s", status, exc.message)
        return True

    def exception(self, msg, *args, **kw) -> None:
        if not self._refused(kw):
            log.exception(msg, *args, **kw)

    def debug(self, msg, *args, **kw) -> None:
        if not self._refused(kw):
            log.debug(msg, *args, **kw)

    def __getattr__(self, name):  # warning, info, error, isEnabledFor...: the service's logger
        return getattr(log, name)
