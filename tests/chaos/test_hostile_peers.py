"""Hostile peers on every socket, with bounded counts: our publisher's PUB and replay ROUTER
against junk clients, our subscriber's SUB and replay DEALER against junk publishers, bind mode
against a topic flood. Each ends by checking the legitimate traffic still flows and that what was
refused was counted."""

from __future__ import annotations

import math
import socket
import time

import pytest
import zmq

from kvevents import DeliveryKind, KVEventBatch, Subscriber, encode_batch
from kvevents.publisher import ZmqEventPublisher

from ..pubsub_helpers import batch, collect, free_tcp_port, ipc_pair

END = [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
CTX = zmq.Context.instance()


def _replay_all(rep_ep: str, start: int = 0, timeout_ms: int = 20_000) -> list[list[bytes]]:
    d = CTX.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(rep_ep)
    try:
        d.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        while not got or got[-1] != END:
            assert d.poll(timeout_ms), "no replay answer"
            got.append(d.recv_multipart())
        return got
    finally:
        d.close(0)


def _wait(cond, what: str, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(0.005)
    pytest.fail(f"timed out: {what}")


# ---- our publisher against hostile clients ---------------------------------------------------------


MALFORMED_REQUESTS = [
    [b"x"], [b"", b"abc"], [b"", b"\x00" * 9], [b"", b"\x00" * 8, b"extra"], [b"\x00" * 8],
    [b"", b""], [b"junk"] * 5, [b"", b"\xff" * 7],
]


def test_the_replay_socket_counts_malformed_requests_and_still_answers():
    pub_ep, rep_ep = ipc_pair()
    pub = ZmqEventPublisher(pub_ep, rep_ep, replay_rate=1000.0, replay_burst=1000)
    hostile = CTX.socket(zmq.DEALER)
    hostile.setsockopt(zmq.LINGER, 0)
    try:
        for i in range(20):
            pub.publish(batch(i))
        _wait(lambda: pub.stats()["ring_batches"] == 20, "20 batches in the ring")
        hostile.connect(rep_ep)
        for _ in range(25):
            for frames in MALFORMED_REQUESTS:
                hostile.send_multipart(frames)
        hostile.send_multipart([b"", ((1 << 64) - 1).to_bytes(8, "big")])  # past the ring: just the end marker
        n_bad = 25 * len(MALFORMED_REQUESTS)
        _wait(lambda: pub.stats()["replay_malformed"] >= n_bad, "malformed requests counted")
        assert hostile.poll(20_000) and hostile.recv_multipart() == END
        got = _replay_all(rep_ep)
        assert [int.from_bytes(f[2], "big") for f in got[:-1]] == list(range(20))
        assert pub.stats()["replay_malformed"] == n_bad
    finally:
        hostile.close(0)
        pub.shutdown()


def test_raw_tcp_junk_on_both_publisher_ports_does_not_stop_the_stream():
    port, rport = free_tcp_port(), free_tcp_port()
    pub_ep, rep_ep = f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}"
    pub = ZmqEventPublisher(f"tcp://*:{port}", rep_ep)
    sub = Subscriber([(pub_ep, rep_ep)])
    try:
        for p in (port, rport):  # not ZMTP: a greeting of garbage, a half-open connection, a flood
            for payload in (b"\xff" * 64, b"GET / HTTP/1.0\r\n\r\n", bytes(range(256)) * 40, b""):
                with socket.create_connection(("127.0.0.1", p)) as s:
                    s.sendall(payload)
        lingering = socket.create_connection(("127.0.0.1", port))  # never says anything
        got = collect(sub, lambda g: any(d.kind is DeliveryKind.BATCH for d in g),
                      pump=lambda: pub.publish(batch(0)))
        first = min(d.seq for d in got if d.kind is DeliveryKind.BATCH)
        for i in range(50):
            pub.publish(batch(i))
        last = pub.next_seq - 1
        got += collect(sub, lambda g: any(d.seq == last for d in g if d.kind is DeliveryKind.BATCH))
        assert not [d for d in got if d.kind is not DeliveryKind.BATCH]
        assert sorted({d.seq for d in got}) == list(range(first, last + 1))
        lingering.close()
    finally:
        sub.close()
        pub.shutdown()


def test_a_subscriber_that_never_reads_does_not_hold_back_the_others():
    pub_ep, rep_ep = ipc_pair()
    pub = ZmqEventPublisher(pub_ep, rep_ep, hwm=100)
    stuck = CTX.socket(zmq.SUB)
    stuck.setsockopt(zmq.RCVHWM, 10)
    stuck.setsockopt(zmq.SUBSCRIBE, b"")
    stuck.setsockopt(zmq.LINGER, 0)
    stuck.connect(pub_ep)
    # The good subscriber lags too (3000 batches at once, hwm 100) and heals by replay. It waits for
    # each answer as long as it takes: on a loaded machine the replay socket's I/O thread (nice 19)
    # was silent for over 2 s, the default replay_timeout, and the subscriber gave the replay up and
    # counted its gaps as lost, as it must. This test asks whether the stuck peer cost the others
    # anything, not how fast the machine is: its one time budget is collect's deadline.
    sub = Subscriber([(pub_ep, rep_ep)], replay_timeout=math.inf)
    try:
        collect(sub, lambda g: any(d.kind is DeliveryKind.BATCH for d in g), pump=lambda: pub.publish(batch(0)))
        start = pub.next_seq
        for i in range(3000):
            pub.publish(batch(i, 4))
        last = pub.next_seq - 1
        got = collect(sub, lambda g: any(d.seq == last for d in g if d.kind is DeliveryKind.BATCH), deadline=30)
        batches = [d.seq for d in got if d.kind is DeliveryKind.BATCH and d.seq >= start]
        lost = sum(d.missed for d in got if d.kind is DeliveryKind.GAP)
        assert len(batches) + lost >= last - start + 1 and lost == 0
        st = pub.stats()
        assert st["send_errors"] == 0 and st["overflow_lost"] == 0
    finally:
        stuck.close(0)
        sub.close()
        pub.shutdown()


# ---- our subscriber against hostile publishers --------------------------------------------------------


def _xpub(endpoint: str) -> zmq.Socket:
    """A publisher under the test's control that knows when the subscription arrived (no slow joiner)."""
    s = CTX.socket(zmq.XPUB)
    s.setsockopt(zmq.LINGER, 0)
    s.bind(endpoint)
    return s


def _frames(seq: int, topic: bytes = b"kv@pod-h@m", payload: bytes | None = None) -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), encode_batch(batch(seq)) if payload is None else payload]


JUNK = [[b"only-one"], [b"t", b"\x00" * 8], [b"t", b"\x00" * 8, b"p", b"extra"], [b"t", b"\x00" * 7, b"p"],
        [b"t", b"\x00" * 9, b"p"], [b"", b"", b""]]


def test_the_subscriber_counts_junk_from_a_hostile_publisher_and_delivers_the_rest():
    pub_ep, _ = ipc_pair()
    xpub = _xpub(pub_ep)
    sub = Subscriber([pub_ep])
    try:
        assert xpub.poll(20_000) and xpub.recv()[0] == 1  # the subscription
        for _ in range(20):
            for frames in JUNK:
                xpub.send_multipart(frames)
        for seq in range(10):
            xpub.send_multipart(_frames(seq, payload=b"\xc1garbage" if seq == 5 else None))
        xpub.send_multipart(_frames(10, topic=b"t" * 1_000_000))  # a huge topic
        got = collect(sub, lambda g: any(d.seq == 10 for d in g))
        kinds = [(d.kind.value, d.seq, d.reason) for d in got]
        assert kinds == [("batch", s, "") for s in range(5)] + [("gap", 5, "malformed")] + \
            [("batch", s, "") for s in range(6, 11)]
        st = sub.stats()
        assert st["malformed"] == 20 * len(JUNK) + 1, st
    finally:
        sub.close()
        xpub.close(0)


def test_the_replay_dealer_against_a_router_that_answers_junk():
    pub_ep, rep_ep = ipc_pair()
    xpub = _xpub(pub_ep)
    router = CTX.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(rep_ep)
    sub = Subscriber([(pub_ep, rep_ep)], replay_timeout=0.5)
    try:
        assert xpub.poll(20_000) and xpub.recv()[0] == 1
        for seq in (0, 1, 5):  # 2..4 missing: the subscriber asks the replay socket
            xpub.send_multipart(_frames(seq))
        out = []
        end = time.monotonic() + 30
        answered = 0
        while time.monotonic() < end and not any(d.seq == 5 and d.kind is DeliveryKind.BATCH for d in out):
            out += sub.poll(20)
            while router.poll(0):
                ident, *req = router.recv_multipart()
                answered += 1
                for junk in ([b"x"], [b"", b"t", b"\x00" * 3, b"p"], [b"", b"t", (3).to_bytes(8, "big"), b"\xc1"],
                             [b"", b"t", ((1 << 64) - 1).to_bytes(8, "big"), encode_batch(batch(1))],
                             [b"", b"t", (2).to_bytes(8, "big"), encode_batch(batch(2))]):
                    router.send_multipart([ident, *junk])
                # ... and never the end marker: the subscriber must give up on its own clock
        assert answered >= 1
        seqs = [d.seq for d in out if d.kind is DeliveryKind.BATCH]
        assert seqs == sorted(set(seqs)) and seqs[:2] == [0, 1] and seqs[-1] == 5
        covered = set(seqs) | {s for d in out if d.kind is DeliveryKind.GAP for s in range(d.seq, d.seq + d.missed)}
        assert set(range(6)) <= covered | {(1 << 64) - 1}
        assert sub.stats()["malformed"] >= 1
    finally:
        sub.close()
        router.close(0)
        xpub.close(0)


def test_bind_mode_does_not_create_a_peer_per_malformed_topic():
    ep, _ = ipc_pair()
    sub = Subscriber(bind=ep)
    pub = CTX.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.connect(ep)
    try:
        good = 0
        end = time.monotonic() + 20
        while not good and time.monotonic() < end:  # slow joiner: until one good frame lands
            pub.send_multipart(_frames(0, topic=b"kv@good@m"))
            good = sum(d.kind is DeliveryKind.BATCH for d in sub.poll(20))
        for chunk in range(20):  # 2,000 distinct topics, each frame with a 7-byte seq
            for i in range(100):
                pub.send_multipart([f"kv@bad-{chunk}-{i}@m".encode(), b"\x00" * 7, b"p"])
            _wait(lambda: (sub.poll(10), sub.stats()["malformed"] >= 100 * (chunk + 1))[1], "malformed frames counted")
        assert sub.stats()["publishers"] <= 2
    finally:
        pub.close(0)
        sub.close()
