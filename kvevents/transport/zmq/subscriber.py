"""A subscriber that follows many publishers and heals gaps by replay.

Two ways to meet publishers:

* connect mode (default): ``Subscriber(["tcp://10.0.0.5:5557", PublisherSpec(...)])`` — one SUB
  socket per publisher, so each delivery names the publisher it came from (its ``name``,
  else its endpoint), whatever topic it uses;
* bind mode: ``Subscriber(bind="tcp://127.0.0.1:5557", replay_endpoints={topic: endpoint})`` —
  the subscriber binds and publishers connect (vLLM publishers whose endpoint names a
  concrete host connect); publishers are told apart by topic, so give each its own. Restarts
  are found from the connections (:mod:`.conns`), as connect mode finds them from its own socket.
  At most ``max_connections`` are open; a ZMTP heartbeat every ``heartbeat`` s closes a peer that
  stops answering (a half-open connection).

``poll(timeout_ms)`` does the socket work in the calling thread; ``for d in sub`` polls until
``close()``; ``deliveries(duration=...)`` stops by itself; ``async for`` polls on a thread.
Malformed input is counted by kind in ``health()`` and skipped; an undecodable payload whose
seq is known becomes a GAP delivery, so a consumer knows its state may be incomplete.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import replace

import zmq

from ...codec import decode_batch
from ...delivery import Delivery, PublisherHealth
from ...errors import DecodeError, EndpointError
from ...source import EventSource
from ...tracker import SeqTracker
from ._recv import drain
from .conns import DROP, NEW, BindConnections, local_address
from .endpoints import PublisherSpec, probe_replay_endpoint, publisher_spec, validate_endpoint
from .frames import is_end_marker, is_replay_answer, replay_request
from .peers import MOOT, RESTART, Peer, PeerTable, is_connected
from .restarts import DRAIN as _DRAIN
from .restarts import RestartDetector, tail_bound

__all__ = ["Subscriber", "PublisherSpec"]


class Subscriber(EventSource):
    """The ZeroMQ event source (see the module docstring); ``open_source("tcp://...")`` builds one."""

    def __init__(
        self,
        publishers: Iterable[str | PublisherSpec | tuple] = (),
        *,
        topic: str = "",
        bind: str | None = None,
        replay_endpoints: dict[str, str] | None = None,
        late_join: bool = False,
        stale_after: float = 10.0,
        replay_timeout: float = 2.0,
        max_pending: int = 10_000,
        rcvhwm: int = 100_000,
        context: zmq.Context | None = None,
        raw: bool = False,
        max_publishers: int = 1024,
        tail_probe_after: float | None = 1.0,
        max_connections: int = 1024,
        heartbeat: float | None = 5.0,
    ) -> None:
        self.topic = topic
        #: deliver payloads undecoded (``Delivery.payload``, ``batch`` None): for a consumer that
        #: decodes them itself (``KVRouter.apply_payload``); a malformed payload then reaches
        #: the consumer as a BATCH, which must count it (the router does, and marks the pod
        #: unreliable as for a lost batch)
        self.raw = raw
        self.late_join = late_join
        self.stale_after = stale_after
        self.replay_timeout = replay_timeout
        self.max_pending = max_pending
        self._ctx = context or zmq.Context.instance()
        self._poller = zmq.Poller()
        self._by_sock: dict[zmq.Socket, tuple[str, Peer | None]] = {}
        for what, v in (("max_publishers", max_publishers), ("max_connections", max_connections)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise EndpointError(f"{what} must be a positive int, got {v!r}")
        if heartbeat is not None and not (isinstance(heartbeat, (int, float)) and 0.001 <= heartbeat <= 3600):
            raise EndpointError(f"heartbeat must be None or seconds in [0.001, 3600], got {heartbeat!r}")
        #: publishers, bounded (bind mode learns them from topics: ``max_publishers``); idle
        #: ones get a replay probe after ``tail_probe_after`` seconds (None: never), see .peers
        self._table = PeerTable(max_publishers, stale_after, tail_probe_after)
        self._peers: dict[str, Peer] = self._table.by_name
        self._malformed: dict[str, int] = {}  # malformed frames on a shared (bind-mode) socket
        self._rcvhwm = rcvhwm
        self._heartbeat = heartbeat
        self._replay_map = dict(replay_endpoints or {})
        self._bind_sub = None
        self._conns: BindConnections | None = None  # bind mode: who is on which connection
        self._closed = False
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        #: telemetry hook object (installed by kvevents.telemetry; None: the cost is one check)
        self.hooks = None
        #: wire tap: ``tap(publisher, socket, frames)`` sees every message as received, before
        #: any check or healing (``socket`` "pub" or "replay"; ``publisher`` None for the shared
        #: bind-mode socket). The recorder writes what it is given. None: one check per message
        self.tap = None
        specs = [publisher_spec(p) for p in publishers]
        if bind is None and not specs:
            raise EndpointError("Subscriber needs publisher endpoints, or bind=ENDPOINT for publishers to connect to")
        for ep in self._replay_map.values():
            validate_endpoint(ep, what="replay endpoint")
        try:
            for spec in specs:
                self._add_peer(spec)
            if bind is not None:
                validate_endpoint(bind, what="bind endpoint")
                sock = self._new_sub()  # (with the heartbeat)
                # its monitor first: polled before the socket; at most max_connections open (.conns)
                self._conns = BindConnections(sock, tail_bound(rcvhwm, 2), max_connections)
                self._register(self._conns.monitor, "bindmon", None)
                sock.bind(bind)
                self._conns.local = local_address(sock.getsockopt_string(zmq.LAST_ENDPOINT))
                self._bind_sub = sock
                self._register(sock, "bind", None)
        except zmq.ZMQError as exc:
            self.close()
            raise EndpointError(f"cannot open subscriber sockets: {exc}") from None
        #: restart detection, with what it may do here (see .restarts)
        self._restarts = RestartDetector(ask=self._send_request, forget=self._drop_dealer,
                                         attend=self._table.active.add, use=self._on_live, conns=self._conns,
                                         tail=tail_bound(rcvhwm), replay_timeout=replay_timeout,
                                         max_pending=max_pending)

    @classmethod
    def from_urls(cls, urls: list[str], *, bind: bool = False, names: dict[str, str] | None = None,
                  replays: dict[str, str] | None = None, **options) -> "Subscriber":
        """Connected to every PUB endpoint in ``urls`` (``names``, ``replays``: an endpoint's
        identity in deliveries and its replay endpoint); ``bind=True``: bound at the one URL, the
        publishers connecting to it (``replay_endpoints`` by topic)."""
        if bind:
            if len(urls) != 1:
                raise EndpointError(f"a bind-mode subscriber binds one endpoint, got {urls}")
            return cls(bind=urls[0], **options)
        names, replays = names or {}, replays or {}
        return cls([PublisherSpec(u, replays.get(u), names.get(u)) for u in urls], **options)

    # ---- setup -------------------------------------------------------------------------------
    def _new_sub(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self._rcvhwm)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        if self._heartbeat is not None:  # a peer that stops answering (its host died, no FIN) is closed
            sock.setsockopt(zmq.HEARTBEAT_IVL, int(self._heartbeat * 1000))
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(self._heartbeat * 1000))
        return sock

    def _register(self, sock: zmq.Socket, kind: str, peer: Peer | None) -> None:
        self._poller.register(sock, zmq.POLLIN)
        self._by_sock[sock] = (kind, peer)

    def _make_peer(self, name: str, replay_endpoint: str | None, topic: str = "", bind: bool = False) -> Peer:
        if name in self._peers:
            raise EndpointError(f"two publishers share the identity {name!r}: give them distinct names")
        now = time.time()
        tracker = SeqTracker(name, topic, can_replay=bool(replay_endpoint), late_join=self.late_join,
                             replay_timeout=self.replay_timeout, max_pending=self.max_pending, now=now)
        peer = Peer(name, replay_endpoint, tracker, bind)
        self._table.add(peer, now)
        return peer

    def _learn(self, topic: str, now: float) -> Peer | None:
        """A bind-mode publisher first heard under ``topic``: a new peer, if the bound allows."""
        ok, expired = self._table.make_room(now)
        if expired is not None:
            self._drop_dealer(expired)
            self._conns.forget(expired)
        return self._make_peer(topic, self._replay_map.get(topic), topic, bind=True) if ok else None

    def _add_peer(self, spec: PublisherSpec) -> None:
        peer = self._make_peer(spec.name or spec.endpoint, spec.replay_endpoint)
        peer.sub = self._new_sub()
        # reconnects trigger the restart check (see .peers), or without a replay endpoint a RESET;
        # disconnects say the publisher is unreachable (liveness from evidence: is_connected)
        peer.monitor = peer.sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._register(peer.monitor, "monitor", peer)
        peer.sub.connect(spec.endpoint)
        self._register(peer.sub, "live", peer)
        self._send_request(peer)

    def _dealer(self, peer: Peer) -> zmq.Socket:
        if peer.dealer is None:
            peer.dealer = self._ctx.socket(zmq.DEALER)
            peer.dealer.setsockopt(zmq.LINGER, 0)
            peer.dealer.connect(peer.replay_endpoint)
            self._register(peer.dealer, "replay", peer)
        return peer.dealer

    def _drop_dealer(self, peer: Peer) -> None:
        """Forget a replay socket so late answers to an abandoned request cannot arrive."""
        if peer.dealer is not None:
            self._poller.unregister(peer.dealer)
            del self._by_sock[peer.dealer]
            peer.dealer.close(0)
            peer.dealer = None

    def _send_request(self, peer: Peer, strict: bool = False) -> None:
        start = peer.tracker.request
        if start is None or not peer.replay_endpoint:
            return
        peer.tracker.request = None
        self._table.active.add(peer)
        self._drop_dealer(peer)  # a fresh socket per request: no stale answers mixed in
        # from the last delivered batch when it is close: its payload must not have changed
        self._dealer(peer).send_multipart(replay_request(peer.replay_start(start, strict)), zmq.NOBLOCK)
        if self.hooks is not None:
            self.hooks.on_replay_request(peer.name, peer.tracker.topic, start)

    # ---- the loop ----------------------------------------------------------------------------

    def poll(self, timeout_ms: int = 100) -> list[Delivery]:
        """Wait up to ``timeout_ms`` for input and return every delivery it produced."""
        if self._closed:
            raise RuntimeError("Subscriber is closed")
        out: list[Delivery] = []
        ready = self._poller.poll(timeout_ms)
        now = time.time()
        tap = self.tap
        restarts = self._restarts
        for sock, _ in ready:
            kind, peer = self._by_sock.get(sock, (None, None))
            if kind is None:
                continue
            if kind == "monitor":
                restarts.monitor(peer, now, out)
                continue
            if kind == "bindmon":  # then the socket: a close read is followed by an EAGAIN (.conns)
                self._conns.read_events()
                restarts.read_bound(self._bind_sub, now, out, tap)
                continue
            if kind == "bind":
                restarts.read_bound(sock, now, out, tap)
                continue
            if kind == "live":
                restarts.read_live(peer, sock, now, out, tap)
                continue
            for _ in range(_DRAIN):  # bounded drain per socket keeps publishers fair
                # a message at a time: what arrives while one is used is read in this poll too,
                # and nothing is read past an answer that dropped this socket (closed)
                msgs, _, dry = drain(sock, 1)
                if dry:
                    break
                frames = msgs[0]
                if tap is not None:
                    tap(peer.name, "replay", frames)
                self._on_replay(peer, frames, now, out)
                if peer.dealer is not sock:
                    break
        table = self._table
        if table.probe_after is not None:
            for peer in table.due_probes(now):
                if peer.tracker.check(now, probe=True):
                    self._send_request(peer)
        for peer in list(table.active):  # O(active): idle publishers cost nothing here
            tracker = peer.tracker
            if tracker.recovering:
                if peer.suspect and tracker.pending and now >= tracker.deadline:
                    # a reconnect check went unanswered with the new connection's batches held:
                    # they cannot be verified, so they are not spliced on either
                    restarts.restart(peer, now, out, verified=False)
                    continue
                out.extend(tracker.tick(now))
                if not tracker.recovering:
                    self._drop_dealer(peer)
                    if self.hooks is not None:
                        self.hooks.on_replay_end(peer.name, False)
                    if self.late_join and tracker.rejoin(now):  # the publisher is not up yet: ask again
                        tracker.health.join_retries += 1
            if tracker.request is not None:
                self._send_request(peer)
            elif not tracker.recovering and not (peer.unplaced_due and restarts.unplaced(peer, now, out)):
                table.active.discard(peer)
                self._drop_dealer(peer)
        if self.hooks is not None and out:
            self.hooks.on_deliveries(out)
        return out

    def _count(self, peer: Peer | None, kind: str) -> None:
        d = peer.tracker.health.malformed if peer else self._malformed
        d[kind] = d.get(kind, 0) + 1

    def _on_live(self, peer: Peer | None, frames: list[bytes], now: float, out: list[Delivery], fd: int = -1) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:  # validated before a bind-mode peer is made for its topic
            self._count(peer, "frames" if len(frames) != 3 else "seq")
            if fd >= 0:
                self._conns.unnamed(fd)
            return
        topic_b, seq_b, payload = frames
        topic = topic_b.decode(errors="replace")
        if peer is None:  # bind mode: the topic names the publisher
            peer = self._peers.get(topic)
            if peer is None:
                peer = self._learn(topic, now)
                if peer is None:
                    if fd >= 0:
                        self._conns.unnamed(fd)
                    return  # refused: at max_publishers (counted)
            self._table.heard(peer)
            if fd >= 0 or not peer.settled:  # (settled: its frames can only be its connection's)
                verdict = self._conns.classify(peer, fd)
                if verdict == DROP:  # a connection's tail it left, or one that cannot be placed
                    peer.tracker.health.old_conn_dropped += 1
                    return
                if verdict == NEW:
                    self._restarts.reconnected(peer, int.from_bytes(seq_b, "big"), now, out)
        if peer.old_next >= 0 and peer.old_leftover(int.from_bytes(seq_b, "big")):  # (after a RESET)
            peer.tracker.health.old_conn_dropped += 1
            # the old run's, unread when its RESET came: it went with the old run (the socket is
            # busy with its tail: no idle probe while it drains)
            peer.tracker.health.last_recv_ts = now
            return
        if peer.suspect:  # a reconnect not verified yet: hold, check again; never spill unverified
            self._restarts.held(peer, int.from_bytes(seq_b, "big"), now, out)
        hooks = self.hooks
        if hooks is not None:
            t0 = time.time_ns()  # (~50 ns; the seq is not known until after the decode)
        if self.raw:
            batch = payload if type(payload) is bytes else bytes(payload)
        else:
            try:
                batch = decode_batch(payload)  # the codec's fast path: the current encoding one call deep
            except DecodeError:
                self._count(peer, "payload")
                batch = None
        seq = int.from_bytes(seq_b, "big")
        if hooks is not None and not seq % hooks.every:  # live receive hooks: sampled seqs only
            hooks.on_receive(peer.name, topic, seq, batch, len(payload), t0, False)
        tracker = peer.tracker
        got = tracker.on_live(seq, batch, now, topic)
        if got:
            out.extend(got)
            if got[-1].seq == seq and tracker.expected == seq + 1:  # delivered now: the restart anchor
                peer.anchor_seq, peer.anchor, peer.anchor_run = seq, payload, tracker.health.resets
        if tracker.request is not None:
            self._send_request(peer)

    def _on_replay(self, peer: Peer, frames: list[bytes], now: float, out: list[Delivery]) -> None:
        tracker = peer.tracker
        if is_end_marker(frames):
            if peer.checking >= 0 and peer.verdict(None, None) == RESTART:
                self._restarts.restart(peer, now, out)
                return
            out.extend(tracker.on_replay_end(now))
            self._drop_dealer(peer)
            if self.hooks is not None:
                self.hooks.on_replay_end(peer.name, True)
            if tracker.request is not None:
                self._send_request(peer)
            return
        if not is_replay_answer(frames):
            self._count(peer, "replay")
            return
        seq = int.from_bytes(frames[2], "big")
        anchor = peer.checking
        if anchor >= 0:
            verdict = peer.verdict(seq, frames[3])
            if verdict == RESTART:
                self._restarts.restart(peer, now, out)
                return
            if verdict == MOOT:  # the ring moved on under a lagging subscriber: the probe ends here
                out.extend(tracker.on_replay_end(now))
                self._drop_dealer(peer)
                if self.hooks is not None:
                    self.hooks.on_replay_end(peer.name, False)
                return
            if seq == anchor:  # the anchor itself, unchanged: delivered before, nothing to do
                return
        hooks = self.hooks
        if hooks is not None:
            t0 = time.time_ns()
        if self.raw:
            batch = frames[3] if type(frames[3]) is bytes else bytes(frames[3])
        else:
            try:
                batch = decode_batch(frames[3])
            except DecodeError:
                self._count(peer, "payload")
                batch = None
        if hooks is not None:
            hooks.on_receive(peer.name, frames[1].decode(errors="replace"), seq, batch, len(frames[3]), t0, True)
        got = tracker.on_replay(seq, batch, now)
        if got:
            out.extend(got)
            if got[-1].seq == seq and tracker.expected == seq + 1:  # (as for a live frame)
                peer.anchor_seq, peer.anchor, peer.anchor_run = seq, frames[3], tracker.health.resets

    def rejoin(self, publisher: str) -> bool:
        """Ask ``publisher``'s replay socket again for everything from seq 0, if nothing has been
        delivered from it yet and no request is outstanding (a late join whose first request went
        unanswered because the publisher was not up yet). True when a request went out."""
        peer = self._peers[publisher]
        if not peer.tracker.rejoin(time.time()):
            return False
        self._send_request(peer)
        return True

    # ---- iteration ---------------------------------------------------------------------------

    def deliveries(self, duration: float | None = None, idle_timeout: float | None = None) -> Iterator[Delivery]:
        """Yield deliveries until ``duration`` seconds pass, ``idle_timeout`` seconds pass with none, or close()."""
        start = last = time.monotonic()
        while not self._closed:
            got = self.poll(50)
            now = time.monotonic()
            if got:
                last = now
                yield from got
            if duration is not None and now - start >= duration:
                return
            if idle_timeout is not None and now - last >= idle_timeout:
                return

    def __iter__(self) -> Iterator[Delivery]:
        return self.deliveries()

    async def __aiter__(self) -> AsyncIterator[Delivery]:
        while not self._closed:
            for d in await self.apoll(50):
                yield d

    async def apoll(self, timeout_ms: int = 100) -> list[Delivery]:
        """``poll`` without blocking the event loop (on a thread of its own)."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvevents-sub")
        return await asyncio.get_running_loop().run_in_executor(self._executor, self.poll, timeout_ms)

    # ---- health ------------------------------------------------------------------------------

    def health(self) -> dict[str, PublisherHealth]:
        """A snapshot per publisher: state and counters (copies: safe to keep)."""
        now = time.time()
        out = {}
        for name, peer in self._peers.items():
            h = peer.tracker.health
            up = is_connected(peer)
            out[name] = replace(h, state=peer.tracker.state(now, self.stale_after, up), connected=up,
                                malformed=dict(h.malformed))
        return out

    def stats(self) -> dict[str, int]:
        """Counters summed over publishers (malformed by kind as ``malformed_<kind>``); bind mode's
        open connections and those closed at ``max_connections`` (0 in connect mode)."""
        out = self._table.totals(self._malformed)
        conns = self._conns
        out["connections_open"] = len(conns.opened) if conns is not None else 0
        out["connections_evicted"] = conns.evicted if conns is not None else 0
        return out

    def probe_replay(self, timeout: float = 1.0) -> dict[str, bool]:
        """Ask each replay endpoint for an empty replay; True where the end marker came back in time
        (ZeroMQ connects lazily: this finds an unreachable replay socket before it matters)."""
        result = {}
        for name, peer in self._peers.items():
            if peer.replay_endpoint:
                result[name] = ok = probe_replay_endpoint(self._ctx, peer.replay_endpoint, timeout)
                if ok:
                    peer.tracker.heard = True  # the publisher's replay socket answered: not CONNECTING
                    peer.tracker.health.last_answer_ts = time.time()
        return result

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for peer in self._peers.values():
            if peer.monitor is not None:
                peer.sub.disable_monitor()
        if self._conns is not None:
            self._bind_sub.disable_monitor()
        for sock in list(self._by_sock):
            sock.close(0)
        self._by_sock.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=False)
