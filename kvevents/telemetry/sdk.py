"""Configure the OpenTelemetry SDK for an application (the CLI, the demo): Prometheus and OTLP.

Only applications call this; library code uses the API alone. Needs ``opentelemetry-sdk``,
``opentelemetry-exporter-prometheus`` (for a Prometheus port) and
``opentelemetry-exporter-otlp-proto-http`` (for OTLP).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError

__all__ = ["TelemetryHandle", "setup"]


@dataclass
class TelemetryHandle:
    meter_provider: Any
    tracer_provider: Any | None  #: None when no span goes anywhere (tracing stays a no-op)
    prometheus_port: int | None = None  #: the port actually bound (useful with port 0)
    prometheus_addr: str | None = None
    otlp_endpoint: str | None = None  #: "" when taken from OTEL_EXPORTER_OTLP_* variables
    _server: Any = None
    _closed: bool = field(default=False, repr=False)

    def meter(self, name: str = "kvevents"):
        return self.meter_provider.get_meter(name)

    def shutdown(self) -> None:
        """Flush and stop exporters, close the Prometheus server. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


def setup(
    prometheus_port: int | None = None,
    otlp: bool | str | None = None,
    service_name: str = "kvevents",
    *,
    prometheus_addr: str = "127.0.0.1",
    set_global: bool = True,
    metric_export_interval_ms: int = 5000,
    span_processors: tuple = (),
    metric_readers: tuple = (),
    resource_attributes: dict[str, str] | None = None,
) -> TelemetryHandle:
    """Build a MeterProvider (and a TracerProvider when spans have somewhere to go).

    * ``prometheus_port``: serve ``/metrics`` on ``prometheus_addr:port`` (0 picks a free port);
    * ``otlp``: ``True`` = OTLP/HTTP exporters configured by the ``OTEL_EXPORTER_OTLP_*``
      variables; a string = the base endpoint (``http://host:4318``); ``None`` = on when
      ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set; ``False`` = off;
    * ``span_processors`` / ``metric_readers``: extra ones (tests: in-memory exporters);
    * ``set_global``: install the providers as the process's global ones (once per process).
    """
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.resources import Resource

    resource = Resource.create({"service.name": service_name, **(resource_attributes or {})})
    readers = list(metric_readers)
    server = None
    port = None
    if prometheus_port is not None:
        if not isinstance(prometheus_port, int) or not 0 <= prometheus_port < 65536:
            raise ConfigError(f"prometheus_port must be an int in [0, 65535], got {prometheus_port!r}")
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import REGISTRY, start_http_server

        reader = PrometheusMetricReader()
        try:
            server, _thread = start_http_server(prometheus_port, addr=prometheus_addr, registry=REGISTRY)
        except OSError as exc:
            reader.shutdown()
            raise ConfigError(f"cannot serve Prometheus metrics on {prometheus_addr}:{prometheus_port}: {exc}") from None
        port = server.server_address[1]
        readers.append(reader)

    if otlp is None:
        otlp = bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    endpoint = None
    span_exporter = None
    if otlp:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        if isinstance(otlp, str):
            endpoint = otlp.rstrip("/")
            metric_exporter = OTLPMetricExporter(endpoint=f"{endpoint}/v1/metrics")
            span_exporter = OTLPSpanExporter(endpoint=f"{endpoint}/v1/traces")
        else:
            endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
            metric_exporter = OTLPMetricExporter()
            span_exporter = OTLPSpanExporter()
        readers.append(PeriodicExportingMetricReader(metric_exporter, export_interval_millis=metric_export_interval_ms))

    meter_provider = MeterProvider(resource=resource, metric_readers=readers)
    tracer_provider = None
    if span_exporter is not None or span_processors:
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        tracer_provider = TracerProvider(resource=resource)
        if span_exporter is not None:
            tracer_provider.add_span_processor(BatchSpanProcessor(span_exporter))
        for p in span_processors:
            tracer_provider.add_span_processor(p)
    if set_global:
        metrics.set_meter_provider(meter_provider)
        if tracer_provider is not None:
            trace.set_tracer_provider(tracer_provider)
    return TelemetryHandle(meter_provider, tracer_provider, port, prometheus_addr if port is not None else None,
                           endpoint, server)
