"""``kvevents demo --serve``: the router proxy in front of simulated engines, real HTTP load."""

from __future__ import annotations

import ast
import io

from kvdemo.serve import run_serve


def test_demo_serve_routes_real_http_through_the_proxy() -> None:
    out = io.StringIO()
    rc = run_serve(1.5, 2, 0, out, concurrency=4)
    text = out.getvalue()
    assert rc == 0, text
    assert "kvevents router: listening on http://127.0.0.1:" in text and "proxy" in text
    assert "errors none" in text
    answered = int(text.split(" answered")[0].rsplit(", ", 1)[1])
    assert answered > 0
    by_pod = ast.literal_eval(text.split("by pod: ")[1].splitlines()[0])
    assert set(by_pod) <= {"engine-0", "engine-1"} and sum(by_pod.values()) == answered
    assert "SIMULATED engines" in text
