"""Router replicas on the event plane, against a real nats-server: warm restart from a
snapshot after kill -9, the purge lease and covers, corrupt snapshots."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import nats

from kvevents.transport.nats.publisher import NatsEventPublisher
from kvservice.replica import Replica
from tests.plane_helpers import nats_server, stream_state, wait_for  # noqa: F401
from tests.plane_ledger import LedgerRouter
from tests.pubsub_helpers import batch

ROOT = Path(__file__).resolve().parent.parent
LEDGER = "tests.plane_ledger:LedgerRouter"


def _publisher(url: str, pod: str):
    # a window larger than any run these tests publish: publish() never blocks, so a smaller
    # window overflows (drops, counted, then a GAP) on a loaded machine, and the replicas'
    # entry counts below would depend on the machine's speed
    return NatsEventPublisher(endpoint=url, topic=f"kv@{pod}@m", window=4096)


def _publish(url: str, pod: str, start: int, n: int) -> None:
    pub = _publisher(url, pod)
    for i in range(start, start + n):
        pub.publish(batch(i, 2))
    assert pub.shutdown(30).clean
    assert pub.counts["overflow"] == 0, pub.counts


def _replica_proc(url: str, name: str, status: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "kvservice.replica", "--nats", url, "--name", name,
                             "--router", LEDGER, "--snapshot-every", "0.2", "--heartbeat", "0.2", "--ttl", "3",
                             "--status-file", str(status), *extra], env=env, cwd=ROOT)


def _status(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _caught_up(path: Path, url: str, **want) -> dict | None:
    st = _status(path)
    last = stream_state(url)[1]
    if st and st["position"] >= last and all(st["replica"].get(k, 0) >= v for k, v in want.items()):
        return st
    return None


def test_replica_killed_and_restarted_converges_to_the_never_stopped_one(nats_server, tmp_path) -> None:
    url = nats_server.url
    a_file, b_file = tmp_path / "a.json", tmp_path / "b.json"
    a = _replica_proc(url, "a", a_file)
    b = _replica_proc(url, "b", b_file)
    b2 = None
    try:
        _publish(url, "pod-1", 0, 300)
        _publish(url, "pod-2", 0, 300)
        # b has read it all and covers it (its own snapshot, or a's it started from)
        wait_for(lambda: _caught_up(b_file, url) and _status(b_file)["covered"] >= 400, "replica b caught up and covered")
        os.kill(b.pid, signal.SIGKILL)
        b.wait()
        _publish(url, "pod-1", 300, 200)  # the stream moves on while b is dead ...
        _publish(url, "pod-2", 0, 50)  # ... and pod-2's engine restarts: a RESET in the stream
        b_file.unlink()
        b2 = _replica_proc(url, "b", b_file)
        wait_for(lambda: _caught_up(a_file, url) and _caught_up(b_file, url), "both replicas at the stream's end")
        sa, sb = _status(a_file), _status(b_file)
        assert sb["replica"]["cold_starts"] == 0 and sb["replica"]["restored_seq"] >= 400  # warm, from a snapshot
        assert sb["ready"] and sa["ready"]
        assert sb["digest"] == sa["digest"]  # the whole state, not a score
        assert sb["entries"] == sa["entries"] == 200 + 50  # both engine restarts cleared their pod
        assert sb["source"]["stream_gaps"] == sa["source"]["stream_gaps"] == 0
    finally:
        for p in (a, b, b2):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(30)


def _step_until(replicas, cond, what):
    return wait_for(cond, what, pump=lambda: [r.step(10) for r in replicas])


def test_purge_never_removes_what_a_live_replica_has_not_covered(nats_server) -> None:
    url = nats_server.url
    _publish(url, "pod-1", 0, 200)
    a = Replica(url, "a", router_factory=LedgerRouter, snapshot_every=0.05, heartbeat=0.05, ttl=3)
    b = Replica(url, "b", router_factory=LedgerRouter, snapshot_every=3600, heartbeat=0.05, ttl=3)  # never snapshots
    try:
        _step_until([a, b], lambda: a.covered >= 200 and b.source.acked >= 200, "a covers the stream")
        for _ in range(20):  # heartbeats with purge attempts: b covers nothing, so nothing may go
            a.step(10)
            b.step(10)
        wait_for(lambda: a.counters["purged"] + b.counters["purged"] == 0 and stream_state(url)[0] == 200,
                 "nothing purged while b covers nothing")
        assert stream_state(url)[0] == 200
        b.save_snapshot(wait=True)  # now b covers up to 200 too
        # purged up to both covers, except the pod's last message (a restarting engine reads its run there)
        # (the purger counts after the purge returns: wait for the count too, not only the stream)
        _step_until([a, b], lambda: stream_state(url)[0] == 1 and a.counters["purged"] + b.counters["purged"] >= 199,
                    "the stream purged up to both covers")
        assert a.counters["purged"] + b.counters["purged"] == 199
        _publish(url, "pod-1", 200, 10)
        _step_until([a, b], lambda: a.source.acked >= 211 and b.source.acked >= 211, "both read the rest (a RESET and 10)")
        c = Replica(url, "c", router_factory=LedgerRouter, snapshot_every=3600, heartbeat=0.05, ttl=3)
        try:  # a newcomer after the purge: the newest snapshot, then the rest of the stream
            _step_until([a, b, c], lambda: c.source.acked >= 211, "c caught up")
            assert c.counters["cold_starts"] == 0 and c.counters["restored_seq"] >= 200
            assert c.router.digest() == a.router.digest() == b.router.digest()
        finally:
            c.close()
    finally:
        a.close()
        b.close()


def test_corrupt_snapshot_is_refused_and_counted_then_the_next_one_restores(nats_server) -> None:
    url = nats_server.url
    _publish(url, "pod-1", 0, 50)
    a = Replica(url, "a", router_factory=LedgerRouter, snapshot_every=0.05, heartbeat=0.05, ttl=3, purge=False)
    try:
        _step_until([a], lambda: a.covered >= 50, "a snapshot saved")
    finally:
        a.close()

    async def plant():  # a damaged snapshot that claims to be the newest
        from nats.js import api
        nc = await nats.connect(url)
        obs = await nc.jetstream().object_store("kvrouter-snapshots")
        good = (await obs.get("a")).data
        await obs.put("z", good[:-7], meta=api.ObjectMeta(name="z", description=json.dumps({"stream_seq": 10_000})))
        await nc.close()
    asyncio.run(plant())
    c = Replica(url, "c", router_factory=LedgerRouter, purge=False)
    try:
        assert c.counters["restore_failures"] == 1 and "checksum" in c.failures[0] and "'z'" in c.failures[0]
        assert c.counters["cold_starts"] == 0 and c.counters["restored_seq"] == 50
        assert c.router.entries() == 50
    finally:
        c.close()


def test_a_purge_between_choosing_a_snapshot_and_publishing_the_cover_is_caught(nats_server) -> None:
    url = nats_server.url
    _publish(url, "pod-1", 0, 100)
    a = Replica(url, "a", router_factory=LedgerRouter, snapshot_every=0.05, heartbeat=0.05, ttl=3)
    try:
        _step_until([a], lambda: a.covered >= 100, "a covers the first 100")

        class Racy(Replica):  # the race, made to happen: after c chose a's snapshot at 100 and
            raced = False     # before its cover is out, a saves a newer one and purges up to it

            def _warm_start(self, newer_than=-1):
                got = super()._warm_start(newer_than)
                if not Racy.raced:
                    Racy.raced = True
                    _publish(url, "pod-1", 100, 50)
                    _step_until([a], lambda: a.covered >= 151, "a covers the next 50 (a RESET and 50)")
                    a.save_snapshot(wait=True)
                    _step_until([a], lambda: a.counters["purged"] >= 100, "a purged up to its cover")
                return got
        c = Racy(url, "c", router_factory=LedgerRouter, snapshot_every=3600, heartbeat=0.05, ttl=3)
        try:
            assert c.counters["restart_rechecks"] == 1 and c.counters["restored_seq"] >= 151
            assert c.counters["purged_before_read"] == 0
            _step_until([a, c], lambda: c.source.acked >= a.source.acked, "c caught up")
            assert c.router.digest() == a.router.digest()
        finally:
            c.close()
    finally:
        a.close()


def test_replica_rides_through_a_nats_server_restart(nats_server) -> None:
    url = nats_server.url
    _publish(url, "pod-1", 0, 100)
    a = Replica(url, "a", router_factory=LedgerRouter, snapshot_every=0.1, heartbeat=0.1, ttl=3)
    try:
        _step_until([a], lambda: a.source.acked >= 100, "a read the first 100")
        nats_server.restart()  # file storage: the stream, buckets and consumer survive
        _publish(url, "pod-1", 100, 100)  # a new run: a RESET and 100 batches
        _step_until([a], lambda: a.source.acked >= 201, "a read on after the restart")
        assert a.source.stats()["stream_gaps"] == 0
        assert a.router.entries() == 100
        b = Replica(url, "b", router_factory=LedgerRouter, snapshot_every=3600, heartbeat=0.1, ttl=3)
        try:
            _step_until([a, b], lambda: b.source.acked >= 201, "b caught up")
            assert b.router.digest() == a.router.digest()
        finally:
            b.close()
    finally:
        a.close()
