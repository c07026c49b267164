"""A stand-in router for the replica tests: it keeps, per pod, the digest of every batch applied
since the pod's last reset, and snapshots that ledger (versioned, checksummed) — the whole state
is comparable, and the replica's logic is tested whatever the real router's snapshot holds."""

from __future__ import annotations

import hashlib
import json
import zlib
from dataclasses import dataclass

from kvevents.errors import KVEventsError

VERSION = 1


class LedgerSnapshotError(KVEventsError):
    pass


@dataclass
class Info:
    stream_seq: int
    version: int
    entries: int


class LedgerRouter:
    def __init__(self) -> None:
        self.ledger: dict[str, list[str]] = {}
        self.unreliable: set[str] = set()

    def handle(self, d) -> None:
        kind = d.kind.value
        if kind == "batch":
            self.ledger.setdefault(d.publisher, []).append(f"{d.seq}:{hashlib.sha1(d.payload).hexdigest()[:12]}")
        elif kind == "reset":
            self.ledger[d.publisher] = []
            self.unreliable.discard(d.publisher)
        else:
            self.unreliable.add(d.publisher)

    def entries(self) -> int:
        return sum(len(v) for v in self.ledger.values())

    def pods(self) -> list[str]:
        return sorted(self.ledger)

    def digest(self) -> str:
        return hashlib.sha256(json.dumps([self.ledger, sorted(self.unreliable)], sort_keys=True).encode()).hexdigest()

    def snapshot(self, *, stream_seq: int | None = None) -> bytes:
        body = json.dumps({"v": VERSION, "seq": stream_seq, "ledger": self.ledger,
                           "unreliable": sorted(self.unreliable)}).encode()
        return zlib.crc32(body).to_bytes(4, "big") + body

    def restore(self, data: bytes) -> Info:
        if len(data) < 4 or zlib.crc32(data[4:]).to_bytes(4, "big") != data[:4]:
            raise LedgerSnapshotError("snapshot checksum mismatch (corrupt or truncated)")
        doc = json.loads(data[4:])
        if doc["v"] != VERSION:
            raise LedgerSnapshotError(f"snapshot version {doc['v']} is not {VERSION}")
        self.ledger = doc["ledger"]
        self.unreliable = set(doc["unreliable"])
        return Info(doc["seq"] or 0, doc["v"], self.entries())
