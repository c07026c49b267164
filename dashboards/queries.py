"""Reading the committed dashboards back: their queries, the metric names in them, and the
queries with Grafana's variables filled in so they can run against Prometheus directly.

Used by ``tests/test_dashboards.py`` and ``tests/test_prometheus_integration.py``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

__all__ = ["Query", "dashboards", "metric_names", "queries", "runnable", "template_queries"]

#: PromQL words that look like identifiers but are not metric names.
KEYWORDS = frozenset({
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
    "inf", "nan",
})
_NUMBER = re.compile(r"(?<![A-Za-z0-9_:])(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?)")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_NAME_MATCHER = re.compile(r'__name__\s*=~?\s*"([^"]*)"')
_LABEL_VALUES = re.compile(r"label_values\(\s*([A-Za-z_:][A-Za-z0-9_:]*)\s*(?:\{[^}]*\})?\s*,")

#: values the variables take when a query runs outside Grafana ("All" selected everywhere).
VARIABLES = {"$__rate_interval": "30s", "$__interval": "5s", "$__range": "5m", "$publisher": ".*",
             "$engine": ".*", "$tier": ".*"}


@dataclass(frozen=True, slots=True)
class Query:
    dashboard: str  #: file name
    panel_id: int
    panel: str  #: panel title
    ref: str  #: refId
    expr: str


def dashboards(directory: Path = HERE) -> dict[str, dict[str, Any]]:
    """File name -> parsed dashboard, for every ``*.json`` in ``directory``."""
    return {p.name: json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))}


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in panels:
        yield p
        yield from _panels(p.get("panels", []))  # collapsed rows hold their panels


def queries(boards: dict[str, dict[str, Any]] | None = None) -> list[Query]:
    """Every PromQL target of every panel (Tempo targets are not PromQL and are left out)."""
    out = []
    for name, d in (boards if boards is not None else dashboards()).items():
        for p in _panels(d.get("panels", [])):
            for t in p.get("targets", []):
                ds = t.get("datasource") or p.get("datasource") or {}
                if ds.get("type") == "prometheus" and "expr" in t:
                    out.append(Query(name, p.get("id"), p.get("title", ""), t.get("refId", ""), t["expr"]))
    return out


def template_queries(board: dict[str, Any]) -> list[str]:
    """The PromQL-ish queries of a dashboard's query variables (``label_values(...)``)."""
    out = []
    for v in board.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v.get("query")
            out.append(q.get("query", "") if isinstance(q, dict) else str(q))
    return out


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (functions, keywords, labels and durations removed)."""
    names = set(_NAME_MATCHER.findall(expr)) | set(_LABEL_VALUES.findall(expr))
    if _LABEL_VALUES.search(expr):
        return names
    e = _STRING.sub(" ", expr)
    while True:  # innermost first: matchers hold no braces once strings are gone
        e2 = _MATCHERS.sub(" ", e)
        if e2 == e:
            break
        e = e2
    e = _RANGE.sub(" ", e)
    e = _NUMBER.sub(" ", e)
    e = _GROUPING.sub(" ", e)
    for m in _IDENT.finditer(e):
        word = m.group(0)
        rest = e[m.end():].lstrip()
        if rest.startswith("("):  # a function or aggregation
            continue
        if word.lower() in KEYWORDS or word.startswith("$"):
            continue
        if m.start() > 0 and e[m.start() - 1] == "$":
            continue
        names.add(word)
    return names


def runnable(expr: str) -> str:
    """``expr`` with Grafana's variables replaced so Prometheus can run it."""
    for var in sorted(VARIABLES, key=len, reverse=True):
        expr = expr.replace(var, VARIABLES[var])
    return expr
