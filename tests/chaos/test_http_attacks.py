"""The chaos suite's ``http`` set in its short form (benchmarks/chaos_http.py --quick): every HTTP
attack against a live router service process, each checked against the targets the full run
prints — RSS bounded, the well-behaved client and the health probes answered throughout, each
attack's own limit hit and counted, no 5xx but the limits' 503s, no internal error, no traceback
in the service's log."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.chaos_http import ATTACKS, bounded, run_all, scale_of  # noqa: E402


@pytest.fixture(scope="module")
def results():
    return {r["attack"]: r for r in run_all(quick=True)}


def test_every_attack_ran(results):
    assert list(results) == list(ATTACKS)


@pytest.mark.parametrize("attack", ATTACKS)
def test_rss_bounded_and_a_well_behaved_client_served_throughout(results, attack):
    r = results[attack]
    assert bounded(r), (attack, r["rss"], r["budget"])
    assert r["ok"] > 0 and r["failed"] == 0, (attack, r["ok"], r["failed"])
    assert r["probes"][0] > 0 and r["probes"][1] == 0, (attack, r["probes"])
    assert r["internal"] == 0 and r["tracebacks"] == 0, (attack, r["internal"], r["tracebacks"])


def test_each_attack_hits_its_own_limit(results):
    sc = scale_of(True)
    idle = results["idle"]
    assert idle["limits"]["connections"] > 0  # more connections than the cap: the reserve's oldest dropped
    assert idle["limits"]["header_timeout"] > 0  # the ones let in: closed at the header timeout
    assert idle["limits"]["connections"] + idle["limits"]["header_timeout"] >= sc["conns"] // 2
    assert results["slow-head"]["limits"]["header_timeout"] == results["slow-head"]["stats"]["opened"]
    body = results["slow-body"]["limits"]
    assert body["buffered_bytes"] > 0 and body["body_timeout"] > 0
    assert body["buffered_bytes"] + body["body_timeout"] == results["slow-body"]["stats"]["opened"]
    assert results["unread"]["limits"]["idle_timeout"] >= sc["unread"]
    for attack in ("malformed", "bad-bodies"):
        r = results[attack]
        assert r["status"][400] >= r["stats"]["requests"] > 0 and r["status"][500] == 0, (attack, r)
