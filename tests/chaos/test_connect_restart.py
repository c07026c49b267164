"""Connect mode without a replay endpoint: a publisher killed -9 and restarted whose new run is
already past the old seq is a RESET (counted as unverified), never a gap followed by the new run
spliced on. Nothing can verify the run (no replay socket to fingerprint-check), so the SUB
socket's reconnect itself is the RESET, as bind mode does without a replay endpoint."""

from __future__ import annotations

import signal

from kvevents import DeliveryKind, Subscriber

from ..pubsub_helpers import collect, ipc_pair
from .kill9 import judge, run_of, start_publisher

BATCH, RESET, GAP = DeliveryKind.BATCH, DeliveryKind.RESET, DeliveryKind.GAP


def _batches_of(got, run: int) -> int:
    return sum(1 for d in got if d.kind is BATCH and run_of(d) == run)


def test_connect_mode_restart_without_replay_past_the_old_seq_is_a_reset_not_a_splice() -> None:
    ep, rep = ipc_pair()
    sub = Subscriber([(ep, None, "p")], tail_probe_after=None)
    proc = start_publisher(ep, rep, 1, "--no-replay")
    got: list = []
    try:
        got += collect(sub, lambda g: _batches_of(g, 1) >= 20)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        # the new run is far past the old one's seq when its first frame arrives
        proc = start_publisher(ep, rep, 2, "--from", "100000", "--no-replay")
        got += collect(sub, lambda g: _batches_of(got + g, 2) >= 20)
    finally:
        proc.kill()
        proc.wait()
        sub.close()
    r = judge(got)
    assert r["splices"] == 0 and r["disorder"] == 0, r
    assert r["resets"] == 1, r
    after = got[[d.kind for d in got].index(RESET) + 1:]
    # 0..99999 never published by run 2 (and what its connection dropped before the subscription
    # took hold): one GAP, then run 2's batches in order
    assert after[0].kind is GAP and after[0].seq == 0 and after[0].missed >= 100000, after[:2]
    assert after[1].kind is BATCH and after[1].seq == after[0].missed
    assert all(run_of(d) == 2 for d in after if d.kind is BATCH)
    h = sub.health()["p"]
    assert (h.reconnects, h.resets, h.unverified_resets) == (1, 1, 1), h
    assert sub.stats()["unverified_resets"] == 1
