"""Attacks on the event plane (issue 24), shared by ``tests/chaos/test_plane_attacks.py`` (short)
and ``benchmarks/chaos_plane.py`` (full, a table): each starts its own nats-server(s).

* :func:`forgery_run`: writers (our ``"nats"`` publisher, one per pod, the real writer classes)
  publish batches while an attacker who can read the stream publishes forgeries on the pods'
  subjects, each kind of :data:`FORGERIES` in turn: a huge run, a seq far ahead, the next seq
  under the id the plane used to give it, the next seq under a well-formed id, a RESET skipping
  runs, garbage — at pods already live in the stream (a pod's very first message has nothing
  before it to be checked against: the server's permissions are what protects it). Then a fresh reader reads the whole stream and every pod's deliveries are
  judged against what its writer published: a real batch delivered, covered by a GAP
  (reported), dropped as a conflict (counted: a well-formed forgery that won the race to the
  pod's next seq was applied in its place), or none of these (**silently dropped**, target 0).
  A delivered batch that is not the writer's is a forgery accepted. With ``secured`` the server has the
  plane's users and permissions and the attacker logs in as a replica: nothing of his is stored.
* :func:`snapshot_run`: a replica starts on a snapshot bucket holding a snapshot it must not
  trust (the stream deleted and re-created; damaged positions in the description; a damaged
  body; the format before the envelope) and its index is compared with a cold read of the
  stream: **serving another stream's index** (target 0) or missing batches it should hold.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import tempfile
import threading
from pathlib import Path

from kvevents import DeliveryKind
from kvevents.transport.nats.publisher import NatsEventPublisher
from kvevents.transport.nats.wire import MSG_ID, parse_headers, plane_headers, subject_for
from tests.plane_helpers import NatsServer, on_jetstream, read_all, stream_state, wait_for
from tests.plane_ledger import LedgerRouter
from tests.pubsub_helpers import batch

BATCH, GAP = DeliveryKind.BATCH, DeliveryKind.GAP
FORGERIES = ("huge-run", "seq-ahead", "next-seq-old-id", "next-seq-wellformed-id", "reset-skipping-runs", "garbage")
USERS = lambda pods: [  # noqa: E731 - the plane's users for a run with these pods
    {"user": "admin", "password": "pw-admin", "role": "admin"},
    {"user": "writer", "password": "pw-w", "role": "bridge", "pods": [("m", p) for p in pods]},
    {"user": "replica-x", "password": "pw-x", "role": "replica", "name": "x"},
    {"user": "reader", "password": "pw-r", "role": "reader", "name": "judge"},
]


def _forgery(kind: str, pod: str, last, rnd: random.Random) -> tuple[dict | None, bytes]:
    """One forged message; ``last``: the pod's last plane message the attacker read (a PlaneMsg)."""
    run = last.run if last else 0
    nxt = last.seq + last.count if last and last.kind == "batch" else 0
    topic = f"kv@{pod}@m"
    body = b"\x93forged" + rnd.randbytes(8)
    if kind == "huge-run":
        return plane_headers("batch", pod, topic, 0, nxt, 10 ** 12, model="m"), body
    if kind == "seq-ahead":
        return plane_headers("batch", pod, topic, 0, nxt + 1000, run, model="m"), body
    if kind == "next-seq-old-id":
        h = plane_headers("batch", pod, topic, 0, nxt, run, model="m")
        h[MSG_ID] = f"{pod}:{run}:batch:{nxt}"
        return h, body
    if kind == "next-seq-wellformed-id":
        return plane_headers("batch", pod, topic, 0, nxt, run, model="m"), body
    if kind == "reset-skipping-runs":
        return plane_headers("reset", pod, topic, 0, 0, run + 5, model="m"), b""
    return {"Kv-Kind": rnd.choice(["batch", "x", ""]), "Kv-Pod": pod, "Kv-Seq": str(rnd.randrange(-5, 10 ** 6))}, body


def _attacker(url: str, pods: list[str], n: int, seed: int, started: threading.Event, out: dict) -> None:
    import nats

    rnd = random.Random(seed)

    async def go():
        nc = await nats.connect(url, error_cb=_quiet, max_reconnect_attempts=-1)
        js = nc.jetstream()
        seen: dict = {}
        mine: set = set()
        started.set()
        try:
            i = 0
            while i < n:
                kind = FORGERIES[i % len(FORGERIES)]
                pod = rnd.choice(pods)
                subject = subject_for("kvevents", "m", pod)
                try:  # an attacker who reads the stream aims at a live pod's next seq
                    held = await js.get_last_msg("KVEVENTS", subject)
                    if (held.headers or {}).get(MSG_ID) not in mine:
                        seen[pod] = parse_headers(held.headers)
                except Exception:
                    pass  # nothing of it yet, or the last one is a forgery of ours that does not parse
                if pod not in seen:
                    await asyncio.sleep(0.001)  # forgeries go at live pods (a pod's first message: see docs)
                    continue
                h, body = _forgery(kind, pod, seen[pod], rnd)
                if h and MSG_ID in h:
                    mine.add(h[MSG_ID])
                await nc.publish(subject, body, headers=h)
                out[kind] = out.get(kind, 0) + 1
                i += 1
                if i % 8 == 0:
                    await nc.flush()
                    await asyncio.sleep(0.001)  # interleaved with the writers, not one burst
            await nc.flush()
        finally:
            await nc.close()
    asyncio.run(go())


async def _quiet(exc) -> None:  # a refused publish comes back as an error: the run counts the result
    return None


def forgery_run(*, batches: int, forgeries: int, pods: int = 3, secured: bool = False, seed: int = 1) -> dict:
    names = [f"pod-{i}" for i in range(pods)]
    tmp = Path(tempfile.mkdtemp(prefix="kvchaos-plane-"))
    srv = NatsServer(tmp / "js", users=USERS(names) if secured else None)
    srv.start()
    url = (lambda u: srv.url_as(u)) if secured else (lambda u: srv.url)
    try:
        writers = {p: NatsEventPublisher(endpoint=url("writer"), topic=f"kv@{p}@m", pod=p, model="m", window=8192)
                   for p in names}
        sent = {p: [] for p in names}
        done: dict = {}
        started = threading.Event()
        att = threading.Thread(target=_attacker, args=(url("replica-x"), names, forgeries, seed, started, done))
        att.start()
        started.wait(10)
        for i in range(batches):
            p = names[i % pods]
            b = batch(i, 2)
            writers[p].publish(b)
            sent[p].append(b)
        att.join(120)
        real_msgs = 0
        for w in writers.values():
            assert w.sender.flush(60)
            real_msgs += w.sender.stats["acked"] - w.sender.stats["duplicates"]
            w.shutdown(10)
        stored = stream_state(url("admin"))[0]
        got, stats = read_all(url("reader"), durable="judge")
        judged = _judge(got, sent)
        conflicts = stats["conflicts"]
        judged["conflict_dropped"] = min(judged["missing"], conflicts)
        judged["silent"] = judged.pop("missing") - judged["conflict_dropped"]
        return {**judged, **{k: stats[k] for k in ("rejected", "malformed", "conflicts")},
                "forged": sum(done.values()), "forged_stored": stored - real_msgs, "by_kind": done,
                "published": batches}
    finally:
        srv.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def _judge(got, sent: dict) -> dict:
    from kvevents import encode_batch

    out = {"delivered": 0, "reported": 0, "missing": 0, "forged_accepted": 0}
    for pod, bs in sent.items():
        real = {i: encode_batch(b) for i, b in enumerate(bs)}
        ok, covered = set(), set()
        for d in got:
            if d.publisher != pod:
                continue
            if d.kind is BATCH:
                if real.get(d.seq) == d.payload:
                    ok.add(d.seq)
                else:
                    out["forged_accepted"] += 1
            elif d.kind is GAP:
                covered.update(range(d.seq, d.seq + max(d.missed, 1)))
        out["delivered"] += len(ok)
        out["reported"] += len((set(real) - ok) & covered)
        out["missing"] += len(set(real) - ok - covered)
    return out


# ---- snapshots ---------------------------------------------------------------------------------------

SNAPSHOT_CASES = ("stream deleted and re-created", "positions damaged in the description", "body damaged",
                  "the format before the envelope")


def _replica(url: str, name: str):
    from kvservice.replica import Replica
    return Replica(url, name, router_factory=LedgerRouter, snapshot_every=0.05, heartbeat=0.05, ttl=3, purge=False)


def _publish(pub, start: int, n: int) -> None:
    for i in range(start, start + n):
        pub.publish(batch(i, 2))
    assert pub.sender.flush(30)


async def _rewrite(js, name: str, change) -> None:
    from nats.js import api
    obs = await js.object_store("kvrouter-snapshots")
    data, desc = change((await obs.get(name)).data)
    await obs.put(name, data, meta=api.ObjectMeta(name=name, description=json.dumps(desc)))


def snapshot_run(case: str) -> dict:
    """One snapshot attack on a fresh server; the starting replica's outcome against a cold read."""
    tmp = Path(tempfile.mkdtemp(prefix="kvchaos-snap-"))
    srv = NatsServer(tmp / "js")
    srv.start()
    url = srv.url
    try:
        pub = NatsEventPublisher(endpoint=url, topic="kv@pod-1@m", pod="pod-1", model="m", window=8192)
        _publish(pub, 0, 50)
        a = _replica(url, "a")
        try:
            wait_for(lambda: a.covered >= 50, "a snapshot", pump=lambda: a.step(10))
            old = a.router.snapshot(stream_seq=50)
        finally:
            a.close()
        if case == SNAPSHOT_CASES[0]:
            pub.shutdown(10)
            on_jetstream(url, lambda js: js.delete_stream("KVEVENTS"))
            pub = NatsEventPublisher(endpoint=url, topic="kv@pod-2@m", pod="pod-2", model="m", window=8192)
        elif case == SNAPSHOT_CASES[1]:
            on_jetstream(url, lambda js: _rewrite(js, "a", lambda d: (d, {"stream_seq": 50, "pods": {
                "pod-1": [0, 49 + 183, "kv@pod-1@m"]}})))
        elif case == SNAPSHOT_CASES[2]:
            on_jetstream(url, lambda js: _rewrite(js, "a", lambda d: (d.replace(b'"stream_seq": 50', b'"stream_seq": 20'),
                                                                  {"stream_seq": 50})))
        else:
            on_jetstream(url, lambda js: _rewrite(js, "a", lambda d: (old, {"stream_seq": 50, "pods": {
                "pod-1": [0, 49, "kv@pod-1@m"]}})))
        _publish(pub, 1000, 200)
        pub.shutdown(10)
        last = stream_state(url)[1]
        b = _replica(url, "b")
        try:
            wait_for(lambda: b.source.acked >= last, "replica b at the end", pump=lambda: b.step(10))
            ledger, counters, reason = b.router.ledger, dict(b.counters), b.cold_start_reason
        finally:
            b.close()
        cold = LedgerRouter()  # the truth: a cold read of the whole stream
        got, _ = read_all(url, durable="cold")
        for d in got:
            cold.handle(d)
        missing = sum(len(set(v) - set(ledger.get(p, []))) for p, v in cold.ledger.items())
        return {"refused": counters.get("snapshots_refused", 0), "restored": counters.get("restored_seq", 0) > 0,
                "foreign_pods": len(set(ledger) - set(cold.ledger)), "wrong_index": int(ledger != cold.ledger),
                "missing": missing, "reason": reason or "-"}
    finally:
        srv.stop()
        shutil.rmtree(tmp, ignore_errors=True)
