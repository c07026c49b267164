"""The dashboards against a real Prometheus: the demo serves its metrics, Prometheus (Debian
package ``prometheus``, installed by ``.ci/run``) scrapes it every second, and EVERY PromQL
query of every dashboard returns data through Prometheus's HTTP API. The demo then stops on
SIGTERM, cleanly, with its summary."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "dashboards"))

import queries as dq  # noqa: E402  (dashboards/queries.py)

PROMETHEUS = os.environ.get("KVEVENTS_PROMETHEUS", "/usr/bin/prometheus")
INSTALL_HINT = ("Prometheus is not installed: install the Debian package with `apt-get install -y prometheus` "
                "(as root, after `apt-get update`; .ci/run does this), or point KVEVENTS_PROMETHEUS at a "
                "prometheus binary")
DEADLINE_S = 45.0


def _prometheus_binary() -> str:
    path = PROMETHEUS if os.path.isfile(PROMETHEUS) else shutil.which("prometheus")
    if not path or not os.access(path, os.X_OK):
        pytest.fail(INSTALL_HINT, pytrace=False)
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Lines:
    """Reads a process's stdout on a thread (so the pipe never fills) and keeps every line."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self.cond = threading.Condition()
        self.closed = False
        self._t = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._t.start()

    def _pump(self, stream) -> None:
        for line in stream:
            with self.cond:
                self.lines.append(line)
                self.cond.notify_all()
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> re.Match | None:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for line in self.lines:
                    m = rx.search(line)
                    if m:
                        return m
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    return None
                self.cond.wait(left)

    def text(self) -> str:
        self._t.join(timeout=10)
        return "".join(self.lines)


def _api(base: str, path: str, **params) -> dict:
    url = f"{base}{path}?{urllib.parse.urlencode(params)}"
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            body, status = resp.read(), resp.status
    except urllib.error.HTTPError as exc:  # a bad query is a 400 with a JSON error body
        body, status = exc.read(), exc.code
    except (urllib.error.URLError, OSError) as exc:  # not listening yet
        return {"status": "unreachable", "error": str(exc)}
    try:
        answer = json.loads(body or b"{}")
    except ValueError:  # e.g. "Service Unavailable" while Prometheus is still starting up
        return {"status": "not-json", "http_status": status, "body": body[:200].decode(errors="replace")}
    return answer | {"http_status": status} if status != 200 else answer


def _has_data(answer: dict) -> bool:
    if answer.get("status") != "success":
        return False
    data = answer["data"]
    if data["resultType"] in ("scalar", "string"):
        return True
    for series in data["result"]:
        value = float(series["value"][1])
        if not math.isnan(value):
            return True
    return False


def _stop(proc: subprocess.Popen, sig=signal.SIGTERM, timeout: float = 20.0) -> None:
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_every_dashboard_query_returns_data_from_a_real_prometheus(tmp_path):
    binary = _prometheus_binary()
    all_queries = dq.queries()
    assert all_queries
    start = time.monotonic()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    demo = subprocess.Popen(
        [sys.executable, "-m", "kvevents.cli", "demo", "--duration", "300", "--engines", "2", "--no-baseline",
         "--prometheus-port", "0", "--record", str(tmp_path / "demo.kvrec")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    out = _Lines(demo.stdout)
    prom = None
    try:
        m = out.wait_for(r"metrics: http://127\.0\.0\.1:(\d+)/metrics", 30)
        assert m, "the demo did not announce its metrics endpoint:\n" + "".join(out.lines) + demo.stderr.read()
        metrics_port = int(m.group(1))
        web = _free_port()
        (tmp_path / "prometheus.yml").write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: kvevents-demo\n    scrape_interval: 1s\n    scrape_timeout: 1s\n"
            f"    static_configs:\n      - targets: ['127.0.0.1:{metrics_port}']\n")
        prom_log = open(tmp_path / "prometheus.log", "w")
        prom = subprocess.Popen(
            [binary, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{web}", "--storage.tsdb.retention.time=1h"],
            stdout=prom_log, stderr=subprocess.STDOUT, cwd=tmp_path)
        base = f"http://127.0.0.1:{web}"
        deadline = start + DEADLINE_S

        def prom_log_tail() -> str:
            prom_log.flush()
            return (tmp_path / "prometheus.log").read_text()[-3000:]

        # 1. Prometheus is up and has scraped the demo at least twice (rate() needs two samples)
        scraped = False
        while time.monotonic() < deadline and not scraped:
            assert prom.poll() is None, "prometheus exited:\n" + prom_log_tail()
            try:
                a = _api(base, "/api/v1/query", query='count_over_time(up{job="kvevents-demo"}[1m])')
                scraped = _has_data(a) and float(a["data"]["result"][0]["value"][1]) >= 2 and _has_data(
                    _api(base, "/api/v1/query", query='up{job="kvevents-demo"} == 1'))
            except (urllib.error.URLError, ConnectionError, OSError):
                pass  # not listening yet
            if not scraped:
                time.sleep(0.2)  # polling Prometheus's API, bounded by the deadline
        assert scraped, f"Prometheus did not scrape the demo within {DEADLINE_S}s:\n" + prom_log_tail()

        # 2. every query returns data; re-ask the ones still empty until the deadline
        pending = {(q.dashboard, q.panel_id, q.panel, q.ref): q for q in all_queries}
        last: dict = {}
        while pending and time.monotonic() < deadline:
            for key, q in list(pending.items()):
                a = _api(base, "/api/v1/query", query=dq.runnable(q.expr))
                if a.get("status") in ("unreachable", "not-json"):  # a transient answer: ask again
                    last[key] = a
                    continue
                assert a.get("status") == "success", f"{key}: Prometheus rejected {q.expr!r}: {a}"
                if _has_data(a):
                    del pending[key]
                else:
                    last[key] = a
            if pending:
                time.sleep(0.5)
        assert not pending, "queries without data:\n" + "\n".join(
            f"  {k}: {q.expr}\n    -> {json.dumps(last.get(k))[:300]}" for k, q in pending.items())
    finally:
        if prom is not None:
            _stop(prom)
            prom_log.close()
        _stop(demo)
    text = out.text()
    err = demo.stderr.read()
    assert demo.returncode == 0, text[-3000:] + err
    assert "summary (stopped by SIGTERM" in text and "SILENTLY LOST 0" in text, text[-3000:]
    assert "Traceback" not in err, err
