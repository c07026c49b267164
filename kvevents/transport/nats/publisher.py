"""The ``"nats"`` publisher: an engine using our publisher writes straight into the stream.

``KVEventsConfig(publisher="nats", endpoint="nats://HOST:PORT", topic=...)`` builds it through
``EventPublisherFactory``. ``publish`` never blocks: the batch is encoded and handed to the
sender if its window has room; if not, it is dropped and counted (``overflow``) and, once
there is room again, a GAP control message tells every consumer how many were lost. On start
the publisher reads the last message the stream holds for its pod; if there is one, this is a
new engine run: a RESET control message goes first and the run number moves on.
"""

from __future__ import annotations

from ...codec import BatchEncoder
from ...events import KVEventBatch
from ...publisher_base import EventPublisher, ShutdownReport
from .sender import PlaneSender
from .wire import StreamSpec, parse_headers, plane_headers, subject_for


class NatsEventPublisher(EventPublisher):
    def __init__(self, data_parallel_rank: int = 0, *, endpoint: str = "nats://127.0.0.1:4222", topic: str = "",
                 pod: str | None = None, model: str = "default", window: int = 512, stream: StreamSpec | None = None,
                 legacy: bool = False, **_ignored) -> None:
        super().__init__(data_parallel_rank)
        self.pod = pod or topic or f"engine-{data_parallel_rank}"
        self.topic = topic
        self.stream = stream or StreamSpec()
        self.model = model
        self.subject = subject_for(self.stream.prefix, model, self.pod)
        self._enc = BatchEncoder(legacy=legacy)
        self.sender = PlaneSender(endpoint, self.stream, window=window, name="kvevents-nats-pub")
        self.seq = 0
        self.run = 0
        self.counts = {"batches": 0, "events": 0, "overflow": 0, "gap_messages": 0}
        self._lost_from: int | None = None
        last = self.sender.call(self._last())
        if last is not None:
            self.run = parse_headers(last.headers).run + 1
            self.sender.put(self.subject, b"", self._headers("reset", 0))

    async def _last(self):
        from nats.js.errors import NotFoundError
        try:
            return await self.sender.js.get_last_msg(self.stream.name, self.subject)
        except NotFoundError:
            return None

    def _headers(self, kind: str, seq: int, missed: int = 0) -> dict[str, str]:
        return plane_headers(kind, self.pod, self.topic, self.data_parallel_rank, seq, self.run, missed, "overflow",
                             self.model)

    def publish(self, batch: KVEventBatch) -> None:
        seq = self.seq
        self.seq += 1
        if self._lost_from is not None:
            missed = seq - self._lost_from
            if not self.sender.try_put(self.subject, b"", self._headers("gap", self._lost_from, missed)):
                self.counts["overflow"] += 1
                return
            self.counts["gap_messages"] += 1
            self._lost_from = None
        if self.sender.try_put(self.subject, self._enc.encode(batch), self._headers("batch", seq)):
            self.counts["batches"] += 1
            self.counts["events"] += len(batch.events)
        else:
            self.counts["overflow"] += 1
            self._lost_from = seq

    def shutdown(self, timeout: float = 1.0) -> ShutdownReport:
        unacked = self.sender.unacked()
        clean = self.sender.close(timeout)
        return ShutdownReport(flushed=self.counts["batches"], unsent=0 if clean else unacked)

    def stats(self) -> dict[str, int]:
        return {**self.counts, **{f"sender_{k}": v for k, v in self.sender.stats.items()}}

