"""The publisher: vLLM's frames and replay protocol, never blocking, bounded, counted."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

import kvevents
from kvevents import ConfigError, EndpointError, EventPublisherFactory, KVEventsConfig, ZmqEventPublisher
from kvevents.endpoints import offset_endpoint, should_bind, validate_endpoint

from .pubsub_helpers import batch, collect_until, free_tcp_port, ipc_pair

END = (-1).to_bytes(8, "big", signed=True)


def _raw_sub(endpoint: str) -> zmq.Socket:
    s = zmq.Context.instance().socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.connect(endpoint)
    return s


def _recv(sock: zmq.Socket, timeout_ms: int = 5000) -> list[bytes]:
    assert sock.poll(timeout_ms), "nothing received in time"
    return sock.recv_multipart()


def test_live_frames_are_vllms() -> None:
    ep, rep = ipc_pair()
    pub = ZmqEventPublisher(ep, rep, topic="kv@pod@m")
    sub = _raw_sub(ep)
    try:
        # slow joiner: publish until the first frame arrives
        deadline = time.monotonic() + 10
        while not sub.poll(20):
            assert time.monotonic() < deadline
            pub.publish(batch(0))
        frames = sub.recv_multipart()
        assert len(frames) == 3
        topic, seq, payload = frames
        assert topic == b"kv@pod@m" and len(seq) == 8
        assert payload == kvevents.encode_batch(batch(0))
        first = int.from_bytes(seq, "big")
        pub.publish(batch(7))
        frames = _recv(sub)
        assert int.from_bytes(frames[1], "big") == first + 1
        assert kvevents.decode_batch(frames[2]) == batch(7)
    finally:
        sub.close(0)
        pub.shutdown()


def test_replay_protocol_is_vllms() -> None:
    ep, rep = ipc_pair()
    pub = ZmqEventPublisher(ep, rep, topic="t")
    for i in range(10):
        pub.publish(batch(i))
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(rep)
    try:
        assert collect_until(lambda: pub.stats()["ring_batches"] == 10)  # rung once sent
        dealer.send_multipart([b"", (6).to_bytes(8, "big")])
        answers = [_recv(dealer) for _ in range(5)]
        assert [int.from_bytes(a[2], "big") for a in answers[:4]] == [6, 7, 8, 9]
        for empty, topic, seq, payload in answers[:4]:
            assert empty == b"" and topic == b"t"
            assert kvevents.decode_batch(payload) == batch(int.from_bytes(seq, "big"))
        assert answers[4] == [b"", b"", END, b""]
        assert pub.stats()["replay_batches_served"] == 4
    finally:
        dealer.close(0)
        pub.shutdown()


def test_ring_is_bounded_by_count_and_bytes() -> None:
    ep, _ = ipc_pair()
    by_count = ZmqEventPublisher(ep, buffer_steps=5)
    payload_len = len(kvevents.encode_batch(batch(19, 4)))  # the last three are the same size
    ep2, _ = ipc_pair()
    by_bytes = ZmqEventPublisher(ep2, buffer_bytes=payload_len * 3 + 1)
    for p in (by_count, by_bytes):
        for i in range(20):
            p.publish(batch(i, 4))
        p.shutdown(timeout=5)
    assert by_count.stats()["ring_batches"] == 5 and by_count.stats()["ring_evicted"] == 15
    assert by_bytes.stats()["ring_batches"] == 3 and by_bytes.stats()["ring_bytes"] <= payload_len * 3 + 1


def test_publish_never_blocks_when_the_queue_is_full() -> None:
    ep, rep = ipc_pair()
    gate = threading.Event()  # the live thread stalls in the fault hook until the gate opens
    pub = ZmqEventPublisher(ep, rep, max_queue_size=10, buffer_steps=10_000,
                            drop_live=lambda seq: not gate.wait(30))
    done = threading.Event()

    def flood() -> None:
        for i in range(2000):
            pub.publish(batch(i))
        done.set()

    t = threading.Thread(target=flood)
    t.start()
    try:
        assert done.wait(30), "publish() blocked on a full queue"
    finally:
        gate.set()
    t.join()
    report = pub.shutdown(timeout=10)
    s = pub.stats()
    assert s["overflow"] >= 2000 - 2 * 10  # at most a queue-full in the queue and one in the stalled thread
    assert s["overflow_lost"] == 0  # replay_only policy: overflowed batches went to the ring
    assert report.unsent == 0
    # nothing silent: every seq is either sent live or kept in the ring
    assert s["batches_published"] + s["overflow"] == 2000
    assert s["ring_batches"] == 2000


def test_drop_oldest_policy_counts_losses() -> None:
    ep, _ = ipc_pair()
    gate = threading.Event()
    pub = ZmqEventPublisher(ep, max_queue_size=4, overflow="drop_oldest", drop_live=lambda seq: not gate.wait(30))
    try:
        for i in range(100):
            pub.publish(batch(i))
    finally:
        gate.set()
    pub.shutdown(timeout=10)
    s = pub.stats()
    assert s["overflow"] == s["overflow_lost"] >= 100 - 5
    assert s["batches_published"] + s["overflow_lost"] == 100


def test_shutdown_flushes_and_reports() -> None:
    ep, _ = ipc_pair()
    pub = ZmqEventPublisher(ep)
    for i in range(500):
        pub.publish(batch(i))
    report = pub.shutdown(timeout=10)
    assert report.clean and report.flushed <= 500
    assert pub.stats()["batches_published"] == 500
    with pytest.raises(RuntimeError, match="after shutdown"):
        pub.publish(batch(0))


def test_shutdown_reports_what_it_could_not_send() -> None:
    ep, _ = ipc_pair()
    gate = threading.Event()
    pub = ZmqEventPublisher(ep, drop_live=lambda seq: not gate.wait(30))
    for i in range(50):
        pub.publish(batch(i))
    report = pub.shutdown(timeout=0.05)
    gate.set()
    assert report.unsent >= 40
    assert report.unsent_seqs == sorted(report.unsent_seqs) and report.unsent_seqs[-1] == 49


class _Gate:
    """A ``drop_live`` fault hook that stalls the live thread on one seq until opened."""

    def __init__(self) -> None:
        self.seq = -1
        self.entered = threading.Event()
        self.open = threading.Event()

    def __call__(self, seq: int) -> bool:
        if seq == self.seq:
            self.entered.set()
            self.open.wait(30)
        return False


def _sync_sub(pub: ZmqEventPublisher, ep: str) -> zmq.Socket:
    """A raw SUB that is known to receive (slow joiner): warm-up batches until one arrives."""
    sub = _raw_sub(ep)
    deadline = time.monotonic() + 10
    while not sub.poll(20):
        assert time.monotonic() < deadline
        pub.publish(batch(0))
    return sub


def test_a_backlog_goes_out_complete_in_order_and_counted() -> None:
    """A backlog larger than a send group: batches, raw payloads with their own topic and an
    unencodable batch (its seq becomes a gap), each in the ring before the socket; exact counters."""
    ep, rep = ipc_pair()
    gate = _Gate()
    pub = ZmqEventPublisher(ep, rep, topic="t", drop_live=gate)
    sub = _sync_sub(pub, ep)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(rep)
    try:
        gate.seq = first = pub.next_seq
        pub.publish(batch(first, 2))
        assert gate.entered.wait(10)  # the live thread holds seq `first`: what follows queues up
        before = pub.stats()
        n = 3 * ZmqEventPublisher.SEND_GROUP + 5
        bad_seq, raw_seq = first + 40, first + 41
        expected: dict[int, tuple[bytes, bytes]] = {first: (b"t", kvevents.encode_batch(batch(first, 2)))}
        events = 2
        for seq in range(first + 1, first + 1 + n):
            if seq == bad_seq:
                unencodable = kvevents.BlockStored([object()], None, [1], 16, None, "GPU", None)
                pub.publish(kvevents.KVEventBatch(1.0, [unencodable], 0))
            elif seq == raw_seq:
                pub.publish_raw(b"raw payload", topic="other")
                expected[seq] = (b"other", b"raw payload")
            else:
                b = batch(seq, 1 + seq % 3)
                pub.publish(b)
                expected[seq] = (b"t", kvevents.encode_batch(b))
                events += len(b.events)
        assert pub.stats()["queue_depth"] == n
        gate.open.set()
        got = {}
        while len(got) < len(expected):
            topic, seq_b, payload = _recv(sub)
            seq = int.from_bytes(seq_b, "big")
            if seq >= first:
                assert seq not in got and all(s < seq for s in got)  # in order, no duplicate
                got[seq] = (topic, payload)
        assert got == expected
        deadline = time.monotonic() + 10  # the sender counts a group after its last frame is handed to the socket
        while pub.stats()["batches_published"] - before["batches_published"] < len(expected) and time.monotonic() < deadline:
            time.sleep(0.005)  # polling a counter another thread updates
        after = pub.stats()
        assert after["batches_published"] - before["batches_published"] == len(expected)
        assert after["events_published"] - before["events_published"] == events
        assert after["bytes_published"] - before["bytes_published"] == sum(len(p) for _, p in expected.values())
        assert after["encode_errors"] - before["encode_errors"] == 1
        # the ring holds exactly what went out live (and nothing for the unencodable seq)
        dealer.send_multipart([b"", first.to_bytes(8, "big")])
        replayed = {}
        while True:
            empty, topic, seq_b, payload = _recv(dealer)
            if seq_b == END:
                break
            replayed[int.from_bytes(seq_b, "big")] = (topic, payload)
        assert replayed == expected
    finally:
        gate.open.set()
        dealer.close(0)
        sub.close(0)
        pub.shutdown()


class _StallingHooks:
    """Telemetry hook stand-in: records what was sent and stalls ``before_send`` on one seq."""

    every = 1

    def __init__(self, stall_seq: int) -> None:
        self.stall_seq = stall_seq
        self.entered = threading.Event()
        self.open = threading.Event()
        self.sent: list[int] = []

    def on_enqueue(self, seq: int) -> None:
        pass

    def before_send(self, seq: int, topic: bytes):
        if seq == self.stall_seq:
            self.entered.set()
            self.open.wait(30)
        return seq

    def after_send(self, token, seq: int, payload: bytes, item, outcome: str) -> None:
        if outcome == "sent":
            self.sent.append(seq)


@pytest.mark.parametrize("stall_at", ["encoding", "sending"])
def test_shutdown_accounts_for_every_batch_of_a_stuck_group(stall_at: str) -> None:
    """The live thread stuck in the middle of a send group (while encoding it, or while sending
    it): every seq is either sent or reported unsent by shutdown(), never both, never neither."""
    ep, _ = ipc_pair()
    n = 3 * ZmqEventPublisher.SEND_GROUP
    stall = ZmqEventPublisher.SEND_GROUP + 7
    hooks = _StallingHooks(stall if stall_at == "encoding" else -1)
    gate = _Gate()
    gate.seq = stall if stall_at == "sending" else -1
    first = _Gate()  # holds seq 0 until the whole backlog is queued: then it goes in send groups
    first.seq = 0

    def drop(seq: int) -> bool:
        return first(seq) or gate(seq)

    pub = ZmqEventPublisher(ep, drop_live=drop)
    pub.hooks = hooks
    pub.publish(batch(0))
    assert first.entered.wait(10)
    for i in range(1, n):
        pub.publish(batch(i))
    first.open.set()
    stuck = hooks.entered if stall_at == "encoding" else gate.entered
    assert stuck.wait(10)
    report = pub.shutdown(timeout=0.05)
    sent = list(hooks.sent)
    hooks.open.set()
    gate.open.set()
    assert not set(sent) & set(report.unsent_seqs)
    assert sorted(sent + report.unsent_seqs) == list(range(n))
    assert stall in report.unsent_seqs and report.unsent == len(report.unsent_seqs)


def test_replay_clients_are_rate_limited_but_answered() -> None:
    """One client's requests, one after another: every one answered, at most the token bucket's
    pace. No wall-clock bound: what the bucket must have done follows from the test's own clock.
    The server takes request k (k answered before it) no earlier than request 0 and no later than
    answer k arrives here, so its bucket then held at most ``burst - k + rate * elapsed_k``
    tokens (``elapsed_k``: request 0 sent to answer k received): below 1, request k waited
    (``replay_rate_limited``); and the last one admitted means elapsed >= (n - burst) / rate."""
    rate, burst, n = 50.0, 2, 6
    ep, rep = ipc_pair()
    pub = ZmqEventPublisher(ep, rep, replay_rate=rate, replay_burst=burst)
    for i in range(3):
        pub.publish(batch(i))
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(rep)
    try:
        answered_at = []
        t0 = time.monotonic()
        for _ in range(n):
            dealer.send_multipart([b"", (1 << 64 - 1).to_bytes(8, "big")])
            while _recv(dealer)[2] != END:
                pass
            answered_at.append(time.monotonic() - t0)
        stats = pub.stats()
        assert stats["replay_requests"] == n
        must_wait = sum(1 for k, e in enumerate(answered_at) if burst - k + rate * e < 1.0)
        # a fast machine: requests 2..5 each found the bucket empty; a slow one: fewer had to
        assert must_wait <= stats["replay_rate_limited"] <= n - burst, (answered_at, stats)
        assert answered_at[-1] >= (n - burst) / rate, answered_at  # paced: 6 answers took >= 80 ms
    finally:
        dealer.close(0)
        pub.shutdown()


def test_malformed_replay_requests_are_counted() -> None:
    ep, rep = ipc_pair()
    pub = ZmqEventPublisher(ep, rep)
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(rep)
    try:
        dealer.send_multipart([b"", b"\x01\x02"])
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        assert _recv(dealer)[2] == END  # still serving after the bad one
        assert pub.stats()["replay_malformed"] == 1
    finally:
        dealer.close(0)
        pub.shutdown()


def test_tcp_loopback_and_dp_rank_offsets() -> None:
    port = free_tcp_port()
    pub = ZmqEventPublisher(f"tcp://127.0.0.1:{port - 1}", mode="bind", data_parallel_rank=1)
    try:
        assert pub.endpoint == f"tcp://127.0.0.1:{port}"
        sub = _raw_sub(pub.endpoint)
        deadline = time.monotonic() + 10
        while not sub.poll(20):
            assert time.monotonic() < deadline
            pub.publish(batch(1))
        assert len(sub.recv_multipart()) == 3
        sub.close(0)
    finally:
        pub.shutdown()
    ep, rep = ipc_pair()
    pub2 = ZmqEventPublisher(ep, rep, data_parallel_rank=2)
    assert (pub2.endpoint, pub2.replay_endpoint) == (ep + "_dp2", rep + "_dp2")
    pub2.shutdown()


@pytest.mark.parametrize("endpoint,rank,expected", [
    ("tcp://*:5557", 0, "tcp://*:5557"),
    ("tcp://*:5557", 3, "tcp://*:5560"),
    ("tcp://10.0.0.1:6000", 1, "tcp://10.0.0.1:6001"),
    ("ipc:///tmp/kv", 2, "ipc:///tmp/kv_dp2"),
    ("inproc://cache", 1, "inproc://cache_dp1"),
    (None, 4, None),
])
def test_offset_endpoint(endpoint, rank, expected) -> None:
    assert offset_endpoint(endpoint, rank) == expected


def test_bind_or_connect_rules() -> None:
    assert should_bind("tcp://*:5557") and should_bind("tcp://0.0.0.0:1") and should_bind("ipc:///x")
    assert should_bind("inproc://x") and not should_bind("tcp://10.0.0.1:5557")
    assert should_bind("tcp://10.0.0.1:5557", "bind") and not should_bind("ipc:///x", "connect")


@pytest.mark.parametrize("bad", ["", "localhost:5557", "tcp://host", "tcp://h:99999", "udp://h:1", "tcp://:x"])
def test_bad_endpoints_are_typed_errors(bad) -> None:
    with pytest.raises(EndpointError):
        validate_endpoint(bad)
    with pytest.raises(EndpointError):
        ZmqEventPublisher(bad)


def test_port_offset_past_65535_is_an_error() -> None:
    with pytest.raises(EndpointError, match="65535"):
        offset_endpoint("tcp://*:65535", 1)


def test_bind_conflict_is_an_endpoint_error() -> None:
    ep, _ = ipc_pair()
    port = free_tcp_port()
    a = ZmqEventPublisher(f"tcp://127.0.0.1:{port}", mode="bind")
    try:
        with pytest.raises(EndpointError, match="cannot open"):
            ZmqEventPublisher(f"tcp://127.0.0.1:{port}", mode="bind")
    finally:
        a.shutdown()


def test_bad_config_values() -> None:
    ep, _ = ipc_pair()
    with pytest.raises(ConfigError, match="overflow"):
        ZmqEventPublisher(ep, overflow="block")
    with pytest.raises(ConfigError, match="buffer_steps"):
        ZmqEventPublisher(ep, buffer_steps=0)
    with pytest.raises(TypeError, match="KVEventBatch"):
        ZmqEventPublisher(ep).publish({"ts": 1})


def test_factory_registry() -> None:
    assert isinstance(EventPublisherFactory.create(), kvevents.NullEventPublisher)
    null = EventPublisherFactory.create(KVEventsConfig(enable_kv_cache_events=True, publisher="null"))
    null.publish(batch(0))
    assert null.stats() == {"batches": 1, "events": 1}
    ep, rep = ipc_pair()
    zp = EventPublisherFactory.create(KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=ep,
                                                        replay_endpoint=rep, topic="x"), data_parallel_rank=1)
    assert isinstance(zp, ZmqEventPublisher) and zp.endpoint == ep + "_dp1"
    zp.shutdown()
    with pytest.raises(ConfigError, match="known: .*null.*zmq"):
        EventPublisherFactory.create(KVEventsConfig(enable_kv_cache_events=True, publisher="kafka"))
    EventPublisherFactory.register("mine-test", "kvevents.publisher_base", "NullEventPublisher")
    with pytest.raises(ConfigError, match="already registered"):
        EventPublisherFactory.register("mine-test", "x", "y")
    EventPublisherFactory.register("broken-test", "no.such.module", "X")
    with pytest.raises(ConfigError, match="cannot be loaded"):
        EventPublisherFactory.create(KVEventsConfig(enable_kv_cache_events=True, publisher="broken-test"))
