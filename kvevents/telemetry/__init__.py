"""Telemetry for kvevents: a metric catalogue, observers and tracers over the components.

Library code here uses only the OpenTelemetry API (a no-op until an application configures
a provider); :func:`setup` configures the SDK (Prometheus port, OTLP).

* metrics: ``observe_publisher(pub)``, ``observe_subscriber(sub)`` (here),
  ``manager.telemetry.observe_engine/observe_manager``, ``consumers.telemetry.observe_router``;
* spans: ``instrument_publisher(pub)``, ``instrument_subscriber(sub)`` (here),
  ``manager.telemetry.instrument_engine/instrument_manager``, ``consumers.telemetry.instrument_router``.

Spans are sampled by sequence number before any OpenTelemetry call (:mod:`.sampling`): a batch
is traced iff ``seq % sample_every == 0`` (default 1024, ``$KVEVENTS_TRACE_SAMPLE_EVERY``), so
the engine step, publisher, subscriber and router trace the same batches, in any process;
gap recovery, replays served, resets and gaps are always traced. The two per-item histograms
(subscriber lag, manager job latency) record one item in 32 the same way.
"""

from .catalog import MetricSpec, render_markdown_table
from .instruments import Observation
from .messaging import MESSAGES, instrument_publisher, instrument_subscriber, message_id, uninstrument
from .observe import observe_publisher, observe_subscriber


def __getattr__(name: str):
    if name == "CATALOG":  # assembled from the components' entry points on first use
        from .catalog import catalog

        return catalog()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def setup(*args, **kwargs):
    """Configure the OpenTelemetry SDK; see :func:`kvevents.telemetry.sdk.setup`."""
    from .sdk import setup as _setup

    return _setup(*args, **kwargs)


__all__ = ["CATALOG", "MESSAGES", "MetricSpec", "Observation", "instrument_publisher", "instrument_subscriber",
           "message_id", "observe_publisher", "observe_subscriber", "render_markdown_table", "setup",
           "uninstrument"]
