"""The chaos suite's ``plane`` set in its short form (``python benchmarks/chaos.py --set plane``
runs it in full): forged messages on the pods' subjects while writers publish, with and without
the plane's permissions, and snapshots a replica must not trust — against real nats-servers."""

from __future__ import annotations

import pytest

from tests.chaos.plane_attacks import SNAPSHOT_CASES, forgery_run, snapshot_run


@pytest.mark.parametrize("secured", [False, True])
def test_forgeries_drop_no_real_batch_silently(secured) -> None:
    r = forgery_run(batches=300, forgeries=60, secured=secured, seed=3)
    assert r["forged"] == 60
    assert r["silent"] == 0, r  # every real batch delivered, reported as a GAP, or counted as a conflict
    assert r["delivered"] + r["reported"] + r["conflict_dropped"] == r["published"]
    if secured:  # the server refused every forgery: nothing reached the reader
        assert r["forged_stored"] == 0 and r["rejected"] == r["malformed"] == r["conflicts"] == 0
        assert r["delivered"] == r["published"] and r["forged_accepted"] == 0
    else:  # stored (old-style ids aimed at the same seq twice are one for JetStream); each one that
        # cannot follow is rejected, garbage is malformed, a well-formed one at the next seq either
        # won the race (applied: its real batch dropped as a conflict) or came second (a conflict)
        assert r["forged_stored"] > 40
        assert r["rejected"] >= 30 and r["malformed"] == 10
        assert r["conflict_dropped"] <= r["forged_accepted"]


@pytest.mark.parametrize("case", SNAPSHOT_CASES)
def test_snapshots_a_replica_must_not_trust_leave_no_wrong_index(case) -> None:
    r = snapshot_run(case)
    assert r["foreign_pods"] == r["wrong_index"] == r["missing"] == 0, r
    if case != SNAPSHOT_CASES[1]:  # damaged positions outside the body are simply not read
        assert r["refused"] == 1 and not r["restored"] and r["reason"] != "-"
