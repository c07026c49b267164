"""The committed Grafana dashboards: only catalogue metrics, unique ids, a sound 24-column layout,
schemaVersion >= 39, the datasource variables, and in step with ``dashboards/generate.py``."""

from __future__ import annotations

import itertools
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "dashboards"))

import generate  # noqa: E402  (dashboards/generate.py)
import queries as dq  # noqa: E402  (dashboards/queries.py)

from kvevents.telemetry import catalog  # noqa: E402

BOARDS = dq.dashboards()
KNOWN = catalog.prometheus_names(series=True)
EXPECTED_TITLES = {"KV events pipeline", "Offload tiers", "KV-aware routing"}


def _panels(board):
    return list(dq._panels(board["panels"]))


def test_the_three_dashboards_are_committed_and_current():
    assert {b["title"] for b in BOARDS.values()} == EXPECTED_TITLES
    rendered = generate.render()
    assert set(rendered) == set(BOARDS), "a dashboard file is missing or extra: run python dashboards/generate.py"
    for name, text in rendered.items():
        assert (ROOT / "dashboards" / name).read_text() == text, f"{name} is stale: run python dashboards/generate.py"


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_every_query_names_only_catalogue_metrics(name):
    board = BOARDS[name]
    qs = dq.queries({name: board})
    assert qs, f"{name} has no Prometheus queries"
    for q in qs:
        names = dq.metric_names(q.expr)
        assert names, f"{name} panel {q.panel!r} {q.ref}: no metric found in {q.expr!r}"
        unknown = names - KNOWN
        assert not unknown, f"{name} panel {q.panel!r} {q.ref}: {sorted(unknown)} not in the catalogue ({q.expr})"
    for q in dq.template_queries(board):
        names = dq.metric_names(q)
        assert names and names <= KNOWN, f"{name}: variable query {q!r} names {sorted(names - KNOWN)}"


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_schema_and_variables(name):
    board = BOARDS[name]
    assert board["schemaVersion"] >= 39
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for p in _panels(board):
        for t in p.get("targets", []):
            ds = t.get("datasource") or p.get("datasource")
            if ds["type"] == "prometheus":
                assert ds["uid"] == "${datasource}", f"{name} panel {p['title']!r} does not use $datasource"
            else:
                assert ds["type"] == "tempo" and ds["uid"] == "${tempo}"
                assert variables["tempo"]["query"] == "tempo"
    # every $variable a query uses is defined (or is one of Grafana's built-ins)
    defined = {f"${n}" for n in variables} | {"$__rate_interval", "$__interval", "$__range"}
    for q in dq.queries({name: board}):
        used = set(re.findall(r"\$[A-Za-z_]+", q.expr))
        assert used <= defined, f"{name} panel {q.panel!r}: undefined variables {sorted(used - defined)}"


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_panel_ids_unique_and_layout_inside_the_grid_without_overlap(name):
    panels = _panels(BOARDS[name])
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["y"] >= 0 and g["w"] > 0 and g["h"] > 0, p["title"]
        assert g["x"] + g["w"] <= 24, f"{name} panel {p['title']!r} sticks out of the grid: {g}"
    for a, b in itertools.combinations(panels, 2):
        ga, gb = a["gridPos"], b["gridPos"]
        apart = (ga["x"] + ga["w"] <= gb["x"] or gb["x"] + gb["w"] <= ga["x"]
                 or ga["y"] + ga["h"] <= gb["y"] or gb["y"] + gb["h"] <= ga["y"])
        assert apart, f"{name}: panels {a['title']!r} and {b['title']!r} overlap ({ga} / {gb})"


def test_traces_panels_where_traces_fit():
    for name, board in BOARDS.items():
        tempo = [p for p in _panels(board) if (p.get("datasource") or {}).get("type") == "tempo"]
        assert tempo, f"{name} has no Tempo traces panel"


# ---- the checker itself --------------------------------------------------------------------------

@pytest.mark.parametrize("expr, names", [
    ('sum by (publisher) (rate(foo_total{publisher=~"$publisher"}[$__rate_interval]))', {"foo_total"}),
    ("histogram_quantile(0.99, sum by (le) (rate(lag_seconds_bucket[5m])))", {"lag_seconds_bucket"}),
    ('a_total / ignoring(kind) group_left b{x="y"} or vector(0)', {"a_total", "b"}),
    ('{__name__="weird_metric", job="x"}', {"weird_metric"}),
    ("sum(x) by (tier) * 1e3 + scalar(y)", {"x", "y"}),
    ('max(m{state="STALE"}) offset 5m and on (pod) n', {"m", "n"}),
    ("label_values(kvevents_x_total, publisher)", {"kvevents_x_total"}),
])
def test_metric_name_extraction(expr, names):
    assert dq.metric_names(expr) == names


def test_an_unknown_metric_is_caught():
    with pytest.raises(KeyError, match="not in kvevents.telemetry.catalog"):
        generate.metric("kvevents.publisher.no_such_metric")
    bad = {"x.json": {"panels": [{"id": 1, "title": "t", "datasource": generate.PROM,
                                  "targets": [{"refId": "A", "expr": "rate(kvevents_nope_total[1m])"}]}]}}
    (q,) = dq.queries(bad)
    assert dq.metric_names(q.expr) - KNOWN == {"kvevents_nope_total"}


def test_runnable_fills_in_every_variable():
    for q in dq.queries(BOARDS):
        assert "$" not in dq.runnable(q.expr), q.expr
