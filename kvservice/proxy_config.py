"""The proxy's settings: the ``[proxy]`` section of the service's config file.

Every key is optional; the defaults are the ones a deployment in front of vLLM would pick. Two
older keys of ``[api]`` still apply to the proxy: ``api.upstream_timeout`` (seconds to wait for
an answer's first byte, and then for each next piece of it) and ``api.down_for`` (seconds a
pod's circuit breaker stays open). See ``docs/proxy.md`` for what each one does.
"""

from __future__ import annotations

import re

import msgspec

from kvevents.errors import ConfigError

__all__ = ["ProxyConfig", "proxy_section"]


class ProxyConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # ---- picking a pod -------------------------------------------------------------------------
    #: "least_loaded" or "power_of_two": how a request without a KV signal picks among pods
    balance: str = "least_loaded"
    #: a request in flight on a pod counts as this many tokens of work when comparing pods
    request_cost_tokens: int = 256
    #: how much a cached prefix token is worth against a token of in-flight work (cost =
    #: uncached prompt tokens * kv_weight + in-flight prefill tokens + in-flight requests *
    #: request_cost_tokens)
    kv_weight: float = 1.0
    #: a request header whose value pins a session to the pod that served it first ("" = off)
    affinity_header: str = ""
    #: the most sessions remembered (least recently used forgotten first)
    affinity_max_sessions: int = 100_000
    #: a pinned pod is left when its in-flight requests exceed the least-loaded pod's by this many
    affinity_max_imbalance: int = 8
    # ---- retries -------------------------------------------------------------------------------
    #: extra attempts on other pods, made only where the upstream cannot have started the request
    max_retries: int = 2
    #: first back-off before a retry, seconds (doubled per retry, full jitter)
    retry_backoff: float = 0.005
    retry_backoff_max: float = 0.25
    #: retries allowed per proxied request, on average (a token bucket that each request fills)
    retry_budget_ratio: float = 0.2
    #: retries the bucket holds when full (and at start)
    retry_budget_burst: int = 20
    #: upstream statuses that mean "not started, try elsewhere" (e.g. [503] for an engine that
    #: sheds load with 503 before running anything); the default retries none
    retry_statuses: list[int] = msgspec.field(default_factory=list)
    # ---- circuit breaker -----------------------------------------------------------------------
    #: consecutive failures (refused, timed out, 5xx, cut mid-answer) that open a pod's breaker
    breaker_failures: int = 3
    # ---- timeouts ------------------------------------------------------------------------------
    #: seconds to open a TCP connection to a pod
    connect_timeout: float = 3.0
    #: seconds for a whole answer, streamed or not (0: no limit)
    total_timeout: float = 1800.0
    #: seconds a client may leave an answer unread before it is dropped as the client's abort
    client_write_timeout: float = 30.0
    # ---- admission -----------------------------------------------------------------------------
    #: requests forwarded at once (0: no limit)
    max_concurrency: int = 1024
    #: requests waiting for a slot beyond max_concurrency; beyond that they are refused
    max_queue: int = 1024
    #: seconds a request waits in the queue before it is refused
    queue_timeout: float = 30.0
    #: the status of a refused request: 503 or 429 (both with Retry-After)
    overload_status: int = 503
    #: the Retry-After of a refused request, seconds
    retry_after: int = 1
    # ---- answers -------------------------------------------------------------------------------
    #: the largest non-streamed answer passed on, bytes (a larger one: a 502 naming this key)
    max_answer_bytes: int = 64 << 20
    #: idle upstream connections are kept this long (below uvicorn's 5 s keep-alive, so a pod
    #: never closes one just as a request goes out on it)
    keepalive_timeout: float = 4.0

    def validate(self) -> "ProxyConfig":
        if self.balance not in ("least_loaded", "power_of_two"):
            _bad("balance", "must be least_loaded or power_of_two", self.balance)
        for k in ("request_cost_tokens", "max_retries", "retry_budget_burst", "max_concurrency", "max_queue"):
            if getattr(self, k) < 0:
                _bad(k, "must be >= 0", getattr(self, k))
        for k in ("breaker_failures", "affinity_max_sessions", "max_answer_bytes", "retry_after"):
            if getattr(self, k) < 1:
                _bad(k, "must be >= 1", getattr(self, k))
        for k in ("kv_weight", "retry_backoff", "retry_backoff_max", "retry_budget_ratio", "total_timeout",
                  "affinity_max_imbalance"):
            v = getattr(self, k)
            if not v >= 0 or v == float("inf"):
                _bad(k, "must be a finite number >= 0", v)
        for k in ("connect_timeout", "client_write_timeout", "queue_timeout", "keepalive_timeout"):
            v = getattr(self, k)
            if not v > 0 or v == float("inf"):
                _bad(k, "must be a finite number > 0", v)
        if self.overload_status not in (429, 503):
            _bad("overload_status", "must be 429 or 503", self.overload_status)
        for s in self.retry_statuses:
            if not 400 <= s <= 599:
                _bad("retry_statuses", "must list HTTP error statuses (400-599)", s)
        if self.affinity_header and not re.fullmatch(r"[A-Za-z0-9-]+", self.affinity_header):
            _bad("affinity_header", "must be a header name (letters, digits, '-')", self.affinity_header)
        return self


def _bad(key: str, what: str, got: object):
    raise ConfigError(f"proxy.{key} {what}, got {got!r}")


_AT = re.compile(r" - at `\$\.?([^`\[]*)")


def proxy_section(data: object) -> ProxyConfig:
    """The ``[proxy]`` table as a validated :class:`ProxyConfig`; ConfigError naming the key."""
    if not isinstance(data, dict):
        raise ConfigError(f"proxy must be a table, got {type(data).__name__}")
    try:
        cfg = msgspec.convert(data, ProxyConfig)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        unknown = re.search(r"unknown field `([^`]*)`", msg)
        if unknown:
            known = ", ".join(ProxyConfig.__struct_fields__)
            raise ConfigError(f"proxy.{unknown.group(1)}: unknown key (known: {known})") from None
        m = _AT.search(msg)
        key = m.group(1) if m else "?"
        raise ConfigError(f"proxy.{key}: {msg.split(' - at ')[0]}") from None
    return cfg.validate()
