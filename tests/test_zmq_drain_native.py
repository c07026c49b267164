"""The C drain of a subscriber socket (kvevents.transport.zmq._zmqrecv) reads exactly what the
Python frame-by-frame loop reads: every message whole, in order, any shape; it stops at `max`
and says when the socket ran dry; bad arguments are refused with a clear error."""

from __future__ import annotations

import pytest
import zmq

from kvevents.transport.zmq import _recv

pytestmark = pytest.mark.skipif(_recv.NATIVE is None, reason=f"C drain unavailable: {_recv.STATUS}")


@pytest.fixture
def pair():
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://drain")
    b.connect("inproc://drain")
    yield a, b
    a.close(0)
    b.close(0)
    ctx.term()


def _wait_readable(sock) -> None:
    assert sock.poll(5000, zmq.POLLIN), "nothing arrived"


def test_drain_reads_whole_messages_of_any_shape_in_order(pair) -> None:
    a, b = pair
    sent = [[b"kv@p@m", (7).to_bytes(8, "big"), b"x" * 3000], [b"one"], [b""] * 5, [b"t", b"s"],
            [b"big", b"y" * 200_000, b""]]
    for m in sent:
        a.send_multipart(m)
    _wait_readable(b)
    msgs, dry, err = _recv.NATIVE.drain(b.underlying, 64)
    assert msgs == sent and dry is True and err == 0
    assert all(type(f) is bytes for m in msgs for f in m)
    assert _recv.NATIVE.drain(b.underlying, 64) == ([], True, 0)


def test_drain_stops_at_max_without_calling_the_socket_dry(pair) -> None:
    a, b = pair
    for i in range(10):
        a.send_multipart([b"t", i.to_bytes(8, "big"), b"p%d" % i])
    _wait_readable(b)
    first, dry, err = _recv.NATIVE.drain(b.underlying, 4)
    assert [m[2] for m in first] == [b"p%d" % i for i in range(4)] and dry is False and err == 0
    rest, dry, err = _recv.NATIVE.drain(b.underlying, 64)
    assert [m[2] for m in rest] == [b"p%d" % i for i in range(4, 10)] and dry is True
    # the Python loop reads the same socket the same way afterwards
    a.send_multipart([b"after", b"x"])
    _wait_readable(b)
    assert b.recv_multipart(zmq.NOBLOCK) == [b"after", b"x"]


def test_drain_refuses_bad_arguments(pair) -> None:
    _, b = pair
    with pytest.raises(ValueError, match="max"):
        _recv.NATIVE.drain(b.underlying, 0)
    with pytest.raises(ValueError, match="max"):
        _recv.NATIVE.drain(b.underlying, 5000)
    with pytest.raises(ValueError, match="null"):
        _recv.NATIVE.drain(0, 1)
    with pytest.raises(TypeError):
        _recv.NATIVE.drain("socket", 1)


def test_status_names_the_path_taken() -> None:
    assert _recv.STATUS.startswith("native (libzmq 4.")


def test_send_live_sends_each_item_as_topic_seq_payload_in_order(pair) -> None:
    a, b = pair
    items = [(s, b"kv@p@m", b"payload-%d" % s, "rest is ignored") for s in (0, 1, 2**64 - 2)]
    assert _recv.NATIVE.send_live(a.underlying, items) == (3, sum(len(i[2]) for i in items), 0)
    _wait_readable(b)
    msgs, _, _ = _recv.NATIVE.drain(b.underlying, 64)
    assert msgs == [[b"kv@p@m", s.to_bytes(8, "big"), b"payload-%d" % s] for s in (0, 1, 2**64 - 2)]
    assert _recv.NATIVE.send_live(a.underlying, []) == (0, 0, 0)


def test_send_live_refuses_bad_items_before_sending_them(pair) -> None:
    a, b = pair
    with pytest.raises(TypeError, match="item 1"):
        _recv.NATIVE.send_live(a.underlying, [(0, b"t", b"p"), (1, "t", b"p")])
    with pytest.raises(OverflowError):
        _recv.NATIVE.send_live(a.underlying, [(-1, b"t", b"p")])
    with pytest.raises(TypeError):
        _recv.NATIVE.send_live(a.underlying, ((0, b"t", b"p"),))  # a list, not a tuple
    _wait_readable(b)  # the first item of the first call went before item 1 was refused
    assert b.recv_multipart(zmq.NOBLOCK) == [b"t", (0).to_bytes(8, "big"), b"p"]
    assert not b.poll(0)


def test_the_publisher_counts_the_same_with_and_without_the_c_sends(monkeypatch, tmp_path) -> None:
    """The live path with send_live, then the Python loop: same frames, same counters."""
    import time

    from kvevents import BlockStored, KVEventBatch, ZmqEventPublisher
    from kvevents.transport.zmq import publisher as pubmod

    def run(native):
        monkeypatch.setattr(pubmod, "_NATIVE", native)
        ep = f"ipc://{tmp_path}/p{native is None}"
        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(ep)
        pub = ZmqEventPublisher(ep, topic="kv@p@m")
        try:
            deadline = time.monotonic() + 10
            while not sub.poll(50):  # the slow joiner: publish a probe until one arrives
                pub.publish_raw(b"probe")
                assert time.monotonic() < deadline
            while sub.poll(50):
                sub.recv_multipart()
            first = pub.next_seq
            for i in range(100):
                pub.publish(KVEventBatch(1.0, [BlockStored([i], None, [1, 2], 2, None, "GPU", None)] * (i % 3 + 1)))
            frames = [sub.recv_multipart() for _ in range(100)]
            pub.shutdown(1)  # joins the sender thread: it counts a group after sending it
            stats = pub.stats()
        finally:
            pub.shutdown(1)
            sub.close(0)
        return [[f[0], int.from_bytes(f[1], "big") - first, f[2]] for f in frames], stats

    with_c, stats_c = run(_recv.NATIVE)
    with_py, stats_py = run(None)
    assert with_c == with_py and [f[1] for f in with_c] == list(range(100))
    for stats in (stats_c, stats_py):  # (probes are raw payloads: batches, not events)
        assert stats["events_published"] == sum(i % 3 + 1 for i in range(100))
        assert stats["send_errors"] == stats["encode_errors"] == 0
