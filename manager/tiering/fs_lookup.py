"""Asynchronous lookups on a shared root (the fs tier's ``shared_root=True``): other tiers,
e.g. other engines, write blocks into the same root, so a key missing from this tier's memory
may be on disk. The scheduler's lookup never waits for the disk: a miss in memory starts a
header probe on one thread and answers RETRY; the probe's answer is there for a later step (a
block found is indexed and announced by the tier; a block not found is remembered, bounded,
for the key's next lookup, which answers MISS)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ..base import LookupResult, OffloadKey

__all__ = ["DiskLookups", "MAX_ANSWERS"]

MAX_ANSWERS = 65536  # bound on "not on disk" answers held for the next step


class DiskLookups:
    """``probe(key)`` (no lock held) says whether a whole block of ``key`` is on disk;
    ``found(key)`` (the tier's lock held) indexes and announces one; ``after()`` (no lock held)
    runs after each probe's answer is in (the tier's queued deletions)."""

    def __init__(self, lock: threading.Condition, probe: Callable[[OffloadKey], bool], found: Callable[[OffloadKey], None],
                 after: Callable[[], None], name: str) -> None:
        self._lock, self._probe_disk, self._found, self._after = lock, probe, found, after
        self._probing: set[OffloadKey] = set()
        self._answers: OrderedDict[OffloadKey, bool] = OrderedDict()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"kv-{name}-lookup")
        self._closed = False
        self.pending = 0  # lookups answered RETRY while a disk probe ran
        self.found_on_disk = 0  # probes that found a block written by another tier

    def lookup(self, key: OffloadKey) -> LookupResult:
        """(Lock held; ``key`` is not in the tier's memory.)"""
        if self._answers.pop(key, None) is not None:
            return LookupResult.MISS  # (a found block is in the tier's index already)
        if key not in self._probing:
            if self._closed:
                return LookupResult.MISS
            self._probing.add(key)
            self._pool.submit(self._run, key)
        self.pending += 1
        return LookupResult.RETRY

    def busy(self) -> bool:
        """(Lock held.) Whether a probe is in flight."""
        return bool(self._probing)

    def _run(self, key: OffloadKey) -> None:
        hit = self._probe_disk(key)
        with self._lock:
            self._probing.discard(key)
            if hit:
                self.found_on_disk += 1
                self._found(key)
            else:
                self._answers[key] = False
                if len(self._answers) > MAX_ANSWERS:
                    self._answers.popitem(last=False)  # (that key is probed again if asked)
            self._lock.notify_all()
        self._after()

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
        self._pool.shutdown(wait=True)
