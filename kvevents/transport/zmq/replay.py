"""The replay server: a ROUTER socket answering ``[b"", start_seq]`` from a publisher's ring.

It runs on its own thread, so a large replay never stalls live publishing; it serves in
chunks and polls for POLLOUT with a bound, so a client that stops reading is cut off
(``replay_aborted``) instead of holding the thread. Each client (ZeroMQ identity) is
rate-limited by a token bucket: a request over the limit waits for its turn
(``replay_rate_limited``, counted once per waiting request); a newer request from the same
client replaces its pending one. Frame shapes: :mod:`kvevents.transport.zmq.frames`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from ...publisher_base import PublisherStats, _Ring
from .frames import end_marker, parse_replay_request, replay_answer

__all__ = ["ReplayServer"]

#: idle replay clients remembered (their token buckets) before the idle ones are forgotten
MAX_CLIENTS = 4096


class ReplayServer:
    """Serves replay requests on ``sock`` (a bound ROUTER) from ``ring``, counting into ``stats``.

    ``hooks`` returns the telemetry hook object (or None) at the time of each replay: the
    publisher's ``hooks`` attribute, which telemetry installs and removes at any time.
    """

    def __init__(self, sock: zmq.Socket, ring: _Ring, stats: PublisherStats, *, rate: float, burst: int,
                 hooks: Callable[[], Any] = lambda: None) -> None:
        self._sock = sock
        self._ring = ring
        self._stats = stats
        self._rate = float(rate)
        self._burst = burst
        self._hooks = hooks
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="kvevents-replay", daemon=True)

    @classmethod
    def bind(cls, ctx: zmq.Context, endpoint: str, ring: _Ring, stats: PublisherStats, **kw: Any) -> "ReplayServer":
        """A ROUTER bound on ``endpoint`` (raises zmq.ZMQError; the socket is closed then)."""
        sock = ctx.socket(zmq.ROUTER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.bind(endpoint)
        except zmq.ZMQError:
            sock.close(0)
            raise
        return cls(sock, ring, stats, **kw)

    def start(self) -> None:
        self._thread.start()

    def request_stop(self) -> None:
        """Serve nothing more: a replay in progress ends at its next batch."""
        self._closing = True

    def stop(self, timeout: float = 2.0) -> None:
        """Stop serving and wait (up to ``timeout``) for the thread, which closes the socket."""
        self._closing = True
        if self._thread.is_alive():
            self._thread.join(timeout)
        elif self._thread.ident is None:  # never started: the socket is still ours to close
            self._sock.close(0)

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self._sock.close(0)

    def _loop(self) -> None:
        sock = self._sock
        stats = self._stats
        buckets: dict[bytes, list[float]] = {}  # identity -> [tokens, last refill time]
        waiting: dict[bytes, int] = {}  # identity -> start seq of its pending request
        deferred: set[bytes] = set()  # identities whose pending request was already counted as limited
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        while not self._closing:
            if poller.poll(20 if waiting else 200):
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    req = parse_replay_request(frames)
                    if req is None:
                        stats.replay_malformed += 1
                        continue
                    stats.replay_requests += 1
                    # a newer request from the same client replaces its pending one
                    waiting[req[0]] = req[1]
            if len(buckets) > MAX_CLIENTS:  # forget idle clients
                buckets = {k: v for k, v in buckets.items() if k in waiting}
            now = time.monotonic()
            for ident in list(waiting):
                bucket = buckets.setdefault(ident, [float(self._burst), now])
                bucket[0] = min(float(self._burst), bucket[0] + (now - bucket[1]) * self._rate)
                bucket[1] = now
                if bucket[0] < 1.0:
                    if ident not in deferred:
                        deferred.add(ident)
                        stats.replay_rate_limited += 1
                    continue
                bucket[0] -= 1.0
                deferred.discard(ident)
                self._serve(ident, waiting.pop(ident))

    def _serve(self, ident: bytes, start: int) -> None:
        hooks = self._hooks()
        if hooks is None:
            self._serve_replay(ident, start)
            return
        t0 = time.time_ns()
        served = self._stats.replay_batches_served
        self._serve_replay(ident, start)
        hooks.on_replay(start, self._stats.replay_batches_served - served, t0)

    def _serve_replay(self, ident: bytes, start: int) -> None:
        sock = self._sock
        stats = self._stats
        try:
            for seq, topic, payload in self._ring.since(start):
                if self._closing:
                    return
                if not sock.poll(1000, zmq.POLLOUT):
                    stats.replay_aborted += 1
                    return
                sock.send_multipart(replay_answer(ident, topic, seq, payload))
                stats.replay_batches_served += 1
            sock.send_multipart(end_marker(ident))
        except zmq.ZMQError:  # EHOSTUNREACH: the client went away
            stats.replay_aborted += 1
