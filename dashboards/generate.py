"""Generate the Grafana dashboards (``dashboards/*.json``) from the metric catalogue.

    python dashboards/generate.py           # (re)write the JSON files next to this script
    python dashboards/generate.py --check   # exit 1 if a committed file differs from what it generates

Every PromQL query names its metric through :func:`metric`, which looks the catalogue name
up in :mod:`kvevents.telemetry.catalog` (a KeyError for a metric the code does not define),
so a dashboard cannot drift from what the exporters emit. Panels are laid out left to right
in Grafana's 24-column grid, wrapping to a new line when a row is full.

Queries use the Grafana variables ``$datasource`` (Prometheus), ``$tempo`` (Tempo, for the
trace panels), ``$__rate_interval`` and the label filters ``$publisher``, ``$engine``,
``$tier`` (multi-value, "All" = ``.*``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(HERE.parent))

from kvevents.telemetry import catalog  # noqa: E402

SCHEMA_VERSION = 39
PROM = {"type": "prometheus", "uid": "${datasource}"}
TEMPO = {"type": "tempo", "uid": "${tempo}"}
GRID = 24


def metric(name: str, suffix: str = "") -> str:
    """The Prometheus series of catalogue metric ``name`` (``suffix``: ``_bucket``/``_sum``/``_count``)."""
    spec = catalog.get(name)
    if suffix and spec.kind != catalog.HISTOGRAM:
        raise ValueError(f"{name} is a {spec.kind}, it has no {suffix} series")
    return spec.prometheus + suffix


def _sel(sel: str) -> str:
    return f"{{{sel}}}" if sel else ""


def rate(name: str, sel: str = "", by: str = "") -> str:
    inner = f"rate({metric(name)}{_sel(sel)}[$__rate_interval])"
    return f"sum by ({by}) ({inner})" if by else f"sum({inner})"


def quantile(q: float, name: str, sel: str = "", by: str = "") -> str:
    keys = "le" + (f", {by}" if by else "")
    return (f"histogram_quantile({q}, sum by ({keys}) "
            f"(rate({metric(name, '_bucket')}{_sel(sel)}[$__rate_interval])))")


class Board:
    """A dashboard under construction: panels get unique ids and a place in the grid."""

    def __init__(self, title: str, uid: str, description: str, variables: list[dict[str, Any]]) -> None:
        self.title, self.uid, self.description = title, uid, description
        self.variables = variables
        self.panels: list[dict[str, Any]] = []
        self._x = 0
        self._y = 0
        self._row_h = 0
        self._next_id = 1

    def _place(self, w: int, h: int) -> dict[str, int]:
        if not 0 < w <= GRID:
            raise ValueError(f"panel width {w} is outside the {GRID}-column grid")
        if self._x + w > GRID:
            self._newline()
        pos = {"h": h, "w": w, "x": self._x, "y": self._y}
        self._x += w
        self._row_h = max(self._row_h, h)
        return pos

    def _newline(self) -> None:
        self._y += self._row_h
        self._x = 0
        self._row_h = 0

    def _add(self, panel: dict[str, Any], w: int, h: int) -> None:
        panel["id"] = self._next_id
        self._next_id += 1
        panel["gridPos"] = self._place(w, h)
        self.panels.append(panel)

    def row(self, title: str) -> None:
        if self._x:
            self._newline()
        self._add({"type": "row", "title": title, "collapsed": False, "panels": []}, GRID, 1)
        self._newline()

    def timeseries(self, title: str, targets: list[tuple[str, str]], *, unit: str = "short", w: int = 8,
                   h: int = 8, description: str = "", stack: bool = False) -> None:
        custom: dict[str, Any] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never",
                                  "spanNulls": False}
        if stack:
            custom["stacking"] = {"group": "A", "mode": "normal"}
        self._add({
            "type": "timeseries", "title": title, "description": description, "datasource": PROM,
            "fieldConfig": {"defaults": {"unit": unit, "custom": custom}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "desc"}},
            "targets": _targets(targets),
        }, w, h)

    def stat(self, title: str, targets: list[tuple[str, str]], *, unit: str = "short", w: int = 4, h: int = 4,
             description: str = "", thresholds: list[tuple[float | None, str]] | None = None) -> None:
        steps = [{"color": c, "value": v} for v, c in (thresholds or [(None, "green")])]
        self._add({
            "type": "stat", "title": title, "description": description, "datasource": PROM,
            "fieldConfig": {"defaults": {"unit": unit, "thresholds": {"mode": "absolute", "steps": steps}},
                            "overrides": []},
            "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "colorMode": "value", "graphMode": "area", "textMode": "auto", "justifyMode": "auto"},
            "targets": _targets(targets, instant=True),
        }, w, h)

    def state_timeline(self, title: str, expr: str, legend: str, *, w: int = 12, h: int = 8,
                       description: str = "") -> None:
        self._add({
            "type": "state-timeline", "title": title, "description": description, "datasource": PROM,
            "fieldConfig": {"defaults": {"mappings": [{"type": "value", "options": {
                "0": {"text": "SYNCED", "color": "green"}, "1": {"text": "RECOVERING", "color": "orange"},
                "2": {"text": "STALE", "color": "red"}, "3": {"text": "CONNECTING", "color": "blue"}}}]},
                "overrides": []},
            "options": {"showValue": "auto", "mergeValues": True, "rowHeight": 0.8},
            "targets": _targets([(expr, legend)]),
        }, w, h)

    def traces(self, title: str, traceql: str, *, w: int = 24, h: int = 9, description: str = "") -> None:
        """A Tempo search: the most recent traces matching ``traceql``, each opening its trace view."""
        self._add({
            "type": "table", "title": title, "description": description, "datasource": TEMPO,
            "options": {"showHeader": True, "cellHeight": "sm"},
            "fieldConfig": {"defaults": {}, "overrides": []},
            "targets": [{"refId": "A", "datasource": TEMPO, "queryType": "traceql", "query": traceql,
                         "limit": 20, "tableType": "traces"}],
        }, w, h)

    def to_json(self) -> dict[str, Any]:
        return {
            "title": self.title, "uid": self.uid, "description": self.description,
            "tags": ["kvevents"], "timezone": "browser", "editable": True, "graphTooltip": 1,
            "schemaVersion": SCHEMA_VERSION, "version": 1, "refresh": "5s",
            "time": {"from": "now-15m", "to": "now"}, "fiscalYearStartMonth": 0, "liveNow": False,
            "annotations": {"list": [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                                      "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
                                      "name": "Annotations & Alerts", "type": "dashboard"}]},
            "links": [{"title": "kvevents dashboards", "type": "dashboards", "tags": ["kvevents"],
                       "asDropdown": True, "includeVars": True, "keepTime": True}],
            "templating": {"list": self.variables},
            "panels": self.panels,
        }


def _targets(targets: list[tuple[str, str]], *, instant: bool = False) -> list[dict[str, Any]]:
    out = []
    for i, (expr, legend) in enumerate(targets):
        t = {"refId": chr(ord("A") + i), "datasource": PROM, "expr": expr, "legendFormat": legend or "__auto",
             "range": not instant, "instant": instant}
        out.append(t)
    return out


# ---- variables ---------------------------------------------------------------------------------

def ds_var(name: str, kind: str, label: str) -> dict[str, Any]:
    return {"name": name, "label": label, "type": "datasource", "query": kind, "current": {}, "hide": 0,
            "refresh": 1, "regex": "", "options": [], "includeAll": False, "multi": False}


def label_var(name: str, metric_name: str, label: str) -> dict[str, Any]:
    q = f"label_values({metric(metric_name)}, {label})"
    return {"name": name, "label": label, "type": "query", "datasource": PROM,
            "query": {"query": q, "refId": f"{name}-values", "qryType": 1}, "definition": q,
            "includeAll": True, "multi": True, "allValue": ".*", "refresh": 2, "sort": 1, "hide": 0,
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "options": [], "regex": ""}


DS_VARS = [ds_var("datasource", "prometheus", "Prometheus"), ds_var("tempo", "tempo", "Tempo (traces)")]


# ---- the dashboards ----------------------------------------------------------------------------

def pipeline() -> Board:
    b = Board("KV events pipeline", "kvevents-pipeline",
              "Publishers -> ZeroMQ -> subscribers: rates, lag, gaps and their healing by replay, health.",
              DS_VARS + [label_var("publisher", "kvevents.subscriber.received", "publisher")])
    p = 'publisher=~"$publisher"'
    b.row("Overview")
    b.stat("Batches published /s", [(rate("kvevents.publisher.batches"), "")], unit="ops")
    b.stat("Batches received /s", [(rate("kvevents.subscriber.received", p), "")], unit="ops")
    b.stat("Lag p99", [(quantile(0.99, "kvevents.subscriber.lag", p), "")], unit="s",
           thresholds=[(None, "green"), (0.1, "orange"), (1.0, "red")])
    b.stat("Gaps healed (window)", [(f"sum(increase({metric('kvevents.subscriber.recovered')}{{{p}}}"
                                     f"[$__range]))", "")])
    b.stat("Batches lost for good", [(f"sum({metric('kvevents.subscriber.unrecoverable')}{{{p}}})", "")],
           thresholds=[(None, "green"), (1, "red")])
    b.stat("Publishers not SYNCED", [(f'sum({metric("kvevents.subscriber.health")}{{{p}, state!="SYNCED"}})', "")],
           thresholds=[(None, "green"), (1, "red")])
    b.row("Publish")
    b.timeseries("Batches and events published /s", [
        (rate("kvevents.publisher.batches", by="publisher"), "{{publisher}} batches"),
        (rate("kvevents.publisher.events", by="publisher"), "{{publisher}} events")], unit="ops")
    b.timeseries("Bytes published /s", [(rate("kvevents.publisher.bytes", by="publisher"), "{{publisher}}")],
                 unit="Bps")
    b.timeseries("Queue depth and replay ring", [
        (f"sum by (publisher) ({metric('kvevents.publisher.queue.depth')})", "{{publisher}} queued"),
        (f"sum by (publisher) ({metric('kvevents.publisher.ring.batches')})", "{{publisher}} in ring")],
        unit="short")
    b.timeseries("Taken off the live path /s", [
        (rate("kvevents.publisher.overflow"), "queue overflow"),
        (rate("kvevents.publisher.overflow.lost"), "overflow lost for good"),
        (rate("kvevents.publisher.live.dropped"), "injected live drops"),
        (rate("kvevents.publisher.ring.evicted"), "ring evictions")], unit="ops")
    b.timeseries("Replays served /s", [
        (rate("kvevents.publisher.replay.requests"), "requests"),
        (rate("kvevents.publisher.replay.served"), "batches served"),
        (rate("kvevents.publisher.replay.rate_limited"), "rate-limited requests")], unit="ops")
    b.timeseries("Publisher errors /s", [(rate("kvevents.publisher.errors", by="kind"), "{{kind}}")], unit="ops")
    b.row("Receive")
    b.timeseries("Batches received /s", [(rate("kvevents.subscriber.received", p, by="publisher"),
                                          "{{publisher}}")], unit="ops")
    b.timeseries("Lag (receive time - batch ts)", [
        (quantile(0.5, "kvevents.subscriber.lag", p), "p50"),
        (quantile(0.99, "kvevents.subscriber.lag", p), "p99"),
        (f"sum(rate({metric('kvevents.subscriber.lag', '_sum')}{{{p}}}[$__rate_interval])) / "
         f"sum(rate({metric('kvevents.subscriber.lag', '_count')}{{{p}}}[$__rate_interval]))", "mean")], unit="s")
    b.timeseries("Gaps and their healing /s", [
        (rate("kvevents.subscriber.gaps", p), "gaps"),
        (rate("kvevents.subscriber.recovered", p), "batches healed by replay"),
        (rate("kvevents.subscriber.unrecoverable", p), "batches lost for good")], unit="ops")
    b.state_timeline("Health per publisher",
                     f'max by (publisher) ({metric("kvevents.subscriber.health")}{{{p}, state="RECOVERING"}}) '
                     f'+ 2 * max by (publisher) ({metric("kvevents.subscriber.health")}{{{p}, state="STALE"}}) '
                     f'+ 3 * max by (publisher) ({metric("kvevents.subscriber.health")}{{{p}, state="CONNECTING"}})',
                     "{{publisher}}", description="0 SYNCED, 1 RECOVERING (a replay is outstanding), 2 STALE, "
                                                  "3 CONNECTING (nothing heard from the publisher yet).")
    b.timeseries("Resets and malformed input", [
        (f"sum({metric('kvevents.subscriber.resets')}{{{p}}})", "publisher restarts"),
        (f"sum({metric('kvevents.subscriber.malformed')}{{{p}}}) or vector(0)", "malformed frames")],
        unit="short", w=12)
    b.row("Traces")
    b.traces("Recent batch traces (publish -> receive)", '{ span.messaging.system = "zeromq" }',
             description="Send (PRODUCER) and receive/process (CONSUMER) spans of each batch, with replay and "
                         "gap-recovery spans; open one to follow it from the engine step to the router.")
    return b


def tiers() -> Board:
    b = Board("Offload tiers", "kvevents-offload-tiers",
              "The tiered KV offload manager: usage per tier, stores, loads, evictions, promotions, cascades, "
              "store backpressure, pending lookups, transfer jobs.",
              DS_VARS + [label_var("engine", "kvevents.manager.blocks.used", "engine"),
                         label_var("tier", "kvevents.manager.blocks.used", "tier")])
    s = 'engine=~"$engine", tier=~"$tier"'
    e = 'engine=~"$engine"'
    used, cap = metric("kvevents.manager.blocks.used"), metric("kvevents.manager.blocks.capacity")
    b.row("Usage")
    b.timeseries("Blocks held per tier", [(f"sum by (tier) ({used}{{{s}}})", "{{tier}}")], w=12)
    b.timeseries("Usage per tier (held / capacity)", [
        (f"sum by (tier) ({used}{{{s}}}) / sum by (tier) ({cap}{{{s}}})", "{{tier}}")], unit="percentunit", w=12)
    b.row("Traffic")
    b.timeseries("Stores /s", [(rate("kvevents.manager.stores", s, by="tier"), "{{tier}}")], unit="ops")
    b.timeseries("Loads /s", [(rate("kvevents.manager.loads", s, by="tier"), "{{tier}}")], unit="ops")
    b.timeseries("Evictions /s", [(rate("kvevents.manager.evictions", s, by="tier"), "{{tier}}")], unit="ops")
    b.timeseries("Promotions /s (secondary -> primary)",
                 [(rate("kvevents.manager.promotions", s, by="tier"), "from {{tier}}")], unit="ops")
    b.timeseries("Cascades /s (primary -> secondary)",
                 [(rate("kvevents.manager.cascades", s, by="tier"), "to {{tier}}")], unit="ops")
    b.timeseries("Bytes moved /s", [(rate("kvevents.manager.bytes", s, by="tier, direction"),
                                     "{{tier}} {{direction}}")], unit="Bps")
    b.row("Backpressure and asynchronous lookups")
    b.timeseries("Stores skipped /s (a tier behind: never written or announced)",
                 [(rate("kvevents.manager.stores.skipped", s, by="tier"), "{{tier}}")], unit="ops")
    b.timeseries("Store backlog (blocks queued per tier)",
                 [(f"sum by (tier) ({metric('kvevents.manager.store.backlog')}{{{s}}})", "{{tier}}")])
    b.timeseries("Pending lookups /s (asked again next step)",
                 [(rate("kvevents.manager.lookups.pending", s, by="tier"), "{{tier}}")], unit="ops")
    b.timeseries("Tier faults /s by kind (damaged files dropped, failed writes, space not given back)",
                 [(rate("kvevents.manager.tier.faults", s, by="tier, kind"), "{{tier}} {{kind}}")], unit="ops")
    b.row("Transfer jobs")
    b.timeseries("Job latency p50 / p99", [
        (quantile(0.5, "kvevents.manager.job.duration", s, by="tier, direction"), "p50 {{tier}} {{direction}}"),
        (quantile(0.99, "kvevents.manager.job.duration", s, by="tier, direction"), "p99 {{tier}} {{direction}}")],
        unit="s", w=12)
    b.timeseries("Job failures (total)", [
        (f"sum by (tier, direction) ({metric('kvevents.manager.job.failures')}{{{s}}})",
         "{{tier}} {{direction}}")], w=12)
    b.row("Engines")
    tok = metric("kvevents.engine.tokens")
    b.timeseries("Prompt tokens /s by how they were served",
                 [(rate("kvevents.engine.tokens", e, by="kind"), "{{kind}}")], unit="ops", stack=True)
    b.timeseries("Prefix hit ratio", [
        (f'sum(rate({tok}{{{e}, kind=~"gpu_hit|offload_hit"}}[$__rate_interval])) / '
         f"sum(rate({tok}{{{e}}}[$__rate_interval]))", "all tiers"),
        (f'sum(rate({tok}{{{e}, kind="offload_hit"}}[$__rate_interval])) / '
         f"sum(rate({tok}{{{e}}}[$__rate_interval]))", "offload tiers")], unit="percentunit")
    b.timeseries("Scheduler steps and requests /s", [
        (rate("kvevents.manager.steps", e, by="engine"), "{{engine}} steps"),
        (rate("kvevents.engine.requests", e, by="engine"), "{{engine}} requests")], unit="ops")
    b.row("Traces")
    b.traces("Scheduler steps and transfer jobs", '{ name =~ "kvevents.manager.*" }',
             description="A span per scheduler step (on_schedule_end) with the jobs it flushed, and a span per "
                         "transfer job (direction, tier, blocks, bytes, success).")
    return b


def routing() -> Board:
    b = Board("KV-aware routing", "kvevents-routing",
              "The router's index fed by KV events: size per tier, what scored prompts matched, offload events "
              "waiting for their GPU event.", DS_VARS)
    b.row("Index")
    b.timeseries("Index entries per tier", [(f"sum by (tier) ({metric('kvevents.router.entries')})", "{{tier}}")],
                 w=12, stack=True)
    b.timeseries("Index memory per tier", [(f"sum by (tier) ({metric('kvevents.router.index.size')})",
                                            "{{tier}}")], unit="bytes", w=12, stack=True)
    b.timeseries("Batches and events applied /s", [
        (rate("kvevents.router.batches"), "batches"), (rate("kvevents.router.events"), "events")], unit="ops")
    b.timeseries("Removals /s", [(rate("kvevents.router.removals", by="outcome"), "{{outcome}}")], unit="ops")
    b.timeseries("Entries evicted by the budget /s", [(rate("kvevents.router.evicted"), "evicted")], unit="ops")
    b.row("Routing")
    matched, prompt = metric("kvevents.router.matched.tokens"), metric("kvevents.router.prompt.tokens")
    b.timeseries("Hit tokens /s by tier", [(rate("kvevents.router.matched.tokens", by="tier"), "{{tier}}")],
                 unit="ops", stack=True)
    b.timeseries("Prefix hit ratio of scored prompts", [
        (f"sum(rate({matched}[$__rate_interval])) / sum(rate({prompt}[$__rate_interval]))", "all tiers"),
        (f"sum by (tier) (rate({matched}[$__rate_interval])) / scalar(sum(rate({prompt}[$__rate_interval])))",
         "{{tier}}")], unit="percentunit")
    b.timeseries("Lookups /s", [(rate("kvevents.router.lookups"), "score() calls")], unit="ops")
    b.row("Joining offload events")
    b.timeseries("Unjoined offload events /s by outcome",
                 [(rate("kvevents.router.offload.unjoined", by="outcome"), "{{outcome}}")], unit="ops", w=12,
                 description="Offload events (no block size, no tokens) that arrived before the GPU event they "
                             "join: held, then resolved, expired, dropped or cancelled.")
    b.timeseries("Offload events waiting", [(f"sum({metric('kvevents.router.offload.pending')})", "pending")],
                 w=12)
    b.row("Stream health")
    b.timeseries("Gaps, resets and bad input (total)", [
        (f"sum({metric('kvevents.router.gaps')})", "unrecoverable gaps (pod unreliable)"),
        (f"sum({metric('kvevents.router.resets')})", "pod resets"),
        (f"sum({metric('kvevents.router.errors')}) or vector(0)", "bad input")], w=24, h=6)
    b.row("Traces")
    b.traces("Router score spans", '{ name =~ "kvevents.router.*" }',
             description="One span per score()/pick(): prompt tokens, pods scored, best pod, matched tokens.")
    return b


BOARDS = {"kvevents-pipeline.json": pipeline, "kvevents-offload-tiers.json": tiers,
          "kvevents-routing.json": routing}


def render() -> dict[str, str]:
    """File name -> JSON text of every dashboard."""
    return {name: json.dumps(fn().to_json(), indent=2, sort_keys=False) + "\n" for name, fn in BOARDS.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a committed file is stale")
    ap.add_argument("--out", type=Path, default=HERE, help="directory to write into (default: dashboards/)")
    args = ap.parse_args(argv)
    stale = []
    for name, text in render().items():
        path = args.out / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print(f"stale: {', '.join(stale)} (run python dashboards/generate.py)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
