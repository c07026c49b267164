"""The proxy's settings: the ``[proxy]`` section of the service's config file.

Every key is optional; the defaults are the ones a deployment in front of vLLM would pick. Two
older keys of ``[api]`` still apply to the proxy: ``api.upstream_timeout`` (seconds to wait for
an answer's first byte, and then for each next piece of it) and ``api.down_for`` (seconds a
pod's circuit breaker stays open). See ``docs/proxy.md`` for what each one does.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from kvevents.settings import KeyCheck

__all__ = ["ProxyConfig"]

Count = Annotated[int, Meta(ge=0)]  #: 0 or more
Positive = Annotated[int, Meta(ge=1)]
NonNegative = Annotated[float, Meta(ge=0)]  #: also refuses NaN; inf: __post_init__
Seconds = Annotated[float, Meta(gt=0)]


class ProxyConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    # ---- picking a pod -------------------------------------------------------------------------
    #: "least_loaded" or "power_of_two": how a request without a KV signal picks among pods
    balance: Literal["least_loaded", "power_of_two"] = "least_loaded"
    #: a request in flight on a pod counts as this many tokens of work when comparing pods
    request_cost_tokens: Count = 256
    #: how much a cached prefix token is worth against a token of in-flight work (cost =
    #: uncached prompt tokens * kv_weight + in-flight prefill tokens + in-flight requests *
    #: request_cost_tokens)
    kv_weight: NonNegative = 1.0
    #: a request header whose value pins a session to the pod that served it first ("" = off)
    affinity_header: Annotated[str, Meta(pattern=r"^[A-Za-z0-9-]*$")] = ""
    #: the most sessions remembered (least recently used forgotten first)
    affinity_max_sessions: Positive = 100_000
    #: a pinned pod is left when its in-flight requests exceed the least-loaded pod's by this many
    affinity_max_imbalance: Count = 8
    # ---- retries -------------------------------------------------------------------------------
    #: extra attempts on other pods, made only where the upstream cannot have started the request
    max_retries: Count = 2
    #: first back-off before a retry, seconds (doubled per retry, full jitter)
    retry_backoff: NonNegative = 0.005
    retry_backoff_max: NonNegative = 0.25
    #: retries allowed per proxied request, on average (a token bucket that each request fills)
    retry_budget_ratio: NonNegative = 0.2
    #: retries the bucket holds when full (and at start)
    retry_budget_burst: Count = 20
    #: upstream statuses that mean "not started, try elsewhere" (e.g. [503] for an engine that
    #: sheds load with 503 before running anything); the default retries none
    retry_statuses: list[Annotated[int, Meta(ge=400, le=599)]] = msgspec.field(default_factory=list)
    # ---- circuit breaker -----------------------------------------------------------------------
    #: consecutive failures (refused, timed out, 5xx, cut mid-answer) that open a pod's breaker
    breaker_failures: Positive = 3
    # ---- timeouts ------------------------------------------------------------------------------
    #: seconds to open a TCP connection to a pod
    connect_timeout: Seconds = 3.0
    #: seconds for a whole answer, streamed or not (0: no limit)
    total_timeout: NonNegative = 1800.0
    #: seconds a client may leave an answer unread before it is dropped as the client's abort
    client_write_timeout: Seconds = 30.0
    # ---- admission -----------------------------------------------------------------------------
    #: requests forwarded at once (0: no limit)
    max_concurrency: Count = 1024
    #: requests waiting for a slot beyond max_concurrency; beyond that they are refused
    max_queue: Count = 1024
    #: seconds a request waits in the queue before it is refused
    queue_timeout: Seconds = 30.0
    #: the status of a refused request: 503 or 429 (both with Retry-After)
    overload_status: Literal[503, 429] = 503
    #: the Retry-After of a refused request, seconds
    retry_after: Positive = 1
    # ---- answers -------------------------------------------------------------------------------
    #: the largest non-streamed answer passed on, bytes (a larger one: a 502 naming this key)
    max_answer_bytes: Positive = 64 << 20
    #: idle upstream connections are kept this long (below uvicorn's 5 s keep-alive, so a pod
    #: never closes one just as a request goes out on it)
    keepalive_timeout: Seconds = 4.0

    def __post_init__(self) -> None:
        for k in ("kv_weight", "retry_backoff", "retry_backoff_max", "retry_budget_ratio", "total_timeout",
                  "connect_timeout", "client_write_timeout", "queue_timeout", "keepalive_timeout"):
            if math.isinf(getattr(self, k)):
                raise KeyCheck(k, "must be a finite number", getattr(self, k))
