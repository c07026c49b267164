"""Telemetry for the demo: :func:`kvevents.telemetry.setup` plus the observe/instrument hooks
of each component of the routed cluster (the round-robin shadow cluster is left out, so the
dashboards show one cluster).

* metrics are configured when ``--prometheus-port`` or OTLP is asked for (``--otlp``, or the
  ``OTEL_EXPORTER_OTLP_ENDPOINT`` variable); otherwise nothing is set up and the library's
  OpenTelemetry API calls stay no-ops;
* spans are wired only when they have somewhere to go (OTLP): per batch sent and received,
  per engine step and transfer job, per routing decision.
"""

from __future__ import annotations

import os
from typing import Any

# ``DemoRun`` in annotations is kvdemo.run.DemoRun, left a string (not imported, not even under
# TYPE_CHECKING): run imports this module, and the floor rules allow no circle.

__all__ = ["SERVICE_NAME", "Telemetry"]

SERVICE_NAME = "kvevents-demo"


class Telemetry:
    def __init__(self) -> None:
        self.handle: Any = None
        self.observations: list[Any] = []
        self.traced: list[Any] = []  #: callables that remove the span hooks
        self.spans = False

    @property
    def enabled(self) -> bool:
        return self.handle is not None

    @property
    def prometheus_url(self) -> str | None:
        h = self.handle
        if h is None or h.prometheus_port is None:
            return None
        return f"http://{h.prometheus_addr}:{h.prometheus_port}/metrics"

    def start(self, prometheus_port: int | None, host: str, otlp: str | None) -> None:
        """``otlp``: None (on if OTEL_EXPORTER_OTLP_ENDPOINT is set), "" (on, endpoint from the
        OTEL_EXPORTER_OTLP_* variables) or an endpoint such as ``http://127.0.0.1:4318``."""
        env = bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
        if prometheus_port is None and otlp is None and not env:
            return
        from kvevents.telemetry import setup

        otlp_arg: bool | str | None = otlp if otlp else (True if otlp == "" else None)
        self.handle = setup(prometheus_port=prometheus_port, otlp=otlp_arg, service_name=SERVICE_NAME,
                            prometheus_addr=host, metric_export_interval_ms=2000)
        self.spans = self.handle.tracer_provider is not None

    def instrument(self, run: "DemoRun", sample_every: int = 16) -> None:
        if self.handle is None:
            return
        from consumers.telemetry import instrument_router, observe_router
        from kvevents.telemetry import (instrument_publisher, instrument_subscriber, observe_publisher,
                                        observe_subscriber)
        from manager.telemetry import instrument_engine, observe_engine

        obs = self.observations
        for n in run.nodes:
            obs.append(observe_publisher(n.publisher, name=n.name))
            obs.append(observe_engine(n.engine, name=n.name))
        obs.append(observe_subscriber(run.sub))
        obs.append(observe_router(run.router, refresh_interval=1.0))
        if self.spans:
            from kvevents.telemetry import uninstrument

            tp = self.handle.tracer_provider
            for n in run.nodes:
                instrument_publisher(n.publisher, tp, sample_every=sample_every)
                self.traced.append(lambda pub=n.publisher: uninstrument(pub))
                self.traced.append(instrument_engine(n.engine, name=n.name, tracer_provider=tp,
                                                     sample_every=sample_every).close)
            instrument_subscriber(run.sub, tp, sample_every=sample_every)
            self.traced.append(lambda sub=run.sub: uninstrument(sub))
            self.traced.append(instrument_router(run.router, tp, sample_every=sample_every).close)

    def describe(self) -> list[str]:
        if self.handle is None:
            return []
        lines = []
        if self.prometheus_url:
            lines.append(f"metrics: {self.prometheus_url} (Prometheus scrape target)")
        if self.handle.otlp_endpoint is not None:
            where = self.handle.otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "(OTEL_* settings)")
            lines.append(f"OTLP: traces and metrics to {where} (service.name {SERVICE_NAME})")
        return lines

    def shutdown(self) -> list[str]:
        """Stop instrumenting, flush the exporters; lines for the summary saying where things went."""
        if self.handle is None:
            return ["traces and metrics: not exported (use --prometheus-port PORT and/or --otlp [ENDPOINT], "
                    "or set OTEL_EXPORTER_OTLP_ENDPOINT)"]
        for close in self.traced:
            close()
        for o in self.observations:
            o.close()
        self.traced.clear()
        self.observations.clear()
        lines = []
        if self.prometheus_url:
            lines.append(f"metrics: were served on {self.prometheus_url} (the dashboards in dashboards/ read them)")
        if self.handle.otlp_endpoint is not None:
            where = self.handle.otlp_endpoint or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "(OTEL_* settings)")
            lines.append(f"traces: exported over OTLP to {where} (service.name {SERVICE_NAME}; find them in "
                         "Tempo/Jaeger by that service)")
        else:
            lines.append("traces: not exported (no OTLP endpoint: --otlp [ENDPOINT] or OTEL_EXPORTER_OTLP_ENDPOINT)")
        try:
            self.handle.shutdown()
        except Exception as exc:  # an exporter that cannot flush must not hide the summary
            lines.append(f"telemetry shutdown error: {exc!r}")
        self.handle = None
        return lines
