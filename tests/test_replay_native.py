"""The replay server's bounded work beside the engine's thread (issue 10): a replay's answer with
malformed requests among it, the ring mirror, the scheduling of the publisher's own threads and
the global cap on reading the replay socket."""

from __future__ import annotations

import os
import random
import threading
import time
from collections import deque

import pytest
import zmq

from kvevents import ZmqEventPublisher
from kvevents.transport.zmq import replay as replay_mod
from kvevents.transport.zmq.mirror import RingMirror as _Mirror

from .pubsub_helpers import batch, collect_until, ipc_pair

END = (-1).to_bytes(8, "big", signed=True)


def test_a_replay_answers_from_the_ring_and_counts_malformed_requests() -> None:
    ep, rep = ipc_pair()
    pub = ZmqEventPublisher(ep, rep, buffer_steps=500)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(rep)
    try:
        for i in range(700):  # 200 evicted
            pub.publish(batch(i))
        assert collect_until(lambda: pub.stats()["batches_published"] == 700)
        ring = [(s, t, p) for s, t, p in pub._ring.items]
        for bad in ([b"x"], [b"", b"abc"]):
            dealer.send_multipart(bad)
        dealer.send_multipart([b"", (350).to_bytes(8, "big")])
        got = []
        while True:
            assert dealer.poll(5000)
            frames = dealer.recv_multipart()
            if frames[2] == END:
                break
            got.append((int.from_bytes(frames[2], "big"), frames[1], frames[3]))
        assert got == [x for x in ring if x[0] >= 350]
        assert collect_until(lambda: pub.stats()["replays_completed"] == 1)
        st = pub.stats()
        assert st["replay_malformed"] == 2 and st["replay_batches_served"] == 350
    finally:
        dealer.close(0)
        pub.shutdown()


def test_the_mirror_follows_the_ring_through_appends_and_evictions() -> None:
    rnd = random.Random(5)
    ring: deque = deque()
    mirror = _Mirror(ring)
    seq = 0
    for step in range(3000):
        for _ in range(rnd.choice([0, 1, 1, 3, 40, 2000]) if step % 50 else 5000):  # a tail past MAX_TAIL at times
            ring.append((seq, b"", b""))
            seq += 1
        while len(ring) > 3000 or (ring and rnd.random() < 0.3):
            ring.popleft()
        if rnd.random() < 0.02:
            mirror.clear()
        mirror.sync()
        assert mirror.items[mirror.head:] == list(ring)
        assert all(x is None for x in mirror.items[:mirror.head])  # evicted batches are not kept alive


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="Linux scheduling policies")
def test_the_publishers_own_threads_never_preempt_the_engine() -> None:
    """The live thread, the replay thread and the replay socket's I/O thread run SCHED_BATCH
    (no wake-up preemption of the thread calling publish()); the I/O thread also at nice 19."""
    ep, rep = ipc_pair()
    pub = ZmqEventPublisher(ep, rep)
    try:
        tids = [pub._thread.native_id, pub._replay._thread.native_id]
        assert collect_until(lambda: all(os.sched_getscheduler(t) == os.SCHED_BATCH for t in tids))
        io = pub._replay.io_threads  # its own context's I/O thread, once it has named itself
        assert collect_until(lambda: len(io) == 1)
        assert all(os.sched_getscheduler(t) == os.SCHED_BATCH and os.getpriority(os.PRIO_PROCESS, t) == 19 for t in io)
        assert all(open(f"/proc/self/task/{t}/comm").read().startswith(f"{replay_mod.IO_THREAD_PREFIX}/ZMQbg/IO/")
                   for t in io)
        assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the caller's thread is left alone
    finally:
        pub.shutdown()


# ---- the global cap on reading the replay socket (a local flood) ------------------------------------


def _flood(rep: str, n: int) -> zmq.Socket:
    """A DEALER that has queued ``n`` malformed requests toward ``rep`` (blocking sends: it is
    held back, not refused, when the server stops reading)."""
    hostile = zmq.Context.instance().socket(zmq.DEALER)
    hostile.setsockopt(zmq.LINGER, 0)
    hostile.setsockopt(zmq.SNDTIMEO, 20_000)
    hostile.connect(rep)
    for _ in range(n):
        hostile.send_multipart([b"", b"abc"])
    return hostile


def test_all_clients_together_are_read_at_most_request_rate_messages_a_second() -> None:
    """The global cap: past ``replay_request_burst`` + ``replay_request_rate`` x elapsed messages the
    socket is not read (counted once per pause in ``replay_throttled``); what waits is read later,
    none lost."""
    ep, rep = ipc_pair()
    t0 = time.monotonic()
    pub = ZmqEventPublisher(ep, rep, replay_request_rate=400.0, replay_request_burst=20)
    hostile = _flood(rep, 300)
    try:
        seen = []

        def read_so_far() -> bool:
            n = pub.stats()["replay_malformed"]
            seen.append((n, time.monotonic()))
            return n == 300
        assert collect_until(read_so_far, deadline=30.0)
        assert all(n <= 20 + 400.0 * (t - t0) + 1 for n, t in seen), "read faster than the cap"
        assert pub.stats()["replay_throttled"] >= 1
    finally:
        hostile.close(0)
        pub.shutdown()


def test_a_well_behaved_client_gets_its_replay_while_a_flood_is_throttled() -> None:
    ep, rep = ipc_pair()
    pub = ZmqEventPublisher(ep, rep, replay_request_rate=200.0, replay_request_burst=10)
    ctx = zmq.Context.instance()
    stop = threading.Event()
    sent = [0]

    def flood() -> None:
        hostile = ctx.socket(zmq.DEALER)
        hostile.setsockopt(zmq.LINGER, 0)
        hostile.setsockopt(zmq.SNDTIMEO, 50)
        hostile.connect(rep)
        while not stop.is_set():
            try:
                hostile.send_multipart([b"x"])
                sent[0] += 1
            except zmq.Again:  # held back: the server is not reading
                continue
        hostile.close(0)

    flooder = threading.Thread(target=flood, daemon=True)
    legit = ctx.socket(zmq.DEALER)
    legit.setsockopt(zmq.LINGER, 0)
    try:
        for i in range(30):
            pub.publish(batch(i))
        assert collect_until(lambda: pub.stats()["ring_batches"] == 30)
        flooder.start()
        assert collect_until(lambda: pub.stats()["replay_throttled"] >= 2, deadline=30.0)  # the cap holds the flood
        legit.connect(rep)
        legit.send_multipart([b"", (0).to_bytes(8, "big")])
        got = []
        while True:
            assert legit.poll(20_000), "no replay for the well-behaved client during the flood"
            frames = legit.recv_multipart()
            if frames[2] == END:
                break
            got.append(int.from_bytes(frames[2], "big"))
        assert got == list(range(30))
        st = pub.stats()
        assert st["replays_completed"] == 1 and st["replay_malformed"] < sent[0]  # the flood still waits
    finally:
        stop.set()
        flooder.join(10)
        legit.close(0)
        pub.shutdown()


def test_a_client_that_never_reads_is_held_to_its_budget_by_the_chunks_it_has_not_taken() -> None:
    """Small batches (pyzmq copies any send under its copy threshold, 64 KiB, and hands back a
    tracker that is done at once): the last message of each chunk must still be tracked until
    libzmq lets go of it, or the budget never fills and the whole ring goes out toward a client
    that reads nothing, as far as its pipes and the kernel take it (before: every batch)."""
    ep, rep = ipc_pair()
    budget = 64 << 10
    pub = ZmqEventPublisher(ep, rep, replay_client_bytes=budget, replay_stall_timeout=30.0)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        for i in range(2000):
            pub.publish(batch(i, 40))
        assert collect_until(lambda: pub.stats()["ring_batches"] == 2000)
        assert pub.stats()["ring_bytes"] < 2000 * (64 << 10)  # every payload under the copy threshold
        dealer.connect(rep)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        assert collect_until(lambda: pub.stats()["replay_outstanding_bytes"] >= budget)
        st = pub.stats()  # past the budget nothing more is sent to it (until the stall timeout)
        assert st["replays_completed"] == 0
        assert st["replay_batches_served"] <= 2 * replay_mod.CHUNK  # the chunk that filled the budget
        assert st["replay_outstanding_bytes"] <= budget + (320 << 10)  # + at most one chunk
    finally:
        dealer.close(0)
        pub.shutdown()
