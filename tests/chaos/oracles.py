"""What the chaos suite checks, input by input: shared by ``tests/chaos`` (small, seeded, in CI) and
``benchmarks/chaos.py`` (the long runs). Every oracle takes one input, runs it through public
APIs only, and raises :class:`Crash` when the component did something other than succeed or
refuse with its own typed error (anything else is a crash: a bug).
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path
from typing import Callable

from kvevents import AllBlocksCleared, BlockRemoved, BlockStored, DecodeError, KVEventBatch, decode_batch, encode_batch
from kvevents.recording import MAGIC, Record, RecordingError, RecordingReader, RecordingWriter, encode_record
from kvevents.recordstream import DeliveryStream, summarize

SHARED = Path(os.environ.get("KVEVENTS_SHARED") or Path(__file__).resolve().parents[3] / "shared")


class Crash(AssertionError):
    """A component raised something other than its typed refusal, or broke an invariant."""


def _ehash(prefix) -> int:
    return hash(("E", 2) + tuple(prefix)) & (2**64 - 1)


def seed_batches() -> list[KVEventBatch]:
    toks = list(range(100, 164))
    hs = [_ehash(toks[: (i + 1) * 2]) for i in range(32)]
    return [
        KVEventBatch(1.0, [BlockStored(hs[:16], None, toks[:32], 2, None, "GPU", None),
                           BlockStored(hs[16:], hs[15], toks[32:], 2, None, "GPU", None)], 0),
        KVEventBatch(2.0, [BlockStored(hs[:8], None, [], 0, None, "CPU", None)], 0),
        KVEventBatch(3.0, [BlockStored(hs[8:12], None, [], 0, None, "CPU", None), BlockRemoved(hs[20:], "GPU")], 0),
        KVEventBatch(4.5, [BlockStored(hs[:2], None, toks[:4], 2, None, "GPU", None, group_idx=0,
                                       extra_keys=[1, "a", [2.5, None]], locality="x"),
                           BlockRemoved(hs[:1], None), AllBlocksCleared()], None),
        KVEventBatch(5.0, [BlockStored([b"\x01" * 32, b"\x02" * 32], None, toks[:4], 2, None, "GPU", None)], 1),
    ]


def seed_payloads() -> list[bytes]:
    """Current and legacy encodings of hand-made batches, plus vLLM's own bytes (the conformance corpus)."""
    out = [encode_batch(b) for b in seed_batches()] + [encode_batch(b, legacy=True) for b in seed_batches()]
    for d in ("vllm-0.33.0", "vllm-0.22.1"):
        folder = SHARED / "conformance" / d
        if folder.is_dir():
            out += [p.read_bytes() for p in sorted(folder.glob("*.msgpack"))]
    return out


def mutate(data: bytes, rnd: random.Random, max_edits: int = 4) -> bytes:
    """A few random byte edits (set, insert, delete, duplicate a slice, msgpack-ish magic values),
    maybe a cut: the shape of corruption a hostile or broken peer sends."""
    p = bytearray(data)
    for _ in range(rnd.randint(1, max_edits)):
        op = rnd.random()
        i = rnd.randrange(len(p) + 1)
        if op < 0.35 and i < len(p):
            p[i] = rnd.getrandbits(8)
        elif op < 0.5:
            p[i:i] = bytes([rnd.choice((0xC0, 0xC1, 0xDC, 0xDD, 0xDE, 0xDF, 0xCF, 0xD3, 0xCB, 0xDB, 0xC6, 0xFF, 0x9F))])
        elif op < 0.65 and i < len(p):
            del p[i:i + rnd.randint(1, 4)]
        elif op < 0.8 and p:
            j = rnd.randrange(len(p))
            p[i:i] = p[j:j + rnd.randint(1, 32)]
        elif op < 0.9 and i + 4 < len(p):
            p[i:i + 4] = rnd.choice((b"\xff\xff\xff\xff", b"\x7f\xff\xff\xff", b"\x00\x00\x00\x00"))
        else:
            p[i:i] = rnd.randbytes(rnd.randint(1, 16))
    if rnd.random() < 0.2:
        p = p[: rnd.randrange(len(p) + 1)]
    return bytes(p)


def check_decode(payload: bytes) -> KVEventBatch | None:
    """decode_batch (current, legacy and lenient forms): a batch or a DecodeError, nothing else; a
    decoded batch re-encodes and decodes to itself."""
    try:
        batch = decode_batch(payload)
    except DecodeError:
        return None
    except BaseException as exc:  # noqa: BLE001 - that is what is being looked for
        raise Crash(f"decode_batch raised {type(exc).__name__}: {exc} on {payload[:64].hex()}") from exc
    try:
        again = decode_batch(encode_batch(batch))
    except BaseException as exc:  # noqa: BLE001
        raise Crash(f"a decoded batch did not survive encode/decode: {type(exc).__name__}: {exc}") from exc
    if encode_batch(again) != encode_batch(batch):  # (bytes, not ==: a NaN ts is not equal to itself)
        raise Crash(f"encode/decode round trip changed a decoded batch: {batch!r:.200}")
    return batch


def _router():
    from consumers import KVRouter

    return KVRouter(model="m", block_size=2)


def check_apply_payload(payload: bytes) -> None:
    """``KVRouter.apply_payload`` (the C parser where built) against ``apply(decode_batch(...))``:
    a DecodeError exactly where the typed decoder raises one, the same refusal otherwise, the same
    public counters after."""
    batch = check_decode(payload)
    slow, fast = _router(), _router()
    if batch is None:
        try:
            fast.apply_payload("p", payload)
        except DecodeError:
            return
        except BaseException as exc:  # noqa: BLE001
            raise Crash(f"apply_payload raised {type(exc).__name__} where decode_batch raised DecodeError") from exc
        raise Crash(f"apply_payload accepted a payload decode_batch refuses: {payload[:64].hex()}")
    try:
        slow.apply("p", batch)
    except Exception as exc:  # a value the router refuses: both must refuse it alike
        try:
            fast.apply_payload("p", payload)
        except type(exc):
            return
        except BaseException as exc2:  # noqa: BLE001
            raise Crash(f"apply refused with {type(exc).__name__}, apply_payload with {type(exc2).__name__}") from exc2
        raise Crash(f"apply refused with {type(exc).__name__}: {exc}; apply_payload accepted it")
    try:
        fast.apply_payload("p", payload)
    except BaseException as exc:  # noqa: BLE001
        raise Crash(f"apply_payload raised {type(exc).__name__}: {exc} on a payload apply() accepts") from exc
    a, b = slow.counters(), fast.counters()
    if a != b:
        raise Crash(f"apply and apply_payload disagree: {a} vs {b}")


def _records() -> list[Record]:
    pays = [encode_batch(b) for b in seed_batches()]
    recs = []
    for seq in range(12):
        recs.append(Record(100.0 + seq, "A", "pub", [b"kv@pod-a@m", seq.to_bytes(8, "big"), pays[seq % len(pays)]]))
    recs.insert(6, Record(106.5, "A", "replay", [b"", b"kv@pod-a@m", (3).to_bytes(8, "big"), pays[3]]))
    recs.insert(7, Record(106.6, "A", "replay", [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]))
    recs.append(Record(120.0, "B", "pub", [b"t", (7).to_bytes(8, "big"), pays[0]]))
    return recs


def seed_recording() -> bytes:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "s.kvrec"
        with RecordingWriter(path, meta={"chaos": True}) as w:
            for r in _records():
                w.write_record(r)
        return path.read_bytes()


def check_recording_bytes(data: bytes, workdir: Path) -> tuple[int, int]:
    """A recording file's bytes, damaged any way: the reader refuses the header with a
    RecordingError or reads records, counting what it skipped; inspect's summary does not raise.
    Returns (records read, damaged records)."""
    path = workdir / "f.kvrec"
    path.write_bytes(data)
    try:
        with RecordingReader(path) as r:
            recs = list(r)
            counted = r.records + r.undecodable
            if r.end_offset > len(data) or (r.truncated_bytes and r.truncated_bytes > len(data)):
                raise Crash(f"reader counters out of range: end {r.end_offset}, truncated {r.truncated_bytes}")
            damaged = r.bad_records + r.undecodable + (r.truncated_bytes > 0)
    except RecordingError:
        return 0, 0
    except BaseException as exc:  # noqa: BLE001
        raise Crash(f"RecordingReader raised {type(exc).__name__}: {exc}") from exc
    if counted < len(recs):
        raise Crash("reader yielded records it did not count")
    try:
        summarize(path)
    except BaseException as exc:  # noqa: BLE001
        raise Crash(f"summarize (kvevents inspect) raised {type(exc).__name__}: {exc}") from exc
    check_stream(recs)
    return len(recs), damaged


def check_stream(records: list[Record]) -> None:
    """Replay answers and live frames, in any order and any shape, through DeliveryStream: no
    exception; per publisher, BATCH seqs strictly increase between RESETs and no seq is delivered
    twice (a splice would show as a repeat without a RESET)."""
    stream = DeliveryStream()
    out = []
    try:
        for rec in records:
            out += stream.push(rec)
        out += stream.finish()
    except BaseException as exc:  # noqa: BLE001
        raise Crash(f"DeliveryStream raised {type(exc).__name__}: {exc}") from exc
    last: dict[str, int] = {}
    for d in out:
        if d.kind.value == "reset":
            last.pop(d.publisher, None)
        elif d.kind.value == "batch":
            if d.publisher in last and d.seq <= last[d.publisher]:
                raise Crash(f"{d.publisher}: seq {d.seq} delivered after {last[d.publisher]} without a RESET")
            last[d.publisher] = d.seq
        elif d.kind.value == "gap":
            last[d.publisher] = d.seq + max(1, d.missed) - 1


def random_records(rnd: random.Random, n: int = 30) -> list[Record]:
    """Hostile record streams: seqs anywhere in 64 bits, replay answers out of order, end markers
    anywhere, malformed frames, garbage payloads, several publishers, times going backwards."""
    pays = [encode_batch(b) for b in seed_batches()] + [b"", b"\xc1", b"\x93"]
    out = []
    t = 100.0
    for _ in range(n):
        pub = rnd.choice("AB")
        t += rnd.choice((0.0, 0.001, 0.5, 3.0, -1.0))
        seq = rnd.choice((rnd.randrange(8), rnd.randrange(8), rnd.randrange(1 << 64), (1 << 63) + rnd.randrange(3),
                          (1 << 64) - 1 - rnd.randrange(2)))
        payload = rnd.choice(pays)
        kind = rnd.random()
        if kind < 0.6:
            frames = [b"kv@p@m", seq.to_bytes(8, "big"), payload]
            out.append(Record(t, pub, "pub", frames))
        elif kind < 0.85:
            out.append(Record(t, pub, "replay", [b"", b"kv@p@m", seq.to_bytes(8, "big"), payload]))
        elif kind < 0.93:
            out.append(Record(t, pub, "replay", [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]))
        else:
            out.append(Record(t, pub, rnd.choice(("pub", "replay")),
                              [rnd.randbytes(rnd.randrange(10)) for _ in range(rnd.randrange(6))]))
    return out


def damage_recording(data: bytes, rnd: random.Random) -> bytes:
    """A recording as crashes and bad disks leave it: torn, zero-filled, bit-flipped, spliced."""
    head = len(MAGIC) + 2
    op = rnd.random()
    if op < 0.25:
        return data[: rnd.randrange(len(data) + 1)]
    if op < 0.4:
        i = rnd.randrange(head, len(data))
        return data[:i] + bytes(rnd.randrange(1, 200)) + data[i:]
    if op < 0.55:
        i = rnd.randrange(len(data))
        return data[:i] + bytes([data[i] ^ (1 << rnd.randrange(8))]) + data[i + 1:]
    if op < 0.7:  # a crafted record with a valid CRC and a hostile body
        body = rnd.choice((b"\x95\xcb" + b"\0" * 8 + b"\xa1A\xa3pub\x90" + b"\x91" * 5000 + b"\x90",
                           b"\x94\xcb\x7f\xf8" + b"\0" * 6 + b"\xa1A\xa3pub\x90",
                           b"\x94\xcb" + b"\0" * 8 + b"\xa1\x8d\xa3pub\x90", rnd.randbytes(20)))
        rec = encode_record(Record(1.0, "A", "pub", [b"x"]))
        import zlib

        length = len(body).to_bytes(4, "big")
        crafted = rec[:2] + length + zlib.crc32(body, zlib.crc32(length)).to_bytes(4, "big") + body
        i = rnd.randrange(head, len(data) + 1)
        return data[:i] + crafted + data[i:]
    return mutate(data, rnd, 6)


ORACLES: dict[str, Callable] = {"decode": check_decode, "apply_payload": check_apply_payload}
