"""The live path's one read loop (kvevents.transport.zmq._recv.drain): whole messages, in order,
as recv_multipart reads them; a limit; the dry flag; each message's connection descriptor."""

from __future__ import annotations

import zmq

from kvevents.transport.zmq import _recv

from .pubsub_helpers import collect_until, ipc_pair


def _pair(ep: str) -> tuple[zmq.Socket, zmq.Socket]:
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    for s in (a, b):
        s.setsockopt(zmq.LINGER, 0)
    b.bind(ep)
    a.connect(ep)
    return a, b


def test_drain_reads_whole_messages_as_recv_multipart_does() -> None:
    a, b = _pair(ipc_pair()[0])
    try:
        sent = [[b"kv@p@m", s.to_bytes(8, "big"), b"payload-%d" % s] for s in range(5)]
        sent += [[b""], [b"one"], [b"a", b"", b"c", b"d" * 70_000]]  # odd shapes, a frame past the copy threshold
        for m in sent:
            a.send_multipart(m)
        assert collect_until(lambda: b.poll(0))
        got, dry = [], False
        while len(got) < len(sent):
            msgs, fds, dry = _recv.drain(b, 3)
            assert fds is None and len(msgs) <= 3
            got += msgs
            if len(got) < len(sent) and not msgs:
                assert b.poll(5000)
        assert got == sent
        assert _recv.drain(b, 64) == ([], None, True)  # nothing left: dry
    finally:
        a.close(0)
        b.close(0)


def test_a_full_drain_is_not_dry_and_the_rest_stays_queued() -> None:
    a, b = _pair(ipc_pair()[0])
    try:
        for s in range(10):
            a.send_multipart([b"t", s.to_bytes(8, "big")])
        msgs = []
        while len(msgs) < 4:  # the frames reach the socket in their own time
            part, _, dry = _recv.drain(b, 4 - len(msgs))
            msgs += part
            if len(msgs) < 4:
                assert b.poll(5000)
        assert not dry and [int.from_bytes(m[1], "big") for m in msgs] == [0, 1, 2, 3]
        rest = []
        while len(rest) < 6:
            part, _, _ = _recv.drain(b, 64)
            rest += part
            if len(rest) < 6:
                assert b.poll(5000)
        assert [int.from_bytes(m[1], "big") for m in rest] == list(range(4, 10))
    finally:
        a.close(0)
        b.close(0)


def test_drain_gives_each_message_its_connection_descriptor() -> None:
    ep = ipc_pair()[0]
    ctx = zmq.Context.instance()
    b = ctx.socket(zmq.PULL)
    b.setsockopt(zmq.LINGER, 0)
    b.bind(ep)
    senders = [ctx.socket(zmq.PUSH) for _ in range(2)]
    try:
        for k, s in enumerate(senders):
            s.setsockopt(zmq.LINGER, 0)
            s.connect(ep)
            s.send_multipart([b"from-%d" % k, b"x"])
        got: list = []
        fds: list = []
        while len(got) < 2:
            assert b.poll(5000)
            msgs, f, _ = _recv.drain(b, 64, srcfd=True)
            got += msgs
            fds += f
        assert sorted(m[0] for m in got) == [b"from-0", b"from-1"]
        assert len(fds) == 2 and len(set(fds)) == 2 and all(fd > 0 for fd in fds)  # two connections, told apart
    finally:
        for s in senders:
            s.close(0)
        b.close(0)


def test_an_error_other_than_again_propagates() -> None:
    a, b = _pair(ipc_pair()[0])
    a.close(0)
    b.close(0)
    try:
        _recv.drain(b, 64)
    except zmq.Again:  # a closed socket is not "dry": the caller must see it
        raise AssertionError("a closed socket read as dry") from None
    except zmq.ZMQError as e:
        assert e.errno == zmq.ENOTSOCK
    else:
        raise AssertionError("a drain of a closed socket returned")
