"""The HTTP front's bounds (``[http]`` in the config file): read timeouts, the idle keep-alive
timeout, the connection cap with its reserve for health probes, the bytes held for unfinished
requests; their counters; and the logger given to aiohttp's protocol so that a malformed request
it refuses is counted by status and logged in one line, not with a traceback.

Enforced by :class:`kvservice.fasthttp.FastSite` on every connection (``docs/http-limits.md``).
"""

from __future__ import annotations

import logging
import resource
from dataclasses import dataclass

from kvevents.errors import ConfigError

__all__ = ["HttpConfig", "LIMITS", "QuietProtocolLog", "auto_max_connections"]

log = logging.getLogger("kvservice")

#: the limit names counted in ``kvservice_http_limit_hits_total{limit}``
LIMITS = ("header_timeout", "body_timeout", "idle_timeout", "connections", "buffered_bytes", "head_too_large",
          "body_too_large")


@dataclass(slots=True)
class HttpConfig:
    """``[http]``: every connection's bounds (seconds, counts, bytes)."""

    #: seconds from a request's first byte to the end of its head (request line + headers)
    header_timeout: float = 10.0
    #: seconds from the end of a request's head to the last byte of its body
    body_timeout: float = 30.0
    #: seconds a keep-alive connection may sit with no request (also aiohttp's keepalive_timeout)
    idle_timeout: float = 75.0
    #: open client connections at most; 0: from the descriptor limit (RLIMIT_NOFILE), see
    #: :func:`auto_max_connections`
    max_connections: int = 0
    #: connections admitted past ``max_connections`` for ``GET /healthz`` / ``/readyz`` only
    reserved_connections: int = 8
    #: bytes held at once, all connections together, for requests not yet fully received
    max_buffered_bytes: int = 128 << 20
    #: the longest request head (request line + headers) read
    max_head_bytes: int = 16384

    def validate(self) -> "HttpConfig":
        for k in ("header_timeout", "body_timeout", "idle_timeout"):
            v = getattr(self, k)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v <= 86400:
                raise ConfigError(f"http.{k} must be seconds in (0, 86400], got {v!r}")
        for k, low in (("max_connections", 0), ("reserved_connections", 1), ("max_buffered_bytes", 65536),
                       ("max_head_bytes", 1024)):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ConfigError(f"http.{k} must be an int >= {low}, got {v!r}")
        if self.max_head_bytes > 1 << 20:
            raise ConfigError(f"http.max_head_bytes must be at most 1048576, got {self.max_head_bytes!r}")
        return self

    def connection_cap(self) -> int:
        return self.max_connections or auto_max_connections(self.reserved_connections)


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
