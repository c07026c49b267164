"""A drain of one socket, in Python through pyzmq's public API: the live path's one read loop.

:func:`drain` reads the messages waiting on a socket without waiting, each as the list of its
frames' bytes: ``recv(copy=False)`` and the Frame's ``more`` flag (no ``getsockopt(RCVMORE)``,
which builds an enum per call: 1.86 vs 2.63 us of CPU per 3-frame message, benchmarks/NOTES.md).

``NATIVE`` is None: there is no C helper for the live path any more (a C drain bound to libzmq
needs libzmq's headers and the very libzmq pyzmq loaded, which pyzmq's wheels do not offer to
other extensions; benchmarks/NOTES.md). It stays importable, with ``STATUS``, for the
subscriber's drain, which checks it.
"""

from __future__ import annotations

import zmq

__all__ = ["NATIVE", "STATUS", "drain"]

NATIVE = None
STATUS = "python (pyzmq's recv and send)"

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
            f = recv(_NOBLOCK, copy=False)
        except zmq.Again:
            return msgs, fds, True
        if fds is not None:
            fds.append(f.get(_SRCFD))
        frames = [f.bytes]
        while f.more:
            f = recv(0, copy=False)
            frames.append(f.bytes)
        append(frames)
    return msgs, fds, False
