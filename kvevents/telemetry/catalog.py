"""The metric catalogue: every metric the project defines, assembled from the components.

Each :class:`MetricSpec` names the OpenTelemetry instrument (dotted name, kind, unit,
attributes), the component counter it reads, and the name it takes on a Prometheus scrape
through ``opentelemetry-exporter-prometheus`` (dots become underscores; a unit ``s`` adds
``_seconds`` and ``By`` adds ``_bytes`` unless the name already ends so; a counter gets
``_total``; curly-brace units such as ``{batch}`` and ``1`` add nothing). The Prometheus names
are written out here, not derived at run time, so dashboards can grep them; a test checks
them against what the exporter really emits.

Each component declares its specs beside its observer, as plain data, and names the list in
the ``kvevents.metrics`` entry-point group (``kvevents.telemetry.metrics`` for the publisher
and subscriber; the manager's and the router's in their own packages): this module knows no
component by name and imports nothing above the ground floor. :data:`CATALOG` is assembled
from the group on first use. The adapters that create the instruments take name, kind, unit
and description from here, so the table in docs/metrics.md (:func:`render_markdown_table`) and
the generated dashboards are what the code exports. It imports nothing from OpenTelemetry.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "COUNTER",
    "GAUGE",
    "HISTOGRAM",
    "UPDOWN",
    "CATALOG",
    "METRICS_GROUP",
    "CatalogError",
    "MetricSpec",
    "assemble",
    "catalog",
    "spec",
    "by_component",
    "get",
    "prometheus_names",
    "render_markdown_table",
]

COUNTER = "counter"  #: monotonic sum (observable counter, or a counter for wrapper-counted values)
UPDOWN = "up-down"  #: a sum that goes both ways (queue depth, blocks used)
GAUGE = "gauge"  #: a sampled value (health state, index size)
HISTOGRAM = "histogram"  #: a distribution recorded per batch or per job

#: bucket bounds (seconds) for lag and job latency: 100 µs .. 30 s
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str  #: OpenTelemetry instrument name (dotted)
    kind: str  #: COUNTER, UPDOWN, GAUGE or HISTOGRAM
    unit: str  #: UCUM unit as OpenTelemetry takes it ("By", "s", "{batch}", "1")
    description: str
    attributes: tuple[str, ...]  #: attribute keys every point carries
    component: str  #: publisher, subscriber, manager, engine, router
    source: str  #: what it reads (the component counter, or the hook that records it)
    prometheus: str  #: the series name on a Prometheus scrape (histograms: the base of _bucket/_sum/_count)
    buckets: tuple[float, ...] | None = None  #: explicit histogram bucket bounds


#: the unit suffix a Prometheus scrape adds to a series name (unless the name already ends with it)
_UNIT_SUFFIX = {"By": "_bytes", "s": "_seconds"}


def prometheus_name(name: str, kind: str, unit: str) -> str:
    """The series name a Prometheus scrape gives instrument ``name``: dots to underscores, the
    unit's suffix (``By`` bytes, ``s`` seconds) unless the name ends with it, ``_total`` on a
    counter (histograms: the base of ``_bucket``/``_sum``/``_count``)."""
    base = name.replace(".", "_")
    suffix = _UNIT_SUFFIX.get(unit, "")
    if suffix and not base.endswith(suffix):
        base += suffix
    return base + ("_total" if kind == COUNTER else "")


def spec(name, kind, unit, description, attributes, component, source, *, buckets=None) -> MetricSpec:
    """A :class:`MetricSpec` (attributes as any iterable; the Prometheus name derived by
    :func:`prometheus_name`): what components' spec lists are written with."""
    return MetricSpec(name, kind, unit, description, tuple(attributes), component, source,
                      prometheus_name(name, kind, unit), buckets)


class CatalogError(Exception):
    """A component's metric specs cannot join the catalogue; the message names the entry point."""


#: the entry-point group where each component names its spec list (``"pkg.module:METRICS"``)
METRICS_GROUP = "kvevents.metrics"


def assemble(entry_points=None) -> tuple[MetricSpec, ...]:
    """Every component's specs, from the ``kvevents.metrics`` entry points in name order.

    ``entry_points`` (for tests): objects with ``name``, ``value`` and ``load()``, else the
    installed ones. Raises :class:`CatalogError` naming the entry point for one that cannot be
    loaded, is not a sequence of :class:`MetricSpec`, or repeats a metric name.
    """
    if entry_points is None:
        from importlib.metadata import entry_points as installed

        entry_points = installed(group=METRICS_GROUP)
    out: list[MetricSpec] = []
    owner: dict[str, str] = {}
    for ep in sorted(entry_points, key=lambda e: e.name):
        try:
            specs = tuple(ep.load())
        except Exception as exc:
            raise CatalogError(f"metric specs {ep.name!r} ({ep.value}) cannot be loaded: {exc!r}") from exc
        for m in specs:
            if not isinstance(m, MetricSpec):
                raise CatalogError(f"metric specs {ep.name!r} ({ep.value}) hold {m!r:.80}, not a MetricSpec")
            if m.name in owner:
                raise CatalogError(f"metric {m.name!r} is declared twice: by {owner[m.name]!r} and {ep.name!r}")
            owner[m.name] = ep.name
            out.append(m)
    return tuple(out)


_catalog: tuple[MetricSpec, ...] | None = None
_by_name: dict[str, MetricSpec] = {}


def catalog() -> tuple[MetricSpec, ...]:
    """The catalogue, assembled once (on first use, so that importing this module imports nothing)."""
    global _catalog, _by_name
    if _catalog is None:
        specs = assemble()
        _by_name = {m.name: m for m in specs}
        _catalog = specs
    return _catalog


def __getattr__(name: str):
    if name == "CATALOG":
        return catalog()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get(name: str) -> MetricSpec:
    """The spec of ``name``; KeyError naming the unknown metric otherwise."""
    catalog()
    try:
        return _by_name[name]
    except KeyError:
        raise KeyError(f"metric {name!r} is not in kvevents.telemetry.catalog.CATALOG") from None


def by_component(component: str) -> list[MetricSpec]:
    return [m for m in catalog() if m.component == component]


def prometheus_names(*, series: bool = False) -> set[str]:
    """Every Prometheus name; ``series=True`` adds the ``_bucket``/``_sum``/``_count`` series of histograms."""
    out = set()
    for m in catalog():
        out.add(m.prometheus)
        if series and m.kind == HISTOGRAM:
            out.update(m.prometheus + s for s in ("_bucket", "_sum", "_count"))
    return out


def render_markdown_table(specs: tuple[MetricSpec, ...] | list[MetricSpec] | None = None) -> str:
    """The metric table of docs/metrics.md (markdown), one row per metric, in catalogue order."""
    rows = ["| Prometheus name | OpenTelemetry name | kind | unit | attributes | what it counts | reads |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for m in catalog() if specs is None else specs:
        attrs = ", ".join(f"`{a}`" for a in m.attributes) or "-"
        desc = m.description.replace("|", "\\|")
        src = m.source.replace("|", "\\|")
        rows.append(f"| `{m.prometheus}` | `{m.name}` | {m.kind} | `{m.unit}` | {attrs} | {desc} | {m.component}: {src} |")
    return "\n".join(rows) + "\n"
