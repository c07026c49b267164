"""kill -9 helpers shared by tests/chaos and benchmarks/chaos.py: a publisher process to kill, and a
judge of what a subscriber delivered across its restarts."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvevents import DeliveryKind, Subscriber
from kvevents.recording import RecordingReader

from tests.pubsub_helpers import free_tcp_port, ipc_pair

ROOT = Path(__file__).resolve().parents[2]


def start_publisher(pub_ep: str, rep_ep: str, run: int, *extra: str) -> subprocess.Popen:
    """A ``peer_publisher`` process (``extra``: its options, e.g. ``--connect TOPIC``), once it is up."""
    p = subprocess.Popen([sys.executable, "-m", "tests.chaos.peer_publisher", pub_ep, rep_ep, str(run), *extra],
                         cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def judge(deliveries) -> dict[str, int]:
    """Per delivery of a multi-run stream: splices (a batch of a newer run after one of an older run
    with no RESET between), RESETs, batches, reported losses, batches out of order within a run."""
    out = {"splices": 0, "resets": 0, "batches": 0, "lost": 0, "disorder": 0}
    run = None
    last_seq = None
    for d in deliveries:
        if d.kind is DeliveryKind.RESET:
            out["resets"] += 1
            run = None
            last_seq = None
        elif d.kind is DeliveryKind.GAP:
            out["lost"] += d.missed
            last_seq = d.seq + d.missed - 1
        else:
            out["batches"] += 1
            r, s = divmod(int(d.batch.ts), 1_000_000)
            if s != d.seq:
                out["splices"] += 1  # delivered under a seq that is not its own
            if run is not None and r != run:
                out["splices"] += 1
            if last_seq is not None and d.seq != last_seq + 1:
                out["disorder"] += 1
            run, last_seq = r, d.seq
    return out


def run_of(d) -> int:
    return int(d.batch.ts) // 1_000_000


def kill_restart_rounds(rounds: int, rnd: random.Random, *, sub_timeout: float = 30.0,
                        bind: bool = False, replay: bool = True,
                        tail_probe_after: float | None = 1.0) -> dict[str, int]:
    """A publisher process killed -9 after a random number of its batches arrived, and started
    again on the same endpoints, ``rounds`` times; the deliveries judged. ``bind``: the subscriber
    binds (tcp loopback) and the publishers connect to it under one topic. ``replay`` False: the
    publishers have no replay socket and the subscriber no replay endpoint (each reconnect is a
    RESET that cannot be verified). ``tail_probe_after``: the subscriber's idle probe (a restart
    slower than it is found by the probe, and a run killed before its live frames arrive then
    counts no reconnect: its connection never carried a frame)."""
    pub_ep, rep_ep = ipc_pair()
    extra: tuple[str, ...] = () if replay else ("--no-replay",)
    if bind:
        pub_ep = f"tcp://127.0.0.1:{free_tcp_port()}"
        sub = Subscriber(bind=pub_ep, replay_endpoints={"kv@p@m": rep_ep} if replay else {}, replay_timeout=2.0,
                         tail_probe_after=tail_probe_after)
        extra += ("--connect", "kv@p@m")
    else:
        sub = Subscriber([(pub_ep, rep_ep if replay else None)], replay_timeout=2.0,
                         tail_probe_after=tail_probe_after)
    got = []
    proc = start_publisher(pub_ep, rep_ep, 1, *extra)
    try:
        for run in range(1, rounds + 1):
            want = rnd.randrange(1, 60)  # kill after this many of this run's batches arrived
            end = time.monotonic() + sub_timeout
            seen = 0
            while seen < want and time.monotonic() < end:
                for d in sub.poll(20):
                    got.append(d)
                    if d.kind is DeliveryKind.BATCH and int(d.batch.ts) // 1_000_000 == run:
                        seen += 1
            assert seen >= want, (f"run {run}: {seen} of {want} batches arrived; "
                                  f"{ {k: v for k, v in sub.stats().items() if v} }; last: {got[-3:]}")
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            proc = start_publisher(pub_ep, rep_ep, run + 1, *extra)
        end = time.monotonic() + sub_timeout
        while time.monotonic() < end and not any(
                d.kind is DeliveryKind.BATCH and int(d.batch.ts) // 1_000_000 == rounds + 1 for d in got[-50:]):
            got += sub.poll(20)
    finally:
        proc.kill()
        proc.wait()
        sub.close()
    result = judge(got)
    result["restarts"] = rounds
    result["reconnects"] = sub.stats()["reconnects"]
    return result




SUBSCRIBER = """
import sys
from kvevents import DeliveryKind, Subscriber
sub = Subscriber([(sys.argv[1], sys.argv[2])], late_join=True)
print("ready", flush=True)
while True:
    for d in sub.poll(50):
        if d.kind is DeliveryKind.BATCH:
            print("B", d.seq, int(d.batch.ts) // 1_000_000, flush=True)
        else:
            print(d.kind.value[0].upper(), d.seq, d.missed, flush=True)
"""


def kill_subscriber_rounds(rounds: int, rnd: random.Random, *, timeout: float = 30.0) -> dict[str, int]:
    """A late-joining subscriber process killed -9 at random points and started again, while one
    publisher runs on: each new subscriber must deliver the stream from the ring's start, in order,
    with every seq either a batch or inside a reported GAP (correct continuation, no silent loss)."""
    pub_ep, rep_ep = ipc_pair()
    pub = start_publisher(pub_ep, rep_ep, 1)
    out = {"restarts": 0, "batches": 0, "lost": 0, "disorder": 0, "silent": 0, "splices": 0}
    try:
        for _ in range(rounds):
            sub = subprocess.Popen([sys.executable, "-c", SUBSCRIBER, pub_ep, rep_ep], cwd=ROOT,
                                   stdout=subprocess.PIPE, text=True)
            assert sub.stdout.readline().strip() == "ready"
            want = rnd.randrange(5, 200)
            expected = None
            end = time.monotonic() + timeout
            got = 0
            while got < want and time.monotonic() < end:
                kind, a, b = sub.stdout.readline().split()
                seq = int(a)
                if kind == "B":
                    got += 1
                    out["batches"] += 1
                    if int(b) != 1:
                        out["splices"] += 1
                    if expected is not None and seq != expected:
                        out["disorder" if seq < expected else "silent"] += 1
                    expected = seq + 1
                elif kind == "G":
                    out["lost"] += int(b)
                    expected = seq + int(b)
            sub.send_signal(signal.SIGKILL)
            sub.wait()
            out["restarts"] += 1
    finally:
        pub.kill()
        pub.wait()
    return out
