"""The publisher role: hand it a KVEventBatch, it never blocks you."""

from __future__ import annotations

import abc
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
