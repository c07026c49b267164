"""A router replica on the event plane: warm start from a snapshot, read the stream, save
snapshots, publish what it covers, purge under a lease, report readiness.

``Replica(url, "r1")`` builds a router (``router_factory()``, a :class:`consumers.KVRouter` by
default), restores the newest snapshot any replica saved (a corrupt one is counted and the next
is tried; none that restores = a cold start, counted), then reads the stream from the
snapshot's seq + 1 through a :class:`~kvevents.transport.nats.source.JetStreamSource` (durable
``replica-<name>``). ``step()`` applies one poll's deliveries and acknowledges them; every
``snapshot_every`` seconds it saves ``router.snapshot(stream_seq=...)`` (the seq of the last
applied message) to the object store, then publishes that seq as its cover; the purge lease
holder trims the stream below every live replica's cover (see :mod:`kvservice.planestore`).

Ready once the replica has caught up to within ``ready_lag`` messages of the stream's end.
``python -m kvservice.replica --nats URL --name R [--status-file F]`` runs one as a process.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import logging
import os
import signal
import sys
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FuturesTimeout

from kvevents.errors import KVEventsError
from kvevents.transport.nats.loop import LoopThread, connect
from kvevents.transport.nats.source import JetStreamSource
from kvevents.transport.nats.wire import StreamSpec

from .planestore import PlaneStore, SnapshotRefused

__all__ = ["Replica", "state_digest"]

log = logging.getLogger("kvservice.replica")


def state_digest(router) -> str:
    """A digest of the router's whole state (its own ``digest()`` if it has one)."""
    for name in ("state_digest", "digest"):
        own = getattr(router, name, None)
        if callable(own):
            d = own()
            return d.hex() if isinstance(d, bytes) else str(d)
    if callable(getattr(router, "snapshot", None)):
        return hashlib.sha256(router.snapshot(stream_seq=0)).hexdigest()
    # a router without snapshots: what it shows (entries, pods, counters) — marked as partial
    seen = json.dumps([router.entries(), sorted(router.pods())], default=str)
    return "partial:" + hashlib.sha256(seen.encode()).hexdigest()


def _default_router():
    from consumers import KVRouter
    return KVRouter()


class Replica:
    def __init__(self, url: str, name: str, *, router_factory=_default_router, stream: StreamSpec | None = None,
                 snapshot_every: float = 5.0, heartbeat: float = 1.0, ttl: float = 5.0, ready_lag: int = 1000,
                 purge: bool = True, source_kw: dict | None = None) -> None:
        if heartbeat >= ttl:
            raise KVEventsError(f"replica heartbeat ({heartbeat}s) must be shorter than the cover ttl ({ttl}s)")
        self.name = name
        self.stream = stream or StreamSpec()
        self.snapshot_every = snapshot_every
        self.heartbeat = heartbeat
        self.ready_lag = ready_lag
        self.purge_enabled = purge
        self._factory = router_factory
        self.router = router_factory()
        self.counters = {"applied": 0, "snapshots_saved": 0, "snapshot_bytes": 0, "snapshot_save_s": 0.0,
                         "snapshots_skipped": 0, "snapshot_errors": 0, "restore_failures": 0, "cold_starts": 0,
                         "restored_seq": 0, "restore_s": 0.0, "purged": 0, "purge_errors": 0, "cover_errors": 0,
                         "snapshots_unsupported": 0, "restart_rechecks": 0, "purged_before_read": 0,
                         "snapshots_deferred": 0, "snapshots_refused": 0}
        #: why the replica did not restore a snapshot (None: it restored one); in status()
        self.cold_start_reason: str | None = None
        self.failures: list[str] = []
        self._lt = LoopThread(f"kvevents-replica-{name}")
        self._upload: Future | None = None
        self.covered = 0
        self._pods: dict = {}  #: per-pod positions the restored snapshot covers (seeds the source)
        self._bad: set[tuple[int, str]] = set()  #: snapshots that did not restore (not tried again)
        self._started = time.monotonic()
        self.ready_after: float | None = None
        try:
            self._startup("connect and open the buckets", self._open(url, ttl))
            start_seq = self._start_point()
            self.source = JetStreamSource(url, durable=f"replica-{name}", stream=self.stream, start_seq=start_seq,
                                          pods=self._pods, **(source_kw or {}))
        except BaseException:
            self._lt.stop()
            raise
        self._next_snapshot = time.monotonic() + snapshot_every
        self._next_beat = time.monotonic() + heartbeat

    async def _open(self, url: str, ttl: float) -> None:
        self.nc = await connect(url, f"kvevents-replica-{self.name}")
        self.js = self.nc.jetstream()
        await self.stream.ensure(self.js, update=False)
        self.store = PlaneStore(self.js, stream=self.stream.name, ttl=ttl, storage=self.stream.storage)
        await self.store.open()
        self.identity = await self.store.identity()  #: the stream this replica reads (snapshots are sealed with it)

    STARTUP_STEP_S = 30.0  #: the most one start-up step may take before the replica gives up, naming it

    def _startup(self, what: str, coro):
        """Run one start-up step on the loop; one that does not finish is a KVEventsError naming it."""
        try:
            return self._lt.call(coro, self.STARTUP_STEP_S)
        except (TimeoutError, FuturesTimeout):  # the same class from Python 3.11 on
            raise KVEventsError(f"start-up step '{what}' did not finish in {self.STARTUP_STEP_S:g} s "
                                f"(is nats-server reachable and JetStream enabled?)") from None

    def _start_point(self) -> int:
        """Restore the newest snapshot, publish what it covers, and make sure no purge passed it
        meanwhile; returns the stream seq to read from.

        A purge never goes past a saved snapshot (a purger's floor is every live replica's cover,
        and a cover is a saved snapshot). Between choosing a snapshot and publishing our cover,
        another replica may save a newer one and purge up to it; so after publishing we look
        again, and if a newer snapshot exists we take that one instead (and look again)."""
        chosen = -1
        for _ in range(10):
            start_seq = self._warm_start(newer_than=chosen)
            if start_seq is None:  # nothing newer restores: keep what we have
                break
            chosen = start_seq - 1
            self._startup("publish its cover", self.store.cover(self.name, chosen))  # before reading anything
            self.covered = chosen
            newest = max((seq for seq, obj in self._startup("list the snapshots", self.store.candidates()) if (seq, obj) not in self._bad),
                          default=0)
            if newest <= chosen:
                break
            self.counters["restart_rechecks"] += 1
        first = self._startup("read the stream's first seq", self.js.stream_info(self.stream.name)).state.first_seq
        if first > self.covered + 1:
            # the stream no longer holds what follows our snapshot: the index will miss those batches
            self.counters["purged_before_read"] += first - self.covered - 1
            self.failures.append(f"stream starts at seq {first}, after our snapshot's {self.covered}: "
                                 f"{first - self.covered - 1} messages are gone")
        return self.covered + 1

    def _warm_start(self, newer_than: int = -1) -> int | None:
        """Restore the newest snapshot (newer than ``newer_than``) that restores; the stream seq to
        read from, 1 for a cold start, or None if nothing newer restored (the current state stays)."""
        t0 = time.perf_counter()
        for seq, obj in self._startup("list the snapshots", self.store.candidates()):
            if seq <= newer_than:
                break
            if (seq, obj) in self._bad:
                continue
            try:
                data, covered, pods = self._lt.call(self.store.load(obj, self.identity))
                if covered < seq:  # a re-save only moves it on: the listing (its description) was damaged
                    raise SnapshotRefused("positions", f"its description says seq {seq}, its body {covered}")
                router = self._factory()  # restored aside: a failure leaves the current state alone
                info = router.restore(data)
                if int(getattr(info, "stream_seq", None) or 0) != covered:
                    raise SnapshotRefused("positions", f"the router's snapshot covers seq {info.stream_seq}, "
                                                       f"its envelope says {covered}")
            except Exception as exc:  # refused, corrupt, truncated, future version, unreadable: the next one
                self.counters["restore_failures"] += 1
                self._bad.add((seq, obj))
                why = f"snapshot {obj!r} (seq {seq}): {exc}"
                if isinstance(exc, SnapshotRefused):
                    self.counters["snapshots_refused"] += 1
                    key = f"refused_{exc.reason.replace('-', '_')}"
                    self.counters[key] = self.counters.get(key, 0) + 1
                self.failures.append(why)
                self.cold_start_reason = why
                log.warning("replica %s: not restoring %s", self.name, why)
                continue
            self.router = router
            self._pods = pods
            self.cold_start_reason = None
            self.counters["restored_seq"] = covered
            self.counters["restore_s"] = time.perf_counter() - t0
            return covered + 1
        if newer_than >= 0:
            return None
        self.counters["cold_starts"] += 1
        self._pods = {}
        if self.cold_start_reason is None:
            self.cold_start_reason = "no snapshot saved"
        log.warning("replica %s: cold start, reading the stream from seq 1 (%s)", self.name, self.cold_start_reason)
        return 1

    # ---- the loop -----------------------------------------------------------------------------

    def step(self, timeout_ms: int = 100) -> int:
        """Apply one poll's deliveries; acknowledge them; do what is due. Returns how many applied."""
        ds = self.source.poll(timeout_ms)
        handle = self.router.handle
        for d in ds:
            handle(d)
        self.source.ack()
        self.counters["applied"] += len(ds)
        now = time.monotonic()
        if self.ready_after is None and self.source.stream_last and self.source.lag() <= self.ready_lag:
            self.ready_after = now - self._started
        if now >= self._next_snapshot:
            self._next_snapshot = now + self.snapshot_every
            self.save_snapshot()
        if now >= self._next_beat:
            self._next_beat = now + self.heartbeat
            self._beat()
        return len(ds)

    def save_snapshot(self, wait: bool = False) -> bool:
        """Snapshot the router now (in this, the ingest thread) and upload it in the background;
        the cover moves on once the upload is stored. False if the previous upload is still going."""
        if not callable(getattr(self.router, "snapshot", None)):
            self.counters["snapshots_unsupported"] += 1  # the cover stays: nothing is purged past it
            return False
        if self._upload is not None and not self._upload.done():
            self.counters["snapshots_skipped"] += 1
            return False
        seq = self.source.acked
        if seq <= self.covered:
            return False
        if self.source.in_doubt:  # a stream hole not yet settled: a snapshot now could hide it
            self.counters["snapshots_deferred"] += 1
            return False
        pods = self.source.positions()
        t0 = time.perf_counter()
        data = self.router.snapshot(stream_seq=seq)
        self.counters["snapshot_save_s"] = time.perf_counter() - t0

        async def upload():
            try:
                await self.store.save(self.name, data, seq, pods, self.identity)
                await self.store.cover(self.name, seq)
            except Exception as exc:
                self.counters["snapshot_errors"] += 1
                self.failures.append(f"snapshot upload at seq {seq}: {exc}")
                return
            self.covered = seq
            self.counters["snapshots_saved"] += 1
            self.counters["snapshot_bytes"] = len(data)
        self._upload = self._lt.submit(upload())
        if wait:
            self._upload.result(60)
        return True

    def _beat(self) -> None:
        async def beat():
            try:  # self.covered read on the loop, after any upload before it: a cover never goes back
                await self.store.cover(self.name, self.covered)
            except Exception:
                self.counters["cover_errors"] += 1
                return
            if self.purge_enabled:
                try:
                    self.counters["purged"] += await self.store.try_purge(self.name)
                except Exception:
                    self.counters["purge_errors"] += 1
        self._lt.submit(beat())

    def run(self, stop: threading.Event, status_file: str | None = None) -> None:
        next_status = 0.0
        while not stop.is_set():
            self.step(50)
            if status_file and time.monotonic() >= next_status:
                self.write_status(status_file)
                next_status = time.monotonic() + 0.2

    @property
    def ready(self) -> bool:
        return self.ready_after is not None and self.source.lag() <= self.ready_lag

    def status(self) -> dict:
        return {"name": self.name, "ready": self.ready, "ready_after_s": self.ready_after, "covered": self.covered,
                "position": self.source.acked, "source": self.source.stats(),
                "replica": {**self.counters, "reads_replaced": self.store.reads_replaced},
                "failures": self.failures[-5:], "cold_start_reason": self.cold_start_reason, "entries": self.router.entries(), "digest": state_digest(self.router),
                "pods": sorted(self.router.pods())}

    def write_status(self, path: str) -> None:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.status(), f)
        os.replace(tmp, path)

    def close(self) -> None:
        if self._upload is not None:
            try:
                self._upload.result(10)
            except Exception:
                pass
        self.source.close()
        try:
            self._lt.call(self.nc.close(), 5)
        except Exception:
            pass
        self._lt.stop()


def _factory(spec: str):
    mod, _, attr = spec.partition(":")
    return getattr(importlib.import_module(mod), attr or "KVRouter")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvservice.replica", description="one router replica on the event plane")
    p.add_argument("--nats", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--router", default="consumers:KVRouter", help="MODULE:CALLABLE building the router")
    p.add_argument("--snapshot-every", type=float, default=5.0)
    p.add_argument("--heartbeat", type=float, default=1.0)
    p.add_argument("--ttl", type=float, default=5.0)
    p.add_argument("--status-file", default=None)
    p.add_argument("--no-purge", action="store_true")
    args = p.parse_args(argv)
    try:
        rep = Replica(args.nats, args.name, router_factory=_factory(args.router), snapshot_every=args.snapshot_every,
                      heartbeat=args.heartbeat, ttl=args.ttl, purge=not args.no_purge)
    except (KVEventsError, OSError, TimeoutError) as exc:
        print(f"replica {args.name}: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        rep.run(stop, args.status_file)
    finally:
        rep.save_snapshot(wait=True)
        if args.status_file:
            rep.write_status(args.status_file)
        rep.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
