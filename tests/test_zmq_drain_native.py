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
