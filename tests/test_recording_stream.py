"""A recording read back as deliveries: gaps healed from recorded replay answers, resets, malformed input."""

from __future__ import annotations

from kvevents import BlockStored, DeliveryKind, KVEventBatch, encode_batch
from kvevents.recording import Record
from kvevents.recordstream import DeliveryStream, iter_deliveries

END = [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
BATCH, RESET, GAP = DeliveryKind.BATCH, DeliveryKind.RESET, DeliveryKind.GAP


def _payload(seq: int) -> bytes:
    ev = BlockStored([seq], None, [1, 2], 2, None, "GPU", None)
    return encode_batch(KVEventBatch(float(seq), [ev]))


def live(seq: int, t: float | None = None, pub: str = "A") -> Record:
    return Record(float(seq) * 0.01 if t is None else t, pub, "pub", [b"kv@pod@m", seq.to_bytes(8, "big"), _payload(seq)])


def replay(seq: int, t: float, pub: str = "A") -> Record:
    return Record(t, pub, "replay", [b"", b"kv@pod@m", seq.to_bytes(8, "big"), _payload(seq)])


def end(t: float, pub: str = "A") -> Record:
    return Record(t, pub, "replay", list(END))


def shape(ds):
    return [(d.kind, d.seq, d.missed if d.kind is GAP else d.replayed) for d in ds]


def test_a_gap_is_healed_by_the_recorded_replay_answer():
    recs = [live(s) for s in range(10) if s not in (4, 5)] + [replay(s, 0.2) for s in range(4, 10)] + [end(0.2)]
    ds = list(iter_deliveries(recs))
    assert [d.seq for d in ds] == list(range(10))
    assert all(d.kind is BATCH for d in ds)
    assert [d.replayed for d in ds if d.seq in (4, 5)] == [True, True]
    assert ds[4].batch.events[0].block_hashes == [4]
    assert ds[0].topic == "kv@pod@m" and ds[0].publisher == "A"


def test_without_an_answer_the_gap_is_reported_and_the_rest_delivered():
    recs = [live(s) for s in range(8) if s not in (3, 4)]
    assert shape(iter_deliveries(recs)) == (
        [(BATCH, s, False) for s in range(3)] + [(GAP, 3, 2)] + [(BATCH, s, False) for s in range(5, 8)])
    # held batches are released when the replay time runs out, before later records are read
    recs = [live(0, 0.0), live(2, 0.1), live(3, 5.0)]
    stream = DeliveryStream(replay_timeout=1.0)
    assert shape(stream.push(recs[0])) == [(BATCH, 0, False)]
    assert stream.push(recs[1]) == []
    assert shape(stream.push(recs[2])) == [(GAP, 1, 1), (BATCH, 2, False), (BATCH, 3, False)]
    assert stream.finish() == []


def test_a_partial_answer_heals_what_it_can():
    recs = [live(0), live(1), live(4), replay(2, 0.05), end(0.05), live(5)]
    assert shape(iter_deliveries(recs)) == [
        (BATCH, 0, False), (BATCH, 1, False), (BATCH, 2, True), (GAP, 3, 1), (BATCH, 4, False), (BATCH, 5, False)]


def test_a_restart_is_a_reset_and_duplicates_from_replay_are_dropped():
    recs = [live(s) for s in range(5)] + [replay(3, 0.05), replay(4, 0.05), end(0.05)] + [live(0, 0.1), live(1, 0.11)]
    assert shape(iter_deliveries(recs)) == (
        [(BATCH, s, False) for s in range(5)] + [(RESET, 0, False), (BATCH, 0, False), (BATCH, 1, False)])


def test_publishers_are_healed_independently():
    recs = [live(0, pub="A"), live(0, pub="B"), live(2, pub="A"), live(1, pub="B"),
            replay(1, 0.03, pub="A"), end(0.03, pub="A")]
    ds = list(iter_deliveries(recs))
    assert [(d.publisher, d.seq) for d in ds if d.publisher == "A"] == [("A", 0), ("A", 1), ("A", 2)]
    assert [(d.publisher, d.seq) for d in ds if d.publisher == "B"] == [("B", 0), ("B", 1)]


def test_malformed_payloads_and_frames_are_counted_not_fatal():
    bad_payload = Record(0.01, "A", "pub", [b"t", (1).to_bytes(8, "big"), b"\xc1 not msgpack"])
    bad_frames = Record(0.02, "A", "pub", [b"t", b"short"])
    stream = DeliveryStream()
    ds = []
    for r in (live(0), bad_payload, bad_frames, live(2)):
        ds += stream.push(r)
    ds += stream.finish()
    assert [(d.kind, d.seq, d.reason) for d in ds] == [
        (BATCH, 0, ""), (GAP, 1, "malformed"), (BATCH, 2, "")]
    assert stream.undecodable["A"] == 1 and stream.malformed_frames["A"] == 1


def test_late_join_uses_a_backfill_answer_recorded_before_live_batches():
    recs = [replay(s, 0.0) for s in range(3)] + [end(0.0), live(3), live(4)]
    assert [d.seq for d in iter_deliveries(recs, late_join=True)] == [0, 1, 2, 3, 4]
    assert [d.seq for d in iter_deliveries(recs)] == [3, 4]  # without it the answer is unsolicited


def test_raw_mode_keeps_the_payload_bytes():
    ds = list(iter_deliveries([live(0), live(1)], decode=False))
    assert [d.payload for d in ds] == [_payload(0), _payload(1)] and all(d.batch is None for d in ds)
