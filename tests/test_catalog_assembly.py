"""The catalogue is assembled from each component's spec list (entry points), not written in kvevents."""

from __future__ import annotations

import pytest

from kvevents.telemetry import catalog
from kvevents.telemetry.catalog import COUNTER, CatalogError, assemble, spec


class _EP:
    def __init__(self, name, specs=None, exc=None):
        self.name, self.value, self._specs, self._exc = name, f"pkg.{name}:METRICS", specs, exc

    def load(self):
        if self._exc is not None:
            raise self._exc
        return self._specs


def _s(name, component="x"):
    return spec(name, COUNTER, "1", "A count.", (), component, "stats.n")


def test_each_component_declares_its_specs_in_its_own_package():
    import consumers.metrics
    import kvevents.telemetry.metrics
    import manager.metrics

    assert catalog.CATALOG == (kvevents.telemetry.metrics.METRICS + manager.metrics.METRICS
                               + consumers.metrics.METRICS)
    assert {m.component for m in kvevents.telemetry.metrics.METRICS} == {"publisher", "subscriber"}
    assert {m.component for m in manager.metrics.METRICS} == {"manager", "engine"}
    assert {m.component for m in consumers.metrics.METRICS} == {"router"}


def test_assembly_orders_by_entry_point_and_rejects_what_it_cannot_trust():
    a, b = _s("kvevents.a"), _s("kvevents.b")
    assert assemble([_EP("2-b", [b]), _EP("1-a", (a,))]) == (a, b)
    with pytest.raises(CatalogError, match=r"'kvevents.a' is declared twice: by '1-a' and '2-b'"):
        assemble([_EP("1-a", [a]), _EP("2-b", [a])])
    with pytest.raises(CatalogError, match=r"'2-b' \(pkg.2-b:METRICS\) hold 'nope', not a MetricSpec"):
        assemble([_EP("2-b", ["nope"])])
    with pytest.raises(CatalogError, match=r"'3-c' \(pkg.3-c:METRICS\) cannot be loaded: ModuleNotFoundError"):
        assemble([_EP("3-c", exc=ModuleNotFoundError("No module named 'pkg'"))])


def test_the_catalogue_module_knows_no_component_metric_by_name():
    from pathlib import Path

    text = Path(catalog.__file__).read_text()
    for prefix in ("kvevents.manager.", "kvevents.router.", "kvevents.engine.", "kvevents.publisher.", "kvevents.subscriber."):
        assert prefix not in text, prefix
