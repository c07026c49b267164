"""Replay server and PUB socket under hostile or stuck peers (issue 10): bounded bytes, fair service."""

from __future__ import annotations

import threading

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
    the first rounds of the fair schedule, long before the large replays are done.

    Measured on the server's side, so that neither the server's speed nor the test's own
    reaction time matters: the rounds wait until all 51 requests are in, and the count of
    batches served is taken when the small replay ends (its ``on_replay`` hook)."""
    ep, rep = ipc_pair()
    pub = ZmqEventPublisher(ep, rep, replay_rate=10_000.0, replay_burst=1000)
    big = [_dealer(rep) for _ in range(50)]
    small = _dealer(rep)
    server = pub._replay
    gate = threading.Event()
    real_round = server._round
    server._round = lambda replays, now: real_round(replays, now) if gate.is_set() else False
    ended: dict[int, int] = {}

    class Hooks:
        every = 1 << 62  # no batch traced

        def on_replay(self, start: int, served: int, t0: int) -> None:
            ended.setdefault(start, pub._stats.replay_batches_served)

    try:
        n = 1000
        for i in range(n):
            pub.publish(batch(i))
        assert collect_until(lambda: pub.stats()["ring_batches"] == n)
        pub.hooks = Hooks()
        for d in big:
            d.send_multipart([b"", (0).to_bytes(8, "big")])
        small.send_multipart([b"", (n - 1).to_bytes(8, "big")])
        assert collect_until(lambda: pub.stats()["replay_requests"] == 51)
        gate.set()
        assert small.poll(10_000)
        frames = small.recv_multipart()
        assert int.from_bytes(frames[2], "big") == n - 1
        assert small.poll(10_000) and small.recv_multipart()[2] == END
        assert collect_until(lambda: n - 1 in ended)
        # one chunk (64 batches) per large replay per round: two rounds' worth, not the rings
        assert ended[n - 1] <= 2 * 50 * 64 + 1, f"{ended[n - 1]} batches of the large replays went first"
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
