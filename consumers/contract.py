"""The consumer contract kit: check that an event stream keeps the contract consumers rely on.

Plain Python (no pytest needed); the pytest fixtures live in :mod:`consumers.contract_plugin`.

Rules, per publisher (and, for blocks, per data-parallel rank of that publisher):

``seq-gap``
    Sequence numbers are continuous once gaps are healed: a replayed batch fills a gap,
    duplicates are ignored, a seq going backwards is a publisher restart (reset). A batch lost
    for good is a violation (``allow_gaps=True`` counts it instead).
``malformed``
    A message whose payload is not a KVEventBatch, or whose frames are not [topic, seq, payload].
``unknown-removal``
    Each BlockRemoved names a block stored earlier for that (publisher, medium).
    ``allow_unknown_removals=True`` counts these instead.
``stale-reference``
    Nothing refers to a block after an AllBlocksCleared or a reset dropped it, unless it was
    stored again: a removal, an offload of it, or a GPU block naming it as parent.
``offload-block-size``
    Offload events (medium other than GPU) carry no block size: ``block_size == 0``, no tokens.
``offload-unjoined``
    Each block an offload BlockStored names was stored on the GPU earlier by the same publisher,
    so consumers can join it (``allow_unjoined_offloads=True`` counts these instead).
``gpu-block-shape``
    A GPU BlockStored has ``block_size > 0`` and ``block_size`` tokens per block
    (``check_gpu_shape=False`` turns this off).
``damaged-recording``
    A recording fed to the checker has a torn tail, damaged records skipped, or undecodable
    records: the test would run on less than was recorded (``allow_damage=True`` counts it instead).
``empty-recording``
    A recording fed to the checker delivered no batch at all: a test that checks nothing must not
    pass (``allow_empty=True`` counts it instead).

When a publisher's history is incomplete (its stream did not start at seq 0, or batches were
lost for good), the reference rules (unknown-removal, stale-reference, offload-unjoined) cannot
be decided: such events are counted in ``stats["unverified"]``, until an AllBlocksCleared or a
reset makes the history complete again. A medium of None means GPU (vLLM before offloading).
"""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from kvevents.delivery import Delivery, DeliveryKind
from kvevents.errors import KVEventsError
from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvevents.recording import Record

from .recordtools import Recording, SeqHealer, as_deliveries, pod_of

__all__ = ["CONSUMER_PROTOCOL", "Rule", "ContractViolation", "ContractError", "ContractChecker", "check_stream", "feed", "FeedReport"]

BATCH, RESET, GAP = DeliveryKind.BATCH, DeliveryKind.RESET, DeliveryKind.GAP
GPU = "GPU"

#: what :func:`feed` needs of a consumer (also the error message when it is missing)
CONSUMER_PROTOCOL = ("A consumer implements apply(pod, batch) and reset_pod(pod); optionally handle(delivery) "
                     "(then it gets every delivery as is, instead of apply/reset_pod) and on_gap(pod, delivery) "
                     "or mark_unreliable(pod) (else a GAP calls reset_pod).")


class Rule(str, enum.Enum):
    SEQ_GAP = "seq-gap"
    MALFORMED = "malformed"
    UNKNOWN_REMOVAL = "unknown-removal"
    STALE_REFERENCE = "stale-reference"
    OFFLOAD_BLOCK_SIZE = "offload-block-size"
    OFFLOAD_UNJOINED = "offload-unjoined"
    GPU_BLOCK_SHAPE = "gpu-block-shape"
    DAMAGED_RECORDING = "damaged-recording"
    EMPTY_RECORDING = "empty-recording"


def _short(obj: Any, limit: int = 240) -> str:
    text = repr(obj)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True, slots=True)
class ContractViolation:
    """One broken rule: where (publisher, seq, index of the event in its batch) and what."""

    rule: Rule
    publisher: str
    seq: int | None
    event_index: int | None
    event: Any  #: the offending event (None for stream-level rules)
    message: str
    data_parallel_rank: int | None = None

    def __str__(self) -> str:
        where = f"publisher {self.publisher!r} seq {self.seq}"
        if self.data_parallel_rank is not None:
            where += f" rank {self.data_parallel_rank}"
        if self.event_index is not None:
            where += f" event #{self.event_index}"
        text = f"[{self.rule.value}] {where}: {self.message}"
        return text + (f"\n    {_short(self.event)}" if self.event is not None else "")


class ContractError(KVEventsError, AssertionError):
    """Raised by :meth:`ContractChecker.assert_ok`; lists every violation."""

    def __init__(self, violations: list[ContractViolation]) -> None:
        self.violations = list(violations)
        lines = "\n".join(f"  {v}" for v in self.violations)
        super().__init__(f"{len(self.violations)} stream contract violation(s):\n{lines}")


@dataclass(slots=True)
class _Blocks:
    """What one (publisher, rank) holds: stored blocks per medium, GPU history, dropped blocks."""

    trusted: bool = True  # history complete: reference rules can be decided
    stored: Counter = field(default_factory=Counter)  # (medium, hash) -> times stored minus removed
    gpu_seen: set = field(default_factory=set)  # hashes stored on the GPU since the last clear/reset
    dropped: set = field(default_factory=set)  # (medium, hash) dropped by the last clear/reset

    def drop(self) -> None:
        self.dropped = set(self.stored) | {(GPU, h) for h in self.gpu_seen}
        self.stored.clear()
        self.gpu_seen.clear()


@dataclass(slots=True)
class _Publisher:
    last_seq: int | None = None
    incomplete: bool = False  # batches were missed (late start, lost gap): new ranks start untrusted
    ranks: dict = field(default_factory=dict)  # data_parallel_rank -> _Blocks


class ContractChecker:
    """Feed it a stream; it collects :class:`ContractViolation` s (see the module docstring)."""

    def __init__(self, *, allow_unknown_removals: bool = False, allow_unjoined_offloads: bool = False,
                 allow_gaps: bool = False, check_gpu_shape: bool = True, check_parents: bool = True,
                 from_zero: bool = False, max_pending: int = 10_000, allow_damage: bool = False,
                 allow_empty: bool = False) -> None:
        self.allow_damage = allow_damage
        self.allow_empty = allow_empty
        self._recordings = 0  # recordings fed: each must deliver batches (see finish)
        self._empty_checked = False
        self.allow_unknown_removals = allow_unknown_removals
        self.allow_unjoined_offloads = allow_unjoined_offloads
        self.allow_gaps = allow_gaps
        self.check_gpu_shape = check_gpu_shape
        self.check_parents = check_parents
        self.violations: list[ContractViolation] = []
        self.stats: Counter[str] = Counter()
        self.asserted = False
        self._healer = SeqHealer(from_zero=from_zero, max_pending=max_pending)
        self._pubs: dict[str, _Publisher] = {}

    # ---- inputs ------------------------------------------------------------------------------

    def feed(self, publisher: str, seq: int, batch: KVEventBatch, *, replayed: bool = False) -> None:
        """One batch as it arrived (any order; replayed batches fill gaps; duplicates are ignored)."""
        for d in self._healer.push(publisher, seq, batch, replayed=replayed):
            self.feed_delivery(d)

    def reset(self, publisher: str, seq: int = 0) -> None:
        """The publisher restarted: forget what it stored."""
        self.feed_delivery(Delivery(RESET, publisher, "", seq))

    def feed_delivery(self, d: Delivery) -> None:
        """One delivery from a :class:`kvevents.Subscriber` (or a healed recording)."""
        st = self._pubs.get(d.publisher)
        if st is None:
            st = self._pubs[d.publisher] = _Publisher()
        if d.kind is RESET:
            self.stats["resets"] += 1
            for blocks in st.ranks.values():
                blocks.drop()
                blocks.trusted = True
            st.last_seq = None
            st.incomplete = False
            return
        if d.kind is GAP:
            self._on_gap(st, d)
            return
        if st.last_seq is None:
            if d.seq != 0:
                self._untrust(st)
        elif d.seq <= st.last_seq:
            self.stats["duplicates"] += 1
            return
        elif d.seq != st.last_seq + 1:
            self._add(Rule.SEQ_GAP, d.publisher, st.last_seq + 1, None, None,
                      f"seq jumped from {st.last_seq} to {d.seq} without a GAP or RESET: "
                      f"{d.seq - st.last_seq - 1} batch(es) missing", counter="gaps")
            self._untrust(st)
        st.last_seq = d.seq
        self._check_batch(st, d.publisher, d.seq, d.batch)

    @staticmethod
    def _untrust(st: _Publisher) -> None:
        st.incomplete = True
        for blocks in st.ranks.values():
            blocks.trusted = False

    def _on_gap(self, st: _Publisher, d: Delivery) -> None:
        if d.reason == "malformed":
            self._add(Rule.MALFORMED, d.publisher, d.seq, None, None,
                      "payload is not a KVEventBatch", counter="malformed")
        else:
            self._add(Rule.SEQ_GAP, d.publisher, d.seq, None, None,
                      f"{d.missed} batch(es) from seq {d.seq} lost for good (not healed by replay)",
                      counter="gaps", allowed=self.allow_gaps)
        self._untrust(st)
        st.last_seq = d.seq + max(1, d.missed) - 1

    def feed_all(self, source: Any, **options: Any) -> "ContractChecker":
        """Everything in ``source``: a recording path, :class:`Recording`, Records, Deliveries or tuples.

        Records are healed as a subscriber would (``options`` go to
        :class:`~kvevents.recordstream.DeliveryStream`); tuples ``(publisher, seq, batch[, replayed])``
        go through :meth:`feed`. Call :meth:`finish` (or :meth:`assert_ok`) at the end.
        """
        if isinstance(source, (str, bytes)) or hasattr(source, "__fspath__"):
            source = Recording.load(source)
        records = None
        if isinstance(source, Recording):
            self.check_recording(source)
            options.setdefault("late_join", bool(source.meta.get("backfill")))
            records = source.records
        else:
            source = list(source)
            if source and isinstance(source[0], Record):
                records = source
        if records is not None:
            for rec in records:
                if not rec.well_formed:
                    self._add(Rule.MALFORMED, rec.publisher, None, None, None,
                              f"{rec.socket} message of {len(rec.frames)} frame(s) is not [topic, seq, payload]",
                              counter="malformed")
            for d in as_deliveries(records, **options):
                self.feed_delivery(d)
            return self
        for item in source:
            if isinstance(item, Delivery):
                self.feed_delivery(item)
            elif isinstance(item, tuple) and len(item) in (3, 4):
                self.feed(item[0], item[1], item[2], replayed=bool(item[3]) if len(item) == 4 else False)
            else:
                raise TypeError(f"expected Delivery, Record or (publisher, seq, batch[, replayed]), got {item!r:.80}")
        return self

    def check_recording(self, rec: Recording) -> None:
        """A recording is about to be fed: its damage is a violation (``allow_damage``), and it must
        deliver at least one batch by :meth:`finish` (``allow_empty``)."""
        self._recordings += 1
        self._empty_checked = False
        damage = {"torn tail bytes": rec.truncated_bytes, "damaged records skipped": rec.bad_records,
                  "undecodable records": rec.undecodable}
        found = ", ".join(f"{n:,} {what}" for what, n in damage.items() if n)
        if found:
            where = str(rec.path) if rec.path is not None else "the recording"
            self._add(Rule.DAMAGED_RECORDING, ",".join(rec.publishers) or "-", None, None, None,
                      f"{where} is damaged ({found}): the stream checked is less than what was recorded",
                      counter="damaged_recordings", allowed=self.allow_damage)

    def finish(self) -> list[ContractViolation]:
        """End of the stream: holes still open are gaps. Returns every violation so far."""
        for d in self._healer.finish():
            self.feed_delivery(d)
        if self._recordings and not self._empty_checked:
            self._empty_checked = True
            if not self.stats["batches"]:
                self._add(Rule.EMPTY_RECORDING, "-", None, None, None,
                          f"{self._recordings} recording(s) fed, no batch delivered: nothing was checked",
                          counter="empty_recordings", allowed=self.allow_empty)
        return self.violations

    def assert_ok(self) -> None:
        """Raise :class:`ContractError` listing every violation, if there is any."""
        self.asserted = True
        self.finish()
        if self.violations:
            raise ContractError(self.violations)

    # ---- rules -------------------------------------------------------------------------------

    def _add(self, rule: Rule, publisher: str, seq: int | None, index: int | None, event: Any, message: str,
             *, counter: str | None = None, allowed: bool = False, rank: int | None = None) -> None:
        if counter:
            self.stats[counter] += 1
        if allowed:
            self.stats[f"allowed_{rule.value}"] += 1
            return
        self.violations.append(ContractViolation(rule, publisher, seq, index, event, message, rank))

    def _reference(self, blocks: _Blocks, rule: Rule, allowed: bool, publisher: str, seq: int, i: int, ev: Any,
                   missing: list, stale: list, what: str, rank: int | None, where: str = "") -> None:
        """Report unknown / stale references, or count them as unverified on an incomplete history."""
        if not missing and not stale:
            return
        if not blocks.trusted:
            self.stats["unverified"] += 1
            return
        if stale:
            self._add(Rule.STALE_REFERENCE, publisher, seq, i, ev,
                      f"{what} {_short(stale, 120)}: dropped by an earlier AllBlocksCleared or reset, not stored{where} since",
                      rank=rank)
        if missing:
            self._add(rule, publisher, seq, i, ev, f"{what} {_short(missing, 120)} never stored{where} before",
                      allowed=allowed, rank=rank)

    def _check_batch(self, st: _Publisher, publisher: str, seq: int, batch: KVEventBatch) -> None:
        self.stats["batches"] += 1
        rank = batch.data_parallel_rank
        blocks = st.ranks.get(rank)
        if blocks is None:
            blocks = st.ranks[rank] = _Blocks(trusted=not st.incomplete)
        shown_rank = rank if len(st.ranks) > 1 or rank not in (None, 0) else None
        for i, ev in enumerate(batch.events):
            self.stats["events"] += 1
            kind = type(ev)
            if kind is AllBlocksCleared:
                blocks.drop()
                blocks.trusted = True
                continue
            medium = ev.medium if ev.medium is not None else GPU
            if kind is BlockStored:
                if medium == GPU:
                    if self.check_gpu_shape and (ev.block_size <= 0 or
                                                 len(ev.token_ids) != ev.block_size * len(ev.block_hashes)):
                        self._add(Rule.GPU_BLOCK_SHAPE, publisher, seq, i, ev,
                                  f"GPU BlockStored with block_size {ev.block_size} and {len(ev.token_ids)} tokens "
                                  f"for {len(ev.block_hashes)} block(s)", rank=shown_rank)
                    parent = ev.parent_block_hash
                    if (self.check_parents and parent is not None and parent not in blocks.gpu_seen
                            and (GPU, parent) in blocks.dropped):
                        self._reference(blocks, Rule.STALE_REFERENCE, False, publisher, seq, i, ev, [], [parent],
                                        "parent block", shown_rank)
                    blocks.gpu_seen.update(ev.block_hashes)
                else:
                    if ev.block_size != 0 or ev.token_ids:
                        self._add(Rule.OFFLOAD_BLOCK_SIZE, publisher, seq, i, ev,
                                  f"{medium} BlockStored carries block_size {ev.block_size} and "
                                  f"{len(ev.token_ids)} token(s); offload events carry neither", rank=shown_rank)
                    seen = blocks.gpu_seen
                    unjoined = [h for h in ev.block_hashes if h not in seen]
                    stale = [h for h in unjoined if (GPU, h) in blocks.dropped]
                    missing = [h for h in unjoined if (GPU, h) not in blocks.dropped]
                    self._reference(blocks, Rule.OFFLOAD_UNJOINED, self.allow_unjoined_offloads, publisher, seq, i, ev,
                                    missing, stale, f"offloads {medium} block(s)", shown_rank, " on the GPU")
                stored = blocks.stored
                for h in ev.block_hashes:
                    stored[(medium, h)] += 1
                    blocks.dropped.discard((medium, h))
            elif kind is BlockRemoved:
                stored = blocks.stored
                missing, stale = [], []
                for h in ev.block_hashes:
                    key = (medium, h)
                    n = stored.get(key, 0)
                    if n > 1:
                        stored[key] = n - 1
                    elif n == 1:
                        del stored[key]
                    elif key in blocks.dropped:
                        stale.append(h)
                    else:
                        missing.append(h)
                self._reference(blocks, Rule.UNKNOWN_REMOVAL, self.allow_unknown_removals, publisher, seq, i, ev,
                                missing, stale, f"removes {medium} block(s)", shown_rank)


def check_stream(source: Any, **options: Any) -> list[ContractViolation]:
    """Every violation in ``source`` (see :meth:`ContractChecker.feed_all`); ``options`` configure the checker."""
    checker = ContractChecker(**options)
    checker.feed_all(source)
    return checker.finish()


@dataclass(slots=True)
class FeedReport:
    batches: int = 0
    resets: int = 0
    gaps: int = 0
    pods: set = field(default_factory=set)


def feed(consumer: Any, source: Any, *, checker: ContractChecker | None = None,
         pod: Callable[[Delivery], str] = pod_of, on_gap: Callable[[Any, str, Delivery], None] | None = None,
         use_handle: bool = True, **options: Any) -> FeedReport:
    """Drive ``consumer`` with ``source`` (anything :func:`consumers.recordtools.as_deliveries` takes).

    A consumer with a ``handle(delivery)`` method (like :class:`consumers.KVRouter`) gets every
    delivery as is (``use_handle=False`` turns that off). Otherwise: BATCH ->
    ``consumer.apply(pod, batch)``; RESET -> ``consumer.reset_pod(pod)``; GAP -> ``on_gap(consumer,
    pod, delivery)`` if given, else the consumer's ``on_gap(pod, delivery)`` or
    ``mark_unreliable(pod)``, else ``reset_pod(pod)`` (what it knew of the pod can no longer be
    trusted). With a ``checker``, every delivery is also checked against the stream contract.
    """
    report = FeedReport()
    handle = getattr(consumer, "handle", None) if use_handle else None
    if not callable(handle):
        missing = [f"{m}()" for m in ("apply", "reset_pod") if not callable(getattr(consumer, m, None))]
        if missing:
            raise TypeError(f"{type(consumer).__name__} cannot be fed: it has no {' and no '.join(missing)}. "
                            f"{CONSUMER_PROTOCOL}")
    if isinstance(source, (str, bytes)) or hasattr(source, "__fspath__"):
        source = Recording.load(source)
    if checker is not None and isinstance(source, Recording):
        checker.check_recording(source)
    gap_handler = on_gap
    if gap_handler is None and callable(getattr(consumer, "on_gap", None)):
        gap_handler = lambda c, p, d: c.on_gap(p, d)  # noqa: E731
    elif gap_handler is None and callable(getattr(consumer, "mark_unreliable", None)):
        gap_handler = lambda c, p, d: c.mark_unreliable(p)  # noqa: E731
    for d in as_deliveries(source, **options):
        if checker is not None:
            checker.feed_delivery(d)
        name = pod(d)
        report.pods.add(name)
        if d.kind is BATCH:
            report.batches += 1
        elif d.kind is RESET:
            report.resets += 1
        else:
            report.gaps += 1
        if callable(handle):
            handle(d)
        elif d.kind is BATCH:
            consumer.apply(name, d.batch)
        elif d.kind is RESET:
            consumer.reset_pod(name)
        elif gap_handler is not None:
            gap_handler(consumer, name, d)
        else:
            consumer.reset_pod(name)
    return report
