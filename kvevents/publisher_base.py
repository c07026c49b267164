"""The publisher role: hand it a KVEventBatch, it never blocks you."""

from __future__ import annotations

import abc
from collections import deque
from dataclasses import dataclass, field

from .events import KVEventBatch


@dataclass(slots=True)
class ShutdownReport:
    """What shutdown() managed: batches flushed, and what it could not send before its deadline."""

    flushed: int = 0
    unsent: int = 0
    unsent_seqs: list[int] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return self.unsent == 0


class EventPublisher(abc.ABC):
    """Publishes KV-event batches. ``publish`` must return at once, whatever the transport does."""

    def __init__(self, data_parallel_rank: int = 0) -> None:
        self.data_parallel_rank = data_parallel_rank

    @abc.abstractmethod
    def publish(self, batch: KVEventBatch) -> None: ...

    @abc.abstractmethod
    def shutdown(self, timeout: float = 1.0) -> ShutdownReport: ...

    def stats(self) -> dict[str, int]:
        return {}

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


class NullEventPublisher(EventPublisher):
    """Publishes nothing (events disabled); counts what it was handed."""

    def __init__(self, data_parallel_rank: int = 0, **_ignored) -> None:
        super().__init__(data_parallel_rank)
        self.batches = 0
        self.events = 0

    def publish(self, batch: KVEventBatch) -> None:
        self.batches += 1
        self.events += len(batch.events)

    def shutdown(self, timeout: float = 1.0) -> ShutdownReport:
        return ShutdownReport()

    def stats(self) -> dict[str, int]:
        return {"batches": self.batches, "events": self.events}


# ---- shared by publisher implementations: the counters and the replay ring ------------------

@dataclass(slots=True)
class PublisherStats:
    """Plain-int counters; read them any time (``stats()`` returns a dict copy)."""

    batches_published: int = 0  #: batches sent on the PUB socket
    events_published: int = 0
    bytes_published: int = 0  #: payload bytes sent live
    overflow: int = 0  #: batches taken off the live path because the queue was full
    overflow_lost: int = 0  #: of those, batches also lost to replay (policy drop_oldest, or ring full)
    encode_errors: int = 0  #: batches that could not be encoded (their seq becomes a gap)
    send_errors: int = 0
    ring_evicted: int = 0  #: batches pushed out of the replay ring by its count/bytes bounds
    replay_requests: int = 0
    replay_batches_served: int = 0
    replay_rate_limited: int = 0  #: requests that had to wait for their client's token bucket
    replay_malformed: int = 0  #: replay requests with a bad shape
    replay_throttled: int = 0  #: pauses in reading replay requests: all clients together hit the global cap
    replay_aborted: int = 0  #: replays cut short (client gone, not reading, or no room in the replay budget)
    replay_stalled: int = 0  #: of those, replays whose client stopped reading (its byte budget full, no progress)
    replay_refused: int = 0  #: requests refused: the client's earlier answer sits unread, or too many clients
    replay_superseded: int = 0  #: requests replaced by a newer one from the same client
    replays_completed: int = 0  #: replays answered to the end marker
    replay_outstanding_bytes: int = 0  #: replay bytes queued toward clients, not yet taken by their connections
    replay_active: int = 0  #: replays in progress
    pub_hwm: int = 0  #: the PUB socket's per-subscriber queue bound (messages), from hwm / hwm_bytes
    live_dropped: int = 0  #: batches kept off the live socket by the drop_live fault injector


class _Ring:
    """Encoded batches kept for replay, bounded by count and bytes.

    One writer (the live thread) appends each batch BEFORE it goes on the socket, so a
    subscriber that sees seq s live can always get every earlier seq the ring still holds.
    No lock: readers take a snapshot with ``list(deque)``, one C-level copy that no other
    Python thread can interleave with under the GIL.
    """

    __slots__ = ("items", "nbytes", "max_items", "max_bytes", "stats")

    def __init__(self, max_items: int, max_bytes: int, stats: PublisherStats) -> None:
        self.items: deque[tuple[int, bytes, bytes]] = deque()
        self.nbytes = 0
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.stats = stats

    def append(self, seq: int, topic: bytes, payload: bytes) -> None:
        self.items.append((seq, topic, payload))
        self.nbytes += len(payload)
        self.trim()

    def trim(self) -> None:
        items = self.items
        while len(items) > self.max_items or self.nbytes > self.max_bytes:
            self.nbytes -= len(items.popleft()[2])
            self.stats.ring_evicted += 1

    def since(self, start: int) -> list[tuple[int, bytes, bytes]]:
        """Every kept batch with seq >= start, oldest first."""
        snapshot = list(self.items)
        out = []
        for item in reversed(snapshot):
            if item[0] < start:
                break
            out.append(item)
        out.reverse()
        return out
