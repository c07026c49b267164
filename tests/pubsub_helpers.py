"""Shared helpers for publisher/subscriber tests: endpoints, batches, and polling with deadlines."""

from __future__ import annotations

import itertools
import os
import socket
import tempfile
import time

from kvevents import BlockStored, Delivery, DeliveryKind, KVEventBatch

_counter = itertools.count()
_TMP = tempfile.mkdtemp(prefix="kvt-")


def ipc_pair() -> tuple[str, str]:
    n = next(_counter)
    return f"ipc://{_TMP}/{os.getpid()}-{n}.pub", f"ipc://{_TMP}/{os.getpid()}-{n}.rep"


_given: set[int] = set()


def free_tcp_port() -> int:
    """A loopback port nobody listens on now, never one this process was given before (the
    kernel can hand the same free port out twice in a row: a test taking two got one port for
    both its PUB and replay sockets, 'Address already in use')."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _given:
            _given.add(port)
            return port


def batch(i: int, n_events: int = 1) -> KVEventBatch:
    return KVEventBatch(
        ts=1000.0 + i,
        events=[BlockStored([i * 100 + k], None, list(range(16)), 16, None, "GPU", None) for k in range(n_events)],
        data_parallel_rank=0,
    )


def collect(sub, want, *, deadline: float = 10.0, pump=None) -> list[Delivery]:
    """Poll ``sub`` until ``want(deliveries)`` is true or the deadline passes; ``pump()`` runs each round."""
    got: list[Delivery] = []
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if pump is not None:
            pump()
        got.extend(sub.poll(20))
        if want(got):
            return got
    raise AssertionError(f"condition not met within {deadline}s; got {len(got)} deliveries: {summary(got)}")


def summary(ds: list[Delivery]) -> list[tuple]:
    return [(d.kind.value, d.seq, d.missed) if d.kind is not DeliveryKind.BATCH else ("b", d.seq) for d in ds][:60]


def seqs(ds: list[Delivery]) -> list[int]:
    return [d.seq for d in ds if d.kind is DeliveryKind.BATCH]


def wait_connected(pub, sub, *, deadline: float = 10.0) -> int:
    """Publish probe batches until the subscriber sees one (the ZeroMQ slow-joiner); returns the next seq."""
    got = collect(sub, lambda g: any(d.kind is DeliveryKind.BATCH for d in g), deadline=deadline,
                  pump=lambda: pub.publish(batch(-1)))
    last = getattr(pub, "next_seq", max(seqs(got)) + 1) - 1
    if max(seqs(got)) < last:  # probes still in flight: take them too, or they land in the test's window
        collect(sub, lambda g: bool(g) and max(seqs(g), default=-1) >= last, deadline=deadline)
    return last + 1


def collect_until(cond, *, deadline: float = 10.0) -> bool:
    """Poll ``cond()`` (with a short back-off) until it holds or the deadline passes."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.002)
    return cond()
