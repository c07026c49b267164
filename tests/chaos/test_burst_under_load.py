"""The chaos suite's burst-under-load run, short (the full one: ``benchmarks/chaos.py --set bursts``).

Four publisher processes in bursts, the cores kept busy by a bounded burner process per core
(stopped when the run ends), two router ingest sides (``Fleet``) reading them, one deliberate
restart. A small replay ring (300 batches) makes a lagging subscriber fall more than a ring
behind within seconds, as vLLM's 10,000 do in the full run. Every router sees exactly the
restarts as RESETs, and still scores every pod."""

from __future__ import annotations

import os

from benchmarks import chaos_bursts


def test_bursts_under_load_reset_only_on_restarts_and_exclude_no_pod(tmp_path):
    r = chaos_bursts.run(seconds=8.0, restarts=1, burners=os.cpu_count() or 2, seed=20261127,
                         workdir=str(tmp_path), burst=20000, tcp=True, routers=2, ring=300)
    table = chaos_bursts.rows(r)
    print("\n".join(" ".join(str(c) for c in row) for row in table))
    for router in r["routers"]:
        for p in router["pods"]:
            assert p["resets"] == p["restarts"], (p, table)
            assert p["routed"], (p, table)
    assert [p["restarts"] for p in r["routers"][0]["pods"]] == [1, 0, 0, 0]
