"""The JetStream source bounds what it asks for in bytes, not only in messages.

A backlog of large (packed) messages requested 512 at a time arrived faster than the server may
buffer for one connection (its ``max_pending``, 64 MB by default): the server cut the source's
connection as a slow consumer, the in-flight messages came back only after the ack wait, and the
reader saw a hole. Here the server allows 1 MB per connection and the backlog is 4 MB."""

from __future__ import annotations

import pytest

from kvevents import DeliveryKind
from kvevents.transport.nats.sender import PlaneSender
from kvevents.transport.nats.source import JetStreamSource
from kvevents.transport.nats.wire import StreamSpec, plane_headers, subject_for
from tests.plane_helpers import NATS_SERVER, NatsServer, wait_for

SPEC = StreamSpec()
BODY = 100_000


@pytest.fixture
def tight_server(tmp_path):
    if NATS_SERVER is None:
        pytest.fail("nats-server not found: install Debian's nats-server (the README's test command does)")
    srv = NatsServer(tmp_path / "js", config="max_pending: 1048576\n")
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


def _fill(url: str, n: int) -> None:
    sender = PlaneSender(url, SPEC, window=64)
    try:
        sender.put_many([(subject_for(SPEC.prefix, "m", "A"), bytes([s % 251]) * BODY,
                          plane_headers("batch", "A", "kv@A@m", 0, s, 0)) for s in range(n)])
        assert sender.flush(60)
    finally:
        sender.close()


def _read_all(url: str, n: int, **kw) -> tuple[list, dict]:
    out: list = []
    with JetStreamSource(url, durable="big", stream=SPEC, start_seq=1, **kw) as src:
        wait_for(lambda: src.position >= n, f"reading {n} messages", pump=lambda: out.extend(src.poll(50)))
        return out, src.stats()


def _check(out: list, stats: dict, n: int) -> None:
    assert [d.seq for d in out] == list(range(n))
    assert all(d.kind is DeliveryKind.BATCH and d.payload == bytes([d.seq % 251]) * BODY for d in out)
    assert stats["disconnects"] == 0 and stats["stream_holes"] == 0 and stats["malformed"] == 0


def test_a_large_backlog_is_pulled_within_a_byte_budget_without_the_server_cutting_the_reader(tight_server) -> None:
    _fill(tight_server.url, 40)  # 4 MB, four times what the server buffers for one connection
    out, stats = _read_all(tight_server.url, 40, pull_bytes=200_000, max_queued_bytes=500_000)
    _check(out, stats, 40)
    assert stats["pull_bytes_raised"] == 0


def test_a_message_larger_than_the_pull_budget_raises_the_budget_instead_of_stalling(tight_server) -> None:
    _fill(tight_server.url, 5)
    out, stats = _read_all(tight_server.url, 5, pull_bytes=1024, max_queued_bytes=1024)
    _check(out, stats, 5)
    assert stats["pull_bytes_raised"] >= 1
