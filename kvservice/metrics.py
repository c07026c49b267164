"""``/metrics``: the project's OpenTelemetry metrics (router, subscriber) on a Prometheus scrape,
plus the service's own series, kept as plain ints and rendered here:

* ``kvservice_http_requests_total{route,method,status}``
* ``kvservice_http_request_duration_seconds{route}`` (histogram)
* ``kvservice_unattributed_batches_total{publisher}`` — batches no pod/model could be found for
* ``kvservice_proxy_requests_total{pod,outcome}`` / ``kvservice_proxy_retries_total`` /
  ``kvservice_pod_down{pod}`` (proxy mode)
* ``kvservice_ready``, ``kvservice_internal_errors_total``, ``kvservice_ingest_errors_total``
* ``kvservice_http_handoffs_total`` — connections the fast path (kvservice.fasthttp) gave to aiohttp
* ``kvservice_http_limit_hits_total{limit}`` — the ``[http]`` bounds hit (timeouts, connection cap,
  buffered bytes, head/body size), ``kvservice_http_connections``, ``kvservice_http_buffered_bytes``
* requests refused as malformed (a head breaking HTTP/1.1's grammar) are in
  ``kvservice_http_requests_total`` under ``route="malformed"``; limit answers under ``route="limit"``
"""

from __future__ import annotations

import bisect
import threading

__all__ = ["HttpMetrics", "Telemetry", "render_service_metrics"]

BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class HttpMetrics:
    """Request counts by (route, method, status) and latency histograms by route (event-loop thread)."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str, int], int] = {}
        self.hist: dict[str, list] = {}  # route -> [bucket counts..., +Inf count, sum]

    def observe(self, route: str, method: str, status: int, seconds: float) -> None:
        k = (route, method, status)
        self.counts[k] = self.counts.get(k, 0) + 1
        h = self.hist.get(route)
        if h is None:
            h = self.hist[route] = [0] * (len(BUCKETS) + 1) + [0.0]
        h[bisect.bisect_left(BUCKETS, seconds)] += 1
        h[-1] += seconds


class Telemetry:
    """The OpenTelemetry side: a MeterProvider whose Prometheus reader writes into a registry of
    this service's own (so two services in one process do not mix), observing router and subscriber."""

    def __init__(self, fleet) -> None:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import CollectorRegistry

        from consumers.telemetry import observe_router
        from kvevents.telemetry import observe_subscriber, setup

        self.registry = CollectorRegistry()
        self.reader = PrometheusMetricReader(registry=self.registry)
        self.handle = setup(metric_readers=(self.reader,), set_global=False, service_name="kvevents-router",
                            otlp=False)
        meter = self.handle.meter("kvservice")
        self.observations = [observe_router(fleet.router, meter), observe_subscriber(fleet.sub, meter)]
        self.lock = threading.Lock()

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

    def close(self) -> None:
        for o in self.observations:
            o.close()
        self.handle.shutdown()


def _esc(v: object) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def render_service_metrics(api) -> bytes:
    fleet = api.fleet
    parts: list[bytes] = []
    tel = getattr(api, "telemetry", None)
    if tel is not None:
        with fleet.lock:  # the observers read the router's counters and index
            parts.append(tel.render())
    out = []
    m = api.metrics
    out.append("# HELP kvservice_http_requests_total HTTP requests answered, by route, method and status")
    out.append("# TYPE kvservice_http_requests_total counter")
    for (route, method, status), n in sorted(m.counts.items()):
        out.append(f'kvservice_http_requests_total{{route="{_esc(route)}",method="{method}",status="{status}"}} {n}')
    out.append("# HELP kvservice_http_request_duration_seconds Time to answer an HTTP request, by route")
    out.append("# TYPE kvservice_http_request_duration_seconds histogram")
    for route, h in sorted(m.hist.items()):
        r = _esc(route)
        acc = 0
        for b, n in zip(BUCKETS, h):
            acc += n
            out.append(f'kvservice_http_request_duration_seconds_bucket{{route="{r}",le="{b}"}} {acc}')
        acc += h[len(BUCKETS)]
        out.append(f'kvservice_http_request_duration_seconds_bucket{{route="{r}",le="+Inf"}} {acc}')
        out.append(f'kvservice_http_request_duration_seconds_sum{{route="{r}"}} {h[-1]}')
        out.append(f'kvservice_http_request_duration_seconds_count{{route="{r}"}} {acc}')
    out.append("# HELP kvservice_unattributed_batches_total Batches not indexed: no pod or model could be found")
    out.append("# TYPE kvservice_unattributed_batches_total counter")
    for u in list(fleet.unattributed.values()):
        out.append(f'kvservice_unattributed_batches_total{{publisher="{_esc(u.publisher)}"}} {u.batches}')
    out.append("# HELP kvservice_ready 1 once every configured pod has been synced (late-join replay done)")
    out.append("# TYPE kvservice_ready gauge")
    out.append(f"kvservice_ready {int(fleet.ready)}")
    out.append("# HELP kvservice_internal_errors_total Requests answered 500 (logged)")
    out.append("# TYPE kvservice_internal_errors_total counter")
    out.append(f"kvservice_internal_errors_total {api.internal_errors}")
    out.append("# HELP kvservice_ingest_errors_total Exceptions caught by the ingest loop (logged)")
    out.append("# TYPE kvservice_ingest_errors_total counter")
    out.append(f"kvservice_ingest_errors_total {fleet.ingest_errors}")
    site = getattr(api, "fast_site", None)
    if site is not None:
        out.append("# HELP kvservice_http_handoffs_total Connections the fast path gave to aiohttp (another route, "
                   "an error to answer, a prompt to tokenize...)")
        out.append("# TYPE kvservice_http_handoffs_total counter")
        out.append(f"kvservice_http_handoffs_total {site.handoffs}")
        out.append("# HELP kvservice_http_limit_hits_total Connections answered 408/413/431/503 or closed at an [http] "
                   "bound, by limit")
        out.append("# TYPE kvservice_http_limit_hits_total counter")
        for limit, n in site.bounds.limit_hits.items():
            out.append(f'kvservice_http_limit_hits_total{{limit="{limit}"}} {n}')
        out.append("# HELP kvservice_http_connections Open client connections (of them reserved for health probes: "
                   "kvservice_http_reserve_connections)")
        out.append("# TYPE kvservice_http_connections gauge")
        out.append(f"kvservice_http_connections {len(site.bounds.conns)}")
        out.append("# HELP kvservice_http_reserve_connections Connections admitted past http.max_connections, for "
                   "GET /healthz and /readyz only")
        out.append("# TYPE kvservice_http_reserve_connections gauge")
        out.append(f"kvservice_http_reserve_connections {len(site.bounds.reserve)}")
        out.append("# HELP kvservice_http_buffered_bytes Bytes held for requests not yet fully received")
        out.append("# TYPE kvservice_http_buffered_bytes gauge")
        out.append(f"kvservice_http_buffered_bytes {site.bounds.buffered}")
    proxy = getattr(api, "proxy", None)
    if proxy is not None:
        out.extend(proxy.metric_lines())
    parts.append(("\n".join(out) + "\n").encode())
    return b"".join(parts)


def _counter(out: list, name: str, help_: str, kind: str = "counter") -> None:
    out.append(f"# HELP {name} {help_}")
    out.append(f"# TYPE {name} {kind}")


def proxy_metric_lines(proxy) -> list[str]:
    """The proxy's series (kvservice.proxy.Proxy; docs/proxy.md lists them)."""
    out: list[str] = []
    _counter(out, "kvservice_proxy_requests_total", "Proxied attempts by pod and outcome (ok, status_5xx, refused, "
             "connect_timeout, first_byte_timeout, total_timeout, failed, cut_midstream, too_large, client_abort, "
             "retry_status)")
    for (pod, outcome), n in sorted(proxy.outcomes.items()):
        out.append(f'kvservice_proxy_requests_total{{pod="{_esc(pod)}",outcome="{outcome}"}} {n}')
    _counter(out, "kvservice_proxy_upstream_responses_total", "Answers from pods, by pod and HTTP status as sent")
    for (pod, status), n in sorted(proxy.statuses.items()):
        out.append(f'kvservice_proxy_upstream_responses_total{{pod="{_esc(pod)}",status="{status}"}} {n}')
    adm = proxy.admission
    for name, help_, value in (
            ("kvservice_proxy_retries_total", "Attempts on another pod after one that cannot have started the request",
             proxy.retries),
            ("kvservice_proxy_retry_budget_exhausted_total", "Retries not made: the retry budget was spent",
             proxy.budget.exhausted),
            ("kvservice_proxy_no_pod_total", "Requests with no pod to forward to (none, or every breaker open)",
             proxy.no_pod),
            ("kvservice_proxy_bad_requests_total", "Proxy requests refused as malformed (4xx, before any pod)",
             proxy.bad_requests),
            ("kvservice_proxy_queued_total", "Requests that waited for a slot (over proxy.max_concurrency)",
             adm.queued),
            ("kvservice_proxy_tokenize_seconds_total", "Time spent tokenizing proxied requests", proxy.tokenize_s)):
        _counter(out, name, help_)
        out.append(f"{name} {value}")
    _counter(out, "kvservice_proxy_rejected_total", "Requests refused with proxy.overload_status, by reason "
             "(queue_full, queue_timeout)")
    for reason, n in sorted(adm.rejected.items()):
        out.append(f'kvservice_proxy_rejected_total{{reason="{reason}"}} {n}')
    _counter(out, "kvservice_proxy_active", "Requests forwarded now / waiting for a slot", "gauge")
    out.append(f'kvservice_proxy_active{{state="forwarding"}} {adm.active}')
    out.append(f'kvservice_proxy_active{{state="queued"}} {len(adm.waiters)}')
    if proxy.affinity is not None:
        _counter(out, "kvservice_proxy_affinity_total", "Requests of a known session: kept on its pod, or moved")
        out.append(f'kvservice_proxy_affinity_total{{result="kept"}} {proxy.affinity.hits}')
        out.append(f'kvservice_proxy_affinity_total{{result="moved"}} {proxy.affinity.moved}')
    down = proxy.down_pods()
    pods = sorted(proxy.pods.values(), key=lambda p: p.name)
    for name, help_, kind, get in (
            ("kvservice_pod_down", "1 while the pod's circuit breaker is open (the proxy skips it)", "gauge",
             lambda p: int(p.name in down)),
            ("kvservice_proxy_breaker_opened_total", "Times the pod's circuit breaker opened", "counter",
             lambda p: p.opened),
            ("kvservice_proxy_in_flight", "Requests the proxy has on the pod now", "gauge", lambda p: p.in_flight),
            ("kvservice_proxy_prefill_tokens", "Prompt tokens sent to the pod not yet answering", "gauge",
             lambda p: p.prefill),
            ("kvservice_proxy_connections_opened_total", "Connections opened to the pod (idle ones are kept warm)",
             "counter", lambda p: proxy.pools[p.name].opened)):
        _counter(out, name, help_, kind)
        out.extend(f'{name}{{pod="{_esc(p.name)}"}} {get(p)}' for p in pods)
    return out
