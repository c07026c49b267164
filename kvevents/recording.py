"""Recording files: what arrived on the wire, frame for frame, in a file that survives a kill.

Format, version 1 (all integers big-endian)::

    file    := header record*
    header  := MAGIC  VERSION  META_LEN  META  META_CRC
      MAGIC    8 bytes  89 4B 56 52 45 43 0D 0A   ("\\x89KVREC\\r\\n": a high byte and CRLF catch
                                                   7-bit and text-mode mangling)
      VERSION  u16      1
      META_LEN u32      length of META
      META     msgpack map of strings to plain values: "created" (float, seconds since the epoch),
               "writer" (str), and whatever the writer adds (e.g. "source")
      META_CRC u32      CRC-32 of META
    record  := MARK  LEN  CRC  BODY
      MARK     2 bytes  A5 5A   (lets a reader find the next record after a damaged one)
      LEN      u32      length of BODY
      CRC      u32      CRC-32 of the LEN bytes followed by BODY
      BODY     msgpack array [recv_ts, publisher, socket, frames]:
                 recv_ts    float: wall-clock seconds when the message was received
                 publisher  str: who sent it (the recorder uses the PUB endpoint it connected to)
                 socket     str: "pub" (the live PUB/SUB stream) or "replay" (an answer on the
                            replay DEALER socket)
                 frames     array of bin: the ZeroMQ frames exactly as received. "pub":
                            [topic, seq (8 bytes, big-endian), payload]. "replay": as the DEALER
                            receives them, [b"", topic, seq, payload], and the end marker
                            [b"", b"", (-1 as 8 signed bytes), b""]
               A reader ignores array elements past the fourth (room for later minor additions).

Rules:

* Append-only: a writer only ever appends whole records and flushes each one to the operating
  system (``flush_every``), so a killed writer loses at most the records it had not flushed and
  leaves at most one torn record at the end.
* A torn or unreadable tail (a prefix of a record, a zero-filled tail after a crash) is ignored by
  readers and counted in :attr:`RecordingReader.truncated_bytes`.
* A damaged record followed by good ones is skipped (the reader resynchronises on MARK + a valid
  CRC) and counted in :attr:`RecordingReader.bad_records` / ``skipped_bytes``.
* VERSION changes only when old readers could misread new files; a reader refuses versions it does
  not know with :class:`UnsupportedRecordingVersion`. Not a recording: :class:`NotARecordingError`.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import stat
import struct
import time
import zlib
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import msgspec

from ._crcrange import RangeCRC
from .errors import KVEventsError
from .transport.zmq.frames import END_SEQ

__all__ = [
    "MAGIC",
    "VERSION",
    "Record",
    "RecordingError",
    "NotARecordingError",
    "UnsupportedRecordingVersion",
    "RecordingWriter",
    "RecordingReader",
    "read_recording",
    "capture_records",
    "convert_capture",
]

MAGIC = b"\x89KVREC\r\n"
VERSION = 1
MARK = b"\xa5\x5a"
SOCKETS = ("pub", "replay")
MAX_RECORD = 1 << 30  #: a LEN above this is damage, not a record

MAX_META_DEPTH = 32  #: header metadata nested deeper is refused (printing it would recurse without end)

_KIND = {stat.S_IFIFO: "a FIFO", stat.S_IFDIR: "a directory", stat.S_IFCHR: "a character device",
         stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}
_ARRAY_HEADS = frozenset(range(0x90, 0xA0)) | {0xDC, 0xDD}
_HEAD = struct.Struct(">8sHI")  # magic, version, meta length
_U32 = struct.Struct(">I")
_REC = struct.Struct(">2sII")  # mark, len, crc


class RecordingError(KVEventsError):
    """A recording file cannot be read or written; the message names the file and the reason."""


class NotARecordingError(RecordingError, ValueError):
    """The file does not start with a recording header (wrong magic, too short, bad header CRC)."""


class UnsupportedRecordingVersion(RecordingError, ValueError):
    """The file is a recording in a format version this reader does not know."""


class Record(msgspec.Struct, array_like=True, gc=False):
    """One message as it was received: time, who sent it, on which socket, and its raw frames."""

    recv_ts: float
    publisher: str
    socket: str
    frames: list[bytes]

    @property
    def message(self) -> list[bytes]:
        """The frames without the DEALER's empty delimiter: ``[topic, seq, payload]`` for both sockets."""
        f = self.frames
        if self.socket == "replay" and f and f[0] == b"":
            return f[1:]
        return f

    @property
    def well_formed(self) -> bool:
        m = self.message
        return len(m) == 3 and len(m[1]) == 8

    @property
    def topic(self) -> bytes:
        return self.message[0]

    @property
    def seq(self) -> int:
        """The sequence number: unsigned 64-bit as on the wire, except the replay end marker's -1.

        ValueError if malformed.
        """
        m = self.message
        if len(m) != 3 or len(m[1]) != 8:
            raise ValueError(f"{self.socket} message from {self.publisher!r} is malformed: {len(m)} frames")
        if m[1] == END_SEQ and self.socket == "replay" and m[0] == b"":
            return -1
        return int.from_bytes(m[1], "big")

    @property
    def payload(self) -> bytes:
        return self.message[2]

    @property
    def is_end_marker(self) -> bool:
        m = self.message
        return self.socket == "replay" and len(m) == 3 and m[0] == b"" and m[1] == END_SEQ


_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(Record)


def _depth(obj: Any) -> int:
    """Nesting depth of lists and maps in ``obj``, without recursion (stops counting past MAX_META_DEPTH)."""
    deepest, todo = 0, [(obj, 0)]
    while todo:
        o, d = todo.pop()
        if isinstance(o, dict):
            o = list(o.values())
        if isinstance(o, list):
            d += 1
            if d > MAX_META_DEPTH:
                return d
            deepest = max(deepest, d)
            todo.extend((v, d) for v in o)
    return deepest


def _header(meta: dict[str, Any]) -> bytes:
    body = _ENC.encode(meta)
    return _HEAD.pack(MAGIC, VERSION, len(body)) + body + _U32.pack(zlib.crc32(body))


def encode_record(record: Record) -> bytes:
    body = _ENC.encode(record)
    length = _U32.pack(len(body))
    return MARK + length + _U32.pack(zlib.crc32(body, zlib.crc32(length))) + body


class RecordingWriter:
    """Appends records to a recording file.

    ``mode="w"`` creates (or truncates) the file; ``mode="a"`` appends to an existing recording,
    first cutting off a torn tail (its size is kept in :attr:`repaired_bytes`), or creates it.
    Each record is flushed to the OS after ``flush_every`` records (1: every record); ``fsync=True``
    also forces it to disk on each flush (survives power loss, costs a disk sync per flush).
    """

    def __init__(self, path: str | os.PathLike, *, mode: str = "w", meta: dict[str, Any] | None = None,
                 flush_every: int = 1, fsync: bool = False) -> None:
        if mode not in ("w", "a"):
            raise ValueError(f"mode must be 'w' or 'a', got {mode!r}")
        if not isinstance(flush_every, int) or flush_every < 1:
            raise ValueError(f"flush_every must be an int >= 1, got {flush_every!r}")
        self.path = Path(path)
        self.flush_every = flush_every
        self.fsync = fsync
        self.records = 0  #: records written by this writer
        self.bytes = 0  #: bytes written by this writer (header included)
        self.repaired_bytes = 0  #: torn tail cut off before appending (mode "a")
        self._unflushed = 0
        full_meta = {"created": time.time(), "writer": "kvevents"}
        full_meta.update(meta or {})
        if _depth(full_meta) > MAX_META_DEPTH:
            raise ValueError(f"recording metadata nests deeper than {MAX_META_DEPTH} levels")
        try:
            if mode == "a" and self.path.exists() and self.path.stat().st_size > 0:
                with RecordingReader(self.path) as reader:
                    for _ in reader:
                        pass
                    end = reader.end_offset
                    self.repaired_bytes = reader.truncated_bytes
                self._f = open(self.path, "r+b")
                self._f.truncate(end)
                self._f.seek(end)
            else:  # header written under a temporary name, then renamed: readers never see half a header
                tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
                self._f = open(tmp, "wb")
                head = _header(full_meta)
                self._f.write(head)
                self._f.flush()
                os.replace(tmp, self.path)
                self.bytes += len(head)
        except OSError as exc:
            raise RecordingError(f"cannot open recording {str(self.path)!r} for writing: {exc.strerror or exc}") from None

    def write(self, frames: Sequence[bytes], publisher: str, recv_ts: float | None = None, socket: str = "pub") -> None:
        """Append one received message (its frames as they came off the socket)."""
        if socket not in SOCKETS:
            raise ValueError(f"socket must be one of {SOCKETS}, got {socket!r}")
        if not isinstance(publisher, str):
            raise TypeError(f"publisher must be a str, got {type(publisher).__name__}")
        if recv_ts is not None and not math.isfinite(recv_ts):
            raise ValueError(f"recv_ts must be a finite time, got {recv_ts!r}")
        rec = Record(time.time() if recv_ts is None else float(recv_ts), publisher, socket,
                     [bytes(f) for f in frames])
        self.write_record(rec)

    def write_record(self, record: Record) -> None:
        data = encode_record(record)
        if len(data) - _REC.size > MAX_RECORD:
            raise ValueError(f"record of {len(data)} bytes exceeds the format's limit of {MAX_RECORD}")
        self._f.write(data)
        self.records += 1
        self.bytes += len(data)
        self._unflushed += 1
        if self._unflushed >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        self._unflushed = 0
        self._f.flush()
        if self.fsync:
            os.fsync(self._f.fileno())

    def close(self) -> None:
        if not self._f.closed:
            self.flush()
            self._f.close()

    def __enter__(self) -> "RecordingWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class RecordingReader:
    """Iterates the :class:`Record` s of a recording, skipping damage and ignoring a torn tail.

    Counters (final once iteration ends): ``records``, ``truncated_bytes`` (unreadable bytes at
    the end), ``bad_records`` and ``skipped_bytes`` (damaged stretches followed by good records),
    ``undecodable`` (records whose CRC matched but whose body is not a record — a writer bug —, or
    whose receive time is NaN).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.records = 0
        self.truncated_bytes = 0
        self.bad_records = 0
        self.skipped_bytes = 0
        self.undecodable = 0
        self.end_offset = 0  #: where the last good record ends
        self._ranges: RangeCRC | None = None
        try:
            st = os.stat(self.path)
            if not stat.S_ISREG(st.st_mode):  # a FIFO would block open() forever, a device read forever
                raise RecordingError(f"cannot read recording {str(self.path)!r}: not a regular file "
                                     f"({_KIND.get(stat.S_IFMT(st.st_mode), 'special file')})")
            self._f = open(self.path, "rb")
            size = os.fstat(self._f.fileno()).st_size
            self._buf: Any = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ) if size else b""
        except OSError as exc:
            raise RecordingError(f"cannot read recording {str(self.path)!r}: {exc.strerror or exc}") from None
        self.size = size
        self.meta, self.version, self._start = self._read_header()
        self.end_offset = self._start

    def _read_header(self) -> tuple[dict[str, Any], int, int]:
        buf, name = self._buf, str(self.path)
        if len(buf) < _HEAD.size or bytes(buf[:8]) != MAGIC:
            self.close()
            raise NotARecordingError(f"{name!r} is not a kvevents recording (no {MAGIC!r} header)")
        _, version, meta_len = _HEAD.unpack_from(buf, 0)
        if version != VERSION:
            self.close()
            raise UnsupportedRecordingVersion(
                f"{name!r} is a recording of format version {version}; this reader knows version {VERSION}")
        end = _HEAD.size + meta_len
        if end + 4 > len(buf):
            size = len(buf)
            self.close()
            raise NotARecordingError(f"{name!r}: recording header is cut short ({size} bytes)")
        body = bytes(buf[_HEAD.size:end])
        if zlib.crc32(body) != _U32.unpack_from(buf, end)[0]:
            self.close()
            raise NotARecordingError(f"{name!r}: recording header is damaged (CRC mismatch)")
        try:
            meta = msgspec.msgpack.decode(body)
            too_deep = _depth(meta) > MAX_META_DEPTH
        except (msgspec.DecodeError, UnicodeDecodeError):
            meta, too_deep = None, False
        except RecursionError:  # too deep for the decoder itself
            meta, too_deep = None, True
        if too_deep:
            self.close()
            raise NotARecordingError(f"{name!r}: recording header metadata nests deeper than {MAX_META_DEPTH} levels")
        if not isinstance(meta, dict):
            self.close()
            raise NotARecordingError(f"{name!r}: recording header metadata is not a map")
        return meta, version, end + 4

    def _valid_at(self, pos: int, ranges: RangeCRC | None = None) -> int:
        """End offset of a CRC-valid record at ``pos``, or -1."""
        buf = self._buf
        if pos + _REC.size > len(buf) or buf[pos:pos + 2] != MARK:
            return -1
        _, length, crc = _REC.unpack_from(buf, pos)
        end = pos + _REC.size + length
        if length > MAX_RECORD or end > len(buf):
            return -1
        if ranges is not None and length and buf[pos + _REC.size] not in _ARRAY_HEADS:
            return -1  # a body is a msgpack array: cheap to refuse most false MARKs before hashing
        start = zlib.crc32(buf[pos + 2:pos + 6])
        if ranges is not None:  # resynchronising: candidates overlap, each must cost O(1), not its length
            got = ranges.crc(pos + _REC.size, end, start)
        else:
            got = zlib.crc32(buf[pos + _REC.size:end], start)
        return end if got == crc else -1

    def _resync(self, pos: int) -> int:
        """The next offset after ``pos`` where a valid record starts, or -1 (linear in the bytes passed)."""
        buf = self._buf
        if self._ranges is None:
            self._ranges = RangeCRC(buf, pos)
        while True:
            pos = buf.find(MARK, pos + 1)
            if pos < 0 or self._valid_at(pos, self._ranges) >= 0:
                return pos

    def __iter__(self) -> Iterator[Record]:
        buf, pos, size = self._buf, self._start, len(self._buf)
        while pos < size:
            end = self._valid_at(pos)
            if end < 0:
                nxt = self._resync(pos)
                if nxt < 0:
                    self.truncated_bytes = size - pos
                    return
                self.bad_records += 1
                self.skipped_bytes += nxt - pos
                pos = nxt
                continue
            try:
                rec = _DEC.decode(buf[pos + _REC.size:end])
            except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):  # a hostile body: nested deep, bad UTF-8
                rec = None
            if rec is not None and rec.recv_ts != rec.recv_ts:
                rec = None  # no writer writes a NaN time: damage, not a clock to run the stream on
            if rec is None:
                self.undecodable += 1
            pos = self.end_offset = end
            if rec is not None:
                self.records += 1
                yield rec

    def close(self) -> None:
        if self._ranges is not None:
            self._ranges.close()
            self._ranges = None
        if isinstance(self._buf, mmap.mmap):
            self._buf.close()
        self._buf = b""
        self._f.close()

    def __enter__(self) -> "RecordingReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_recording(path: str | os.PathLike) -> tuple[list[Record], RecordingReader]:
    """All records of a file, and the (closed) reader holding its counters and metadata."""
    with RecordingReader(path) as reader:
        records = list(reader)
    return records, reader


def capture_records(jsonl_path: str | os.PathLike, publisher: str | None = None) -> Iterator[Record]:
    """Records from a conformance capture (one ``{"socket", "frames": [hex, ...]}`` object a line).

    The capture holds no receive times: each record gets its batch's own ``ts`` where the payload
    decodes, else the previous record's time. ``publisher`` defaults to ``capture:<file name>``.
    """
    from .codec import decode_batch
    from .errors import DecodeError

    path = Path(jsonl_path)
    publisher = publisher or f"capture:{path.name}"
    last_ts = 0.0
    expected = 'a conformance capture is JSON Lines: one {"socket": "pub"|"replay", "frames": [hex, ...]} object a line'
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise RecordingError(f"cannot read capture {str(path)!r}: {exc.strerror or exc}") from None
    if data.startswith(MAGIC):
        raise RecordingError(f"{str(path)!r} is already a kvevents recording, not a capture ({expected})")
    try:
        lines = data.decode("utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise RecordingError(f"{str(path)!r} is not a capture: byte {exc.start} is not UTF-8 text ({expected})") from None
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            socket = obj["socket"]
            frames = [bytes.fromhex(h) for h in obj["frames"]]
        except (ValueError, KeyError, TypeError) as exc:
            why = f"no {exc} key" if isinstance(exc, KeyError) else str(exc)
            raise RecordingError(f"{str(path)!r} line {lineno}: not a capture line ({why}; {expected})") from None
        if socket not in SOCKETS:
            raise RecordingError(f"{str(path)!r} line {lineno}: unknown socket {socket!r}")
        rec = Record(last_ts, publisher, socket, frames)
        if rec.well_formed and not rec.is_end_marker:
            try:
                last_ts = decode_batch(rec.payload).ts
            except DecodeError:
                pass
            rec.recv_ts = last_ts
        yield rec


def convert_capture(jsonl_path: str | os.PathLike, out_path: str | os.PathLike, *,
                    publisher: str | None = None) -> int:
    """Write a conformance capture as a recording; returns the number of records written."""
    records: Iterable[Record] = list(capture_records(jsonl_path, publisher))
    with RecordingWriter(out_path, meta={"source": str(jsonl_path)}, flush_every=1 << 30) as w:
        for rec in records:
            w.write_record(rec)
        return w.records
