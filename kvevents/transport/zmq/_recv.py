"""The subscriber's one read loop, in Python through pyzmq's public API.

:func:`drain` reads the messages waiting on a socket without waiting, each as the list of its
frames' bytes. Every socket the subscriber reads goes through it: the connect-mode SUB sockets
and the bound SUB socket (:mod:`.restarts`), the replay DEALERs (:mod:`.subscriber`).

Why this loop (benchmarks/NOTES.md, issue 25): ``recv(NOBLOCK, copy=False)`` and the Frame's
``more`` flag, which pyzmq fills from ``RCVMORE`` in C as it receives, then ``Frame.bytes``.
``getsockopt(RCVMORE)`` after a copying ``recv`` builds a ``SocketOption`` enum per call (so does
the backend's ``get``), and ``recv_multipart`` is that loop in Python: 2.3 / 2.3 / 2.7 against
1.7 us of CPU per 3-frame message. There is no C drain: a C extension bound to the libzmq pyzmq
loaded needs libzmq's headers, which pyzmq's wheels do not ship.
"""

from __future__ import annotations

import zmq

__all__ = ["drain"]

_NOBLOCK, _SRCFD = zmq.NOBLOCK, zmq.SRCFD


def drain(sock: zmq.Socket, limit: int, srcfd: bool = False) -> tuple[list[list[bytes]], list[int] | None, bool]:
    """Up to ``limit`` whole messages waiting on ``sock``: (messages, descriptors, dry).

    ``descriptors`` (with ``srcfd``) holds each message's connection descriptor (``SRCFD`` of
    its first frame), else None. ``dry``: the socket had no message left (a message's frames
    arrive together, so only a first frame can find none). A ``zmq.ZMQError`` other than
    ``Again`` propagates.
    """
    recv = sock.recv
    msgs: list[list[bytes]] = []
    fds: list[int] | None = [] if srcfd else None
    append = msgs.append
    for _ in range(limit):
        try:
            f = recv(_NOBLOCK, False)  # copy=False, positional: no keyword parsing
        except zmq.Again:
            return msgs, fds, True
        if fds is not None:
            fds.append(f.get(_SRCFD))
        frames = [f.bytes]
        while f.more:
            f = recv(0, False)
            frames.append(f.bytes)
        append(frames)
    return msgs, fds, False
