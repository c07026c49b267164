"""kill -9 at random points, with restart: publisher (the subscriber must say RESET or continue
correctly, never splice two runs) and recorder (the file stays readable, a prefix of what it got)."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time


from kvevents.recording import RecordingReader

from ..pubsub_helpers import ipc_pair
from .kill9 import ROOT, kill_restart_rounds, start_publisher


def test_kill_9_of_the_publisher_at_random_points_never_splices():
    r = kill_restart_rounds(3, random.Random(1234))
    assert r["splices"] == 0 and r["disorder"] == 0, r
    assert r["resets"] == r["restarts"], r


def test_kill_9_of_the_recorder_leaves_a_readable_prefix(tmp_path):
    pub_ep, rep_ep = ipc_pair()
    proc = start_publisher(pub_ep, rep_ep, 1)
    out = tmp_path / "k.kvrec"
    rec = None
    try:
        for i in range(3):
            rec = subprocess.Popen([sys.executable, "-m", "kvevents.cli_record", "record", pub_ep, "--replay", rep_ep,
                                    "-q", "-o", str(out)] + (["--append"] if i else []), cwd=ROOT)
            end = time.monotonic() + 30
            want = 20 * (i + 1) + random.Random(i).randrange(30)
            while time.monotonic() < end:
                if out.exists():
                    with RecordingReader(out) as r:
                        if sum(1 for _ in r) >= want:
                            break
                time.sleep(0.02)  # polling a file another process appends to
            rec.send_signal(signal.SIGKILL)
            rec.wait()
            with RecordingReader(out) as r:
                recs = list(r)
                assert r.bad_records == 0 and r.undecodable == 0 and len(recs) >= want
                seqs = [x.seq for x in recs if x.socket == "pub"]
                assert seqs == sorted(seqs)
    finally:
        for p in (proc, rec):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def test_kill_9_of_a_late_joining_subscriber_continues_correctly():
    from .kill9 import kill_subscriber_rounds

    r = kill_subscriber_rounds(3, random.Random(99))
    assert r["restarts"] == 3 and r["batches"] >= 15
    assert (r["disorder"], r["silent"], r["splices"]) == (0, 0, 0), r


def test_kill_9_of_a_bind_mode_publisher_at_random_points_never_splices():
    """The publisher connects to the subscriber's bound socket: restarts are found from the connections.
    (No idle probe: a restart slower than it, as on a loaded machine, is found by the probe, and a
    run killed before its first live frame then counts no reconnect.)"""
    r = kill_restart_rounds(3, random.Random(4321), bind=True, tail_probe_after=None)
    assert r["splices"] == 0 and r["disorder"] == 0, r
    assert r["resets"] == r["restarts"] == r["reconnects"], r
