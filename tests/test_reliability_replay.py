"""Replay server and PUB socket under hostile or stuck peers (issue 10): bounded bytes, fair service."""

from __future__ import annotations

import zmq

from kvevents import ConfigError, ZmqEventPublisher

from .pubsub_helpers import batch, collect_until, ipc_pair

END = (-1).to_bytes(8, "big", signed=True)


def _dealer(endpoint: str, rcvhwm: int = 1000) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVHWM, rcvhwm)
    s.connect(endpoint)
    return s


def _resolved(st: dict) -> int:
    return st["replays_completed"] + st["replay_aborted"] + st["replay_refused"] + st["replay_superseded"]


def test_a_replay_client_that_never_reads_cannot_grow_the_publisher() -> None:
    """Every request asks for the whole ring and nothing is ever read: what the publisher queues
    toward that client stays under its byte budget; the stuck replay is aborted and the
    client's further requests refused, all counted (before: one full ring copy per request)."""
    ep, rep = ipc_pair()
    budget = 64 << 10
    pub = ZmqEventPublisher(ep, rep, replay_rate=10_000.0, replay_burst=1000, replay_client_bytes=budget,
                            replay_stall_timeout=0.1)
    dealer = None
    try:
        for i in range(600):
            pub.publish(batch(i, 40))
        assert collect_until(lambda: pub.stats()["ring_batches"] == 600)
        ring_bytes = pub.stats()["ring_bytes"]
        assert ring_bytes > 1_200_000
        dealer = _dealer(rep, rcvhwm=1)
        n = 40
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        assert collect_until(lambda: pub.stats()["replay_outstanding_bytes"] >= budget)  # it stopped reading
        for _ in range(n - 1):
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        assert collect_until(lambda: pub.stats()["replay_requests"] == n and _resolved(pub.stats()) == n
                             and pub.stats()["replay_active"] == 0, deadline=20)
        st = pub.stats()
        assert st["replay_stalled"] >= 1 and st["replay_refused"] >= 1
        assert st["replays_completed"] == 0
        # what went out at all: less than one ring (the kernel's socket buffers and the budget),
        # where an unbounded queue takes n rings
        assert st["replay_batches_served"] < 600
        assert st["replay_outstanding_bytes"] <= budget + (320 << 10)  # + at most one chunk
        assert st["replay_refused"] == n - 1 and st["replay_stalled"] == 1
        # the publisher still serves a reading client
        good = _dealer(rep)
        try:
            good.send_multipart([b"", (590).to_bytes(8, "big")])
            got = []
            while True:
                assert good.poll(5000)
                frames = good.recv_multipart()
                if frames[2] == END:
                    break
                got.append(int.from_bytes(frames[2], "big"))
            assert got == list(range(590, 600))
        finally:
            good.close(0)
    finally:
        if dealer is not None:
            dealer.close(0)
        pub.shutdown()


def test_a_small_replay_is_not_starved_by_many_large_ones() -> None:
    """50 clients ask for the whole ring, then one asks for a single batch: its answer comes in
    the first round of the fair schedule, long before the large replays are done."""
    ep, rep = ipc_pair()
    pub = ZmqEventPublisher(ep, rep, replay_rate=10_000.0, replay_burst=1000)
    big = [_dealer(rep) for _ in range(50)]
    small = _dealer(rep)
    try:
        n = 4000  # large enough that the large replays outlast the test's own reaction time (the C sends are fast)
        for i in range(n):
            pub.publish(batch(i))
        assert collect_until(lambda: pub.stats()["ring_batches"] == n)
        for d in big:
            d.send_multipart([b"", (0).to_bytes(8, "big")])
        assert collect_until(lambda: pub.stats()["replay_requests"] == 50)
        small.send_multipart([b"", (n - 1).to_bytes(8, "big")])
        assert small.poll(10_000)
        frames = small.recv_multipart()
        assert int.from_bytes(frames[2], "big") == n - 1
        served_then = pub.stats()["replay_batches_served"]
        assert small.poll(10_000) and small.recv_multipart()[2] == END
        assert served_then < 50 * n // 4, f"{served_then} batches of the large replays went first"
    finally:
        for d in big:
            d.close(0)
        small.close(0)
        pub.shutdown()


def test_the_pub_queue_is_bounded_in_bytes() -> None:
    """SNDHWM counts messages: it is derived from a byte budget and the expected batch size."""
    ep, rep = ipc_pair()
    pub = ZmqEventPublisher(ep, rep, hwm_bytes=1 << 20, mean_batch_bytes=4096)
    try:
        assert pub.stats()["pub_hwm"] == 256
        assert pub._pub.getsockopt(zmq.SNDHWM) == 256
    finally:
        pub.shutdown()
    pub = ZmqEventPublisher(ep, rep, hwm=100)  # an explicit message count is a ceiling too
    try:
        assert pub.stats()["pub_hwm"] == 100
    finally:
        pub.shutdown()
    try:
        ZmqEventPublisher(ep, rep, hwm_bytes=0)
    except ConfigError as exc:
        assert "hwm_bytes" in str(exc)
    else:
        raise AssertionError("hwm_bytes=0 accepted")
