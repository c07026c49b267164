"""Hostile recordings (issue 10 items 7 and 9): huge seqs, deep headers, crafted damage, FIFOs, NaN times."""

from __future__ import annotations

import json
import os
import zlib

import pytest

import kvevents._crcrange as crcrange
import kvevents.recording as recording
from kvevents import BlockStored, KVEventBatch, encode_batch
from kvevents.cli_record import main
from kvevents.delivery import DeliveryKind
from kvevents.recording import (
    MAGIC,
    NotARecordingError,
    Record,
    RecordingError,
    RecordingReader,
    RecordingWriter,
    encode_record,
)
from kvevents.recordstream import iter_deliveries, summarize
from kvevents.tracker import SeqTracker

TOPIC = b"kv@pod-a@m"


def _frames(seq: int) -> list[bytes]:
    ev = BlockStored([seq & 0xFFFF], None, [1] * 4, 4, None, "GPU", None)
    return [TOPIC, seq.to_bytes(8, "big"), encode_batch(KVEventBatch(1.0, [ev]))]


# ---- item 7: seqs >= 2**63, deep headers ---------------------------------------------------------


def test_a_seq_at_or_above_2_63_is_read_unsigned_and_does_not_recurse(tmp_path, capsys):
    path = tmp_path / "big.kvrec"
    with RecordingWriter(path) as w:
        w.write(_frames(0), "A", 1.0)
        w.write(_frames(1 << 63), "A", 2.0)
        w.write(_frames((1 << 64) - 2), "A", 3.0)
        w.write(_frames(1), "A", 4.0)  # back down: a restart
    recs = list(RecordingReader(path))
    assert [r.seq for r in recs] == [0, 1 << 63, (1 << 64) - 2, 1]
    kinds = [(d.kind, d.seq) for d in iter_deliveries(recs)]
    assert (DeliveryKind.RESET, 1) in kinds and kinds[0] == (DeliveryKind.BATCH, 0)
    assert main(["inspect", str(path)]) == 0
    assert "resets" in capsys.readouterr().out
    assert main(["inspect", "--json", str(path)]) == 0
    json.loads(capsys.readouterr().out)
    p = summarize(path)["publishers"]["A"]
    assert p["resets"] == 1 and p["last_seq"] == 1 and p["live_gaps"][0] == [1, (1 << 63) - 1]


def test_the_replay_end_marker_still_reads_as_minus_one(tmp_path):
    path = tmp_path / "end.kvrec"
    with RecordingWriter(path) as w:
        w.write([b"", b"", (-1).to_bytes(8, "big", signed=True), b""], "A", 1.0, socket="replay")
        w.write([*_frames((1 << 64) - 1)[:2], b"x"], "A", 1.0, socket="pub")
    end, pub = RecordingReader(path)
    assert end.is_end_marker and end.seq == -1
    assert not pub.is_end_marker and pub.seq == (1 << 64) - 1


def test_the_tracker_refuses_a_negative_seq_instead_of_recursing():
    t = SeqTracker("A")
    t.on_live(5, KVEventBatch(1.0, []), 0.0)
    with pytest.raises(ValueError, match="unsigned 64-bit"):
        t.on_live(-3, KVEventBatch(1.0, []), 0.0)


def _deep_header(tmp_path, depth: int):
    body = b"\x82\xa7created\xcb" + b"\0" * 8 + b"\xa1d" + b"\x81\xa1x" * depth + b"\x80"
    path = tmp_path / "deep.kvrec"
    path.write_bytes(recording._HEAD.pack(MAGIC, 1, len(body)) + body + recording._U32.pack(zlib.crc32(body)))
    return path


@pytest.mark.parametrize("depth", [40, 5_000, 100_000])
def test_a_deeply_nested_header_is_refused_by_name(tmp_path, capsys, depth):
    path = _deep_header(tmp_path, depth)
    with pytest.raises(NotARecordingError, match="nests deeper than 32"):
        RecordingReader(path)
    for argv in (["inspect", str(path)], ["inspect", "--json", str(path)]):
        assert main(argv) == 2
        assert "nests deeper than 32 levels" in capsys.readouterr().err


def test_a_record_with_a_deeply_nested_extra_element_is_counted_undecodable(tmp_path):
    path = tmp_path / "x.kvrec"
    with RecordingWriter(path) as w:
        w.write(_frames(0), "A", 1.0)
    body = b"\x95\xcb" + b"\0" * 8 + b"\xa1A\xa3pub\x90" + b"\x91" * 100_000 + b"\x90"
    length = recording._U32.pack(len(body))
    with open(path, "ab") as f:
        f.write(recording.MARK + length + recording._U32.pack(zlib.crc32(body, zlib.crc32(length))) + body)
        f.write(encode_record(Record(2.0, "A", "pub", _frames(1))))
    with RecordingReader(path) as r:
        assert [x.seq for x in r] == [0, 1] and r.undecodable == 1


def test_the_writer_refuses_metadata_it_could_not_read_back(tmp_path):
    deep: dict = {}
    cur = deep
    for _ in range(40):
        cur["x"] = cur = {}
    with pytest.raises(ValueError, match="nests deeper"):
        RecordingWriter(tmp_path / "w.kvrec", meta={"d": deep})
    with RecordingWriter(tmp_path / "w.kvrec") as w, pytest.raises(ValueError, match="finite"):
        w.write(_frames(0), "A", float("nan"))


# ---- item 9: crafted damage is linear, FIFOs refused, NaN times are damage ---------------------------


def _crafted(path, garbage: int) -> int:
    """A good record, ``garbage`` bytes holding a candidate MARK every 4 bytes (each claiming a long
    record that still fits in the file), a good record: the worst case for resynchronising."""
    with RecordingWriter(path) as w:
        w.write(_frames(0), "A", 1.0)
    with open(path, "ab") as f:
        f.write(b"\xa5\x5a\x00\x01" * (garbage // 4))  # LEN 0x0001a55a: 108 kB
        f.write(encode_record(Record(2.0, "A", "pub", _frames(1))))
    return path.stat().st_size


def test_resynchronising_hashes_each_byte_a_bounded_number_of_times(tmp_path, monkeypatch):
    hashed = [0]
    real = zlib.crc32

    class CountingZlib:
        @staticmethod
        def crc32(data, start=0):
            hashed[0] += len(data)
            return real(data, start)

    monkeypatch.setattr(recording, "zlib", CountingZlib)
    monkeypatch.setattr(crcrange, "zlib", CountingZlib)
    crcrange.shift(1, 1)  # the tables are built once per process: not part of a file's cost
    hashed[0] = 0
    size = _crafted(tmp_path / "q.kvrec", 400_000)
    with RecordingReader(tmp_path / "q.kvrec") as r:
        assert [x.seq for x in r] == [0, 1]
        assert r.bad_records == 1 and r.skipped_bytes == 400_000
    # quadratic (every candidate hashing its claimed 108 kB): ~100k candidates x 108 kB = 10 GB
    assert hashed[0] < 4 * size + 1_000_000, hashed[0]


def test_range_crc_agrees_with_zlib():
    import random

    rnd = random.Random(7)
    buf = bytes(rnd.getrandbits(8) for _ in range(50_000))
    rc = crcrange.RangeCRC(buf, 3)
    for _ in range(300):
        a = rnd.randrange(3, len(buf))
        b = rnd.randrange(a, len(buf) + 1)
        c = rnd.getrandbits(32)
        assert rc.crc(a, b, c) == zlib.crc32(buf[a:b], c)
    rc.close()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_is_refused_instead_of_blocking(tmp_path, capsys):
    fifo = tmp_path / "f.kvrec"
    os.mkfifo(fifo)
    with pytest.raises(RecordingError, match="not a regular file .a FIFO."):
        RecordingReader(fifo)
    assert main(["inspect", str(fifo)]) == 2
    assert "not a regular file (a FIFO)" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path)]) == 2
    assert "not a regular file (a directory)" in capsys.readouterr().err


def test_a_nan_receive_time_is_damage_in_text_and_json_alike(tmp_path, capsys):
    bad_ts = float("nan")
    path = tmp_path / "nan.kvrec"
    with RecordingWriter(path) as w:
        w.write(_frames(0), "A", 1.0)
    with open(path, "ab") as f:
        f.write(encode_record(Record(bad_ts, "A", "pub", _frames(1))))
        f.write(encode_record(Record(3.0, "A", "pub", _frames(2))))
    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "undecodable records 1" in text and "(2.000 s)" in text
    assert main(["inspect", "--json", str(path)]) == 0
    s = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"{c} in JSON output"))
    assert s["file"]["undecodable_records"] == 1 and s["time"] == {"first": 1.0, "last": 3.0, "span_s": 2.0}
    assert s["publishers"]["A"]["unrecovered"] == 1


@pytest.mark.parametrize("bad_ts", [float("inf"), float("-inf")])
def test_an_infinite_receive_time_is_kept_but_left_out_of_the_time_span(tmp_path, capsys, bad_ts):
    path = tmp_path / "inf.kvrec"
    with RecordingWriter(path) as w:
        w.write(_frames(0), "A", 1.0)
    with open(path, "ab") as f:
        f.write(encode_record(Record(bad_ts, "A", "pub", _frames(1))))
        f.write(encode_record(Record(3.0, "A", "pub", _frames(2))))
    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "infinite receive times 1" in text and "(2.000 s)" in text
    assert main(["inspect", "--json", str(path)]) == 0
    s = json.loads(capsys.readouterr().out, parse_constant=lambda c: pytest.fail(f"{c} in JSON output"))
    assert s["file"]["infinite_times"] == 1 and s["time"]["span_s"] == 2.0
    assert s["publishers"]["A"]["batches"] == 3


def test_invalid_utf8_in_a_record_or_the_header_is_damage_not_a_crash(tmp_path):
    path = tmp_path / "u.kvrec"
    with RecordingWriter(path) as w:
        w.write(_frames(0), "A", 1.0)
    body = b"\x94\xcb" + b"\0" * 8 + b"\xa1\x8d\xa3pub\x90"  # publisher: one byte that is not UTF-8
    length = recording._U32.pack(len(body))
    with open(path, "ab") as f:
        f.write(recording.MARK + length + recording._U32.pack(zlib.crc32(body, zlib.crc32(length))) + body)
        f.write(encode_record(Record(2.0, "A", "pub", _frames(1))))
    with RecordingReader(path) as r:
        assert [x.seq for x in r] == [0, 1] and r.undecodable == 1
    meta = b"\x81\xa1\x8d\x01"
    head = tmp_path / "h.kvrec"
    head.write_bytes(recording._HEAD.pack(MAGIC, 1, len(meta)) + meta + recording._U32.pack(zlib.crc32(meta)))
    with pytest.raises(NotARecordingError, match="metadata is not a map"):
        RecordingReader(head)


def test_publish_raw_refuses_the_seq_that_reads_as_the_replay_end_marker():
    """On the replay socket a batch with seq 2**64 - 1 is indistinguishable from the end marker
    (-1 as 8 signed bytes): a subscriber would stop reading the answer there."""
    from kvevents.transport.zmq.frames import END_SEQ, pack_seq
    from kvevents.transport.zmq.publisher import ZmqEventPublisher

    from .pubsub_helpers import ipc_pair

    assert pack_seq((1 << 64) - 1) == END_SEQ
    pub = ZmqEventPublisher(*ipc_pair())
    try:
        with pytest.raises(ValueError, match="end marker"):
            pub.publish_raw(b"x", seq=(1 << 64) - 1)
        pub.publish_raw(b"x", seq=(1 << 64) - 2)  # the largest seq a batch can have
    finally:
        pub.shutdown()
