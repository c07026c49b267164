"""The metric catalogue: complete, well formed, and its Prometheus names are what the exporter emits."""

from __future__ import annotations

import re

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import Observation
from opentelemetry.sdk.metrics import MeterProvider
from prometheus_client import REGISTRY, generate_latest

from kvevents.telemetry import catalog
from kvevents.telemetry.catalog import CATALOG, COUNTER, GAUGE, HISTOGRAM, UPDOWN, render_markdown_table

ISSUE_METRICS = [  # what issue 5 asks for, each mapped to a catalogue name
    "kvevents.publisher.batches", "kvevents.publisher.events", "kvevents.publisher.bytes",
    "kvevents.publisher.queue.depth", "kvevents.publisher.overflow", "kvevents.publisher.replay.served",
    "kvevents.subscriber.received", "kvevents.subscriber.gaps", "kvevents.subscriber.recovered",
    "kvevents.subscriber.unrecoverable", "kvevents.subscriber.resets", "kvevents.subscriber.malformed",
    "kvevents.subscriber.lag", "kvevents.subscriber.health",
    "kvevents.manager.stores", "kvevents.manager.loads", "kvevents.manager.evictions", "kvevents.manager.bytes",
    "kvevents.manager.blocks.used", "kvevents.manager.promotions", "kvevents.manager.cascades",
    "kvevents.manager.job.failures", "kvevents.manager.job.duration",
    "kvevents.router.entries", "kvevents.router.index.size", "kvevents.router.lookups",
    "kvevents.router.matched.tokens", "kvevents.router.offload.unjoined",
]


def test_catalogue_covers_the_issue_and_is_well_formed():
    names = [m.name for m in CATALOG]
    assert len(names) == len(set(names))
    for n in ISSUE_METRICS:
        assert catalog.get(n).name == n
    assert catalog.get("kvevents.subscriber.lag").kind == HISTOGRAM
    assert "tier" in catalog.get("kvevents.manager.blocks.used").attributes
    assert "tier" in catalog.get("kvevents.router.matched.tokens").attributes
    assert "state" in catalog.get("kvevents.subscriber.health").attributes
    for m in CATALOG:
        assert m.kind in (COUNTER, UPDOWN, GAUGE, HISTOGRAM)
        assert re.fullmatch(r"kvevents(\.[a-z_]+)+", m.name), m.name
        assert re.fullmatch(r"kvevents(_[a-z]+)+", m.prometheus), m.prometheus
        assert m.description.endswith(".") and m.unit
        assert (m.buckets is not None) == (m.kind == HISTOGRAM)
        if m.kind == COUNTER:
            assert m.prometheus.endswith("_total")
    try:
        catalog.get("kvevents.nope")
    except KeyError as exc:
        assert "kvevents.nope" in str(exc)
    else:
        raise AssertionError("unknown metric accepted")


def test_prometheus_names_are_what_the_exporter_emits():
    reader = PrometheusMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    try:
        meter = provider.get_meter("catalog-check")
        for m in CATALOG:
            attrs = {a: "x" for a in m.attributes}
            cb = (lambda attrs: lambda options: [Observation(1, attrs)])(attrs)
            if m.kind == COUNTER:
                meter.create_observable_counter(m.name, [cb], unit=m.unit, description=m.description)
            elif m.kind == UPDOWN:
                meter.create_observable_up_down_counter(m.name, [cb], unit=m.unit, description=m.description)
            elif m.kind == GAUGE:
                meter.create_observable_gauge(m.name, [cb], unit=m.unit, description=m.description)
            else:
                meter.create_histogram(m.name, unit=m.unit, description=m.description,
                                       explicit_bucket_boundaries_advisory=list(m.buckets)).record(0.002, attrs)
        text = generate_latest(REGISTRY).decode()
    finally:
        provider.shutdown()
    samples = {line.split("{")[0].split(" ")[0] for line in text.splitlines()
               if line.startswith("kvevents_")}
    assert samples == catalog.prometheus_names(series=True) - {m.prometheus for m in CATALOG if m.kind == HISTOGRAM}
    # attribute keys come through as labels, unchanged
    for m in CATALOG:
        for a in m.attributes:
            assert re.search(rf'^{m.prometheus}(_bucket)?{{[^}}]*\b{a}="x"', text, re.M), (m.prometheus, a)
    assert 'le="0.001"' in text  # the catalogue's buckets, not the SDK's defaults


def test_markdown_table_has_a_row_per_metric():
    table = render_markdown_table()
    lines = table.strip().splitlines()
    assert len(lines) == 2 + len(CATALOG)
    for m, line in zip(CATALOG, lines[2:]):
        assert line.startswith(f"| `{m.prometheus}` | `{m.name}` | {m.kind} |")
        assert line.count(" | ") == 6  # no stray pipes inside cells
