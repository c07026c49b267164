"""The recording file format: round trip, a torn tail, damage, wrong files, capture conversion, kill survival."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvevents import KVEventsError, decode_batch
from kvevents.recording import (
    MAGIC,
    NotARecordingError,
    Record,
    RecordingError,
    RecordingReader,
    RecordingWriter,
    UnsupportedRecordingVersion,
    capture_records,
    convert_capture,
    encode_record,
    read_recording,
)

CAPTURE = "vllm-0.33.0-live-pub-replay.jsonl"


def _frames(seq: int, payload: bytes = b"payload", topic: bytes = b"kv@pod-a@m") -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), payload]


def _write(path, records) -> list[int]:
    """Write records; return the file offset where each record starts."""
    starts = []
    with RecordingWriter(path, meta={"test": True}) as w:
        for r in records:
            starts.append(w.bytes)
            w.write_record(r)
    return starts


def _sample() -> list[Record]:
    return [
        Record(1.5, "tcp://127.0.0.1:5557", "pub", _frames(0)),
        Record(1.75, "tcp://127.0.0.1:5557", "pub", _frames(1, b"")),
        Record(2.0, "pod-ü", "pub", _frames(7, bytes(range(256)) * 10)),
        Record(2.5, "tcp://127.0.0.1:5557", "replay", [b""] + _frames(1)),
        Record(2.6, "tcp://127.0.0.1:5557", "replay", [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]),
    ]


def test_round_trip_keeps_every_frame_and_the_metadata(tmp_path):
    path = tmp_path / "a.kvrec"
    recs = _sample()
    _write(path, recs)
    got, reader = read_recording(path)
    assert got == recs
    assert reader.meta["test"] is True and reader.meta["writer"] == "kvevents"
    assert reader.version == 1
    assert (reader.truncated_bytes, reader.bad_records, reader.skipped_bytes) == (0, 0, 0)
    assert got[3].message == _frames(1) and got[3].seq == 1 and got[3].topic == b"kv@pod-a@m"
    assert got[4].is_end_marker and got[4].seq == -1
    assert not got[0].is_end_marker and got[2].payload == bytes(range(256)) * 10


def test_writer_validates_its_input(tmp_path):
    with RecordingWriter(tmp_path / "a.kvrec") as w:
        with pytest.raises(ValueError, match="socket"):
            w.write(_frames(0), "p", 1.0, socket="router")
        with pytest.raises(TypeError, match="publisher"):
            w.write(_frames(0), b"p", 1.0)
    with pytest.raises(ValueError, match="mode"):
        RecordingWriter(tmp_path / "b.kvrec", mode="x")


def test_a_tail_cut_at_every_byte_of_the_last_record_is_ignored_and_counted(tmp_path):
    path = tmp_path / "a.kvrec"
    recs = _sample()
    starts = _write(path, recs)
    data = path.read_bytes()
    last = starts[-1]
    cut_path = tmp_path / "cut.kvrec"
    for cut in range(last, len(data)):
        cut_path.write_bytes(data[:cut])
        got, reader = read_recording(cut_path)
        assert got == recs[:-1], cut
        assert reader.truncated_bytes == cut - last, cut
        assert reader.bad_records == 0
        assert reader.end_offset == last


def test_a_file_cut_inside_its_header_is_not_a_recording(tmp_path):
    path = tmp_path / "a.kvrec"
    _write(path, _sample())
    data = path.read_bytes()
    for cut in (0, 4, 8, 13, 20):
        (tmp_path / "h.kvrec").write_bytes(data[:cut])
        with pytest.raises(NotARecordingError):
            RecordingReader(tmp_path / "h.kvrec")


def test_damage_in_the_middle_skips_one_record_and_the_rest_is_read(tmp_path):
    path = tmp_path / "a.kvrec"
    recs = _sample()
    starts = _write(path, recs)
    data = bytearray(path.read_bytes())
    data[starts[2] + 20] ^= 0xFF  # inside record 2's body
    path.write_bytes(bytes(data))
    got, reader = read_recording(path)
    assert got == recs[:2] + recs[3:]
    assert reader.bad_records == 1
    assert reader.skipped_bytes == starts[3] - starts[2]
    assert reader.truncated_bytes == 0


def test_a_zero_filled_tail_counts_as_truncated(tmp_path):
    path = tmp_path / "a.kvrec"
    recs = _sample()
    _write(path, recs)
    with open(path, "ab") as f:
        f.write(bytes(4096))
    got, reader = read_recording(path)
    assert got == recs
    assert reader.truncated_bytes == 4096 and reader.bad_records == 0


def test_wrong_magic_and_unknown_version_are_typed_errors(tmp_path):
    other = tmp_path / "other.kvrec"
    other.write_bytes(b"PK\x03\x04 this is a zip file, not a recording")
    with pytest.raises(NotARecordingError, match="not a kvevents recording") as exc:
        RecordingReader(other)
    assert isinstance(exc.value, KVEventsError) and isinstance(exc.value, ValueError)
    assert str(other) in str(exc.value)

    path = tmp_path / "a.kvrec"
    _write(path, _sample())
    data = bytearray(path.read_bytes())
    data[len(MAGIC):len(MAGIC) + 2] = (2).to_bytes(2, "big")
    path.write_bytes(bytes(data))
    with pytest.raises(UnsupportedRecordingVersion, match="version 2"):
        RecordingReader(path)

    with pytest.raises(RecordingError, match="cannot read"):
        RecordingReader(tmp_path / "missing.kvrec")
    with pytest.raises(RecordingError, match="cannot open"):
        RecordingWriter(tmp_path / "no" / "dir.kvrec")


def test_append_mode_cuts_a_torn_tail_then_appends(tmp_path):
    path = tmp_path / "a.kvrec"
    recs = _sample()
    _write(path, recs)
    with open(path, "ab") as f:
        f.write(encode_record(recs[0])[:7])  # a torn record
    extra = Record(9.0, "late", "pub", _frames(42))
    with RecordingWriter(path, mode="a") as w:
        assert w.repaired_bytes == 7
        w.write_record(extra)
    got, reader = read_recording(path)
    assert got == recs + [extra]
    assert reader.truncated_bytes == 0 and reader.bad_records == 0
    with pytest.raises(NotARecordingError):
        (tmp_path / "x").write_bytes(b"not a recording at all")
        RecordingWriter(tmp_path / "x", mode="a")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(allow_nan=False), st.text(max_size=8), st.sampled_from(["pub", "replay"]),
                          st.lists(st.binary(max_size=40), max_size=5)), max_size=12),
       st.integers(min_value=0, max_value=64))
def test_property_round_trip_and_any_torn_tail(tmp_path_factory, rows, tear):
    path = tmp_path_factory.mktemp("p") / "r.kvrec"
    recs = [Record(*row) for row in rows]
    _write(path, recs)
    got, reader = read_recording(path)
    assert got == recs
    if recs:
        last = encode_record(recs[-1])
        tear = min(tear, len(last) - 1)
        data = path.read_bytes()
        path.write_bytes(data[: len(data) - len(last) + tear])
        got, reader = read_recording(path)
        assert got == recs[:-1] and reader.truncated_bytes == tear


def test_convert_capture_keeps_the_exact_frames(conformance_dir, tmp_path):
    src = conformance_dir / CAPTURE
    out = tmp_path / "cap.kvrec"
    assert convert_capture(src, out) == 41
    got, reader = read_recording(out)
    lines = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
    assert [r.socket for r in got] == [o["socket"] for o in lines]
    assert [r.frames for r in got] == [[bytes.fromhex(h) for h in o["frames"]] for o in lines]
    pub = [r for r in got if r.socket == "pub"]
    replay = [r for r in got if r.socket == "replay"]
    assert len(pub) == 30 and len(replay) == 11
    assert [r.seq for r in pub] == list(range(30))
    assert [r.seq for r in replay[:-1]] == list(range(20, 30)) and replay[-1].is_end_marker
    assert all(r.frames[0] == b"" for r in replay)
    assert {r.topic for r in got if not r.is_end_marker} == {b"kv@pod-a@demo-model"}
    # the capture holds no receive times: each record carries its batch's ts
    assert [r.recv_ts for r in pub] == [decode_batch(r.payload).ts for r in pub]
    assert replay[-1].recv_ts == replay[-2].recv_ts
    assert reader.meta["source"].endswith(CAPTURE)
    assert {r.publisher for r in got} == {f"capture:{CAPTURE}"}


def test_a_bad_capture_line_is_a_typed_error_naming_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"socket": "pub", "frames": ["00"]}\n{"socket": "pub", "frames": ["zz"]}\n')
    with pytest.raises(RecordingError, match="line 2"):
        list(capture_records(bad))
    bad.write_text('{"socket": "sub", "frames": []}\n')
    with pytest.raises(RecordingError, match="unknown socket"):
        list(capture_records(bad))


_WRITER = """
import sys, time
from kvevents.recording import RecordingWriter
with RecordingWriter(sys.argv[1]) as w:
    i = 0
    while True:
        w.write([b"topic", i.to_bytes(8, "big"), b"x" * 300], "p", time.time())
        i += 1
"""


def test_a_killed_writer_leaves_a_readable_file(tmp_path):
    path = tmp_path / "killed.kvrec"
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(path)])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # poll until it has written a good amount
            if path.exists() and path.stat().st_size > 200_000:
                break
            time.sleep(0.01)
        else:
            pytest.fail("writer wrote nothing")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    got, reader = read_recording(path)
    assert len(got) > 100
    assert [int.from_bytes(r.frames[1], "big") for r in got] == list(range(len(got)))
    assert reader.bad_records == 0
    assert reader.truncated_bytes < len(encode_record(got[-1]))
    assert reader.end_offset + reader.truncated_bytes == os.path.getsize(path)
