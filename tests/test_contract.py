"""The consumer contract kit: each rule caught on a crafted stream, none on good ones, feed() driving a consumer."""

from __future__ import annotations

import pytest

from consumers.contract import ContractChecker, ContractError, ContractViolation, Rule, check_stream, feed
from consumers import KVRouter
from consumers.recordtools import Recording, SeqHealer, as_deliveries, topic_pod
from kvevents import AllBlocksCleared, BlockRemoved, BlockStored, Delivery, DeliveryKind, KVEventBatch, encode_batch
from kvevents.recording import Record, RecordingWriter

pytest_plugins = ["consumers.contract_plugin"]  # also a pytest11 entry point of the same name: no clash

BS = 4


def gpu(hashes, parent=None, block_size=BS, tokens=None):
    tokens = list(range(block_size * len(hashes))) if tokens is None else tokens
    return BlockStored(list(hashes), parent, tokens, block_size, None, "GPU", None)


def off(hashes, medium="CPU", block_size=0, tokens=()):
    return BlockStored(list(hashes), None, list(tokens), block_size, None, medium, None)


def rm(hashes, medium="GPU"):
    return BlockRemoved(list(hashes), medium)


def b(*events, rank=None):
    return KVEventBatch(1.0, list(events), rank)


def stream(*batches, publisher="p"):
    return [(publisher, i, batch) for i, batch in enumerate(batches)]


def rules(violations):
    return [v.rule for v in violations]


GOOD = stream(
    b(gpu([1, 2, 3])),
    b(gpu([4], parent=3), off([1, 2]), rm([3])),
    b(off([1], medium="STORAGE"), rm([1], medium="CPU"), rm([1, 2, 4])),
    b(gpu([5]), AllBlocksCleared()),
    b(gpu([1, 2]), off([2]), rm([2], medium="CPU"), rm([1, 2])),
)


def test_a_good_stream_has_no_violation():
    checker = ContractChecker()
    checker.feed_all(GOOD)
    checker.assert_ok()
    assert checker.stats["batches"] == 5 and checker.stats["events"] == 13


def test_the_vllm_capture_keeps_the_contract(kv_vllm_capture):
    checker = ContractChecker()  # strict: the capture starts at seq 0 and never removes an unknown block
    checker.feed_all(kv_vllm_capture)
    checker.assert_ok()
    assert checker.stats["batches"] == 30
    assert checker.stats["unverified"] == 0 and checker.stats["duplicates"] == 0


@pytest.mark.parametrize("batches,rule,seq,index", [
    ((b(gpu([1])), b(rm([2]))), Rule.UNKNOWN_REMOVAL, 1, 0),
    ((b(gpu([1])), b(rm([1], medium="CPU"))), Rule.UNKNOWN_REMOVAL, 1, 0),  # stored on GPU, removed from CPU
    ((b(gpu([1])), b(rm([1])), b(rm([1]))), Rule.UNKNOWN_REMOVAL, 2, 0),  # removed twice
    ((b(gpu([1])), b(AllBlocksCleared()), b(rm([1]))), Rule.STALE_REFERENCE, 2, 0),
    ((b(gpu([1])), b(AllBlocksCleared(), off([1]))), Rule.STALE_REFERENCE, 1, 1),
    ((b(gpu([1])), b(AllBlocksCleared()), b(gpu([2], parent=1))), Rule.STALE_REFERENCE, 2, 0),
    ((b(gpu([1])), b(off([1], block_size=BS))), Rule.OFFLOAD_BLOCK_SIZE, 1, 0),
    ((b(gpu([1])), b(off([1], tokens=[1, 2, 3, 4]))), Rule.OFFLOAD_BLOCK_SIZE, 1, 0),
    ((b(gpu([1])), b(off([9]))), Rule.OFFLOAD_UNJOINED, 1, 0),
    ((b(off([1])),), Rule.OFFLOAD_UNJOINED, 0, 0),  # offload before its GPU event
    ((b(gpu([1], block_size=0, tokens=[])),), Rule.GPU_BLOCK_SHAPE, 0, 0),
    ((b(gpu([1, 2], tokens=[1, 2, 3])),), Rule.GPU_BLOCK_SHAPE, 0, 0),
])
def test_each_rule_is_caught_with_publisher_seq_and_event(batches, rule, seq, index):
    violations = check_stream(stream(*batches))
    assert rules(violations) == [rule]
    v = violations[0]
    assert (v.publisher, v.seq, v.event_index) == ("p", seq, index)
    assert v.event is batches[seq].events[index]
    text = str(v)
    assert rule.value in text and "'p'" in text and f"seq {seq}" in text and f"event #{index}" in text


def test_a_reset_drops_what_the_publisher_stored():
    checker = ContractChecker()
    checker.feed_all(stream(b(gpu([1])), b(gpu([2]))))
    checker.feed("p", 0, b(rm([1])))  # seq went backwards: the publisher restarted
    assert rules(checker.finish()) == [Rule.STALE_REFERENCE]
    assert checker.stats["resets"] == 1


def test_sequence_continuity_gaps_heal_by_replay_and_duplicates_are_ignored():
    checker = ContractChecker()
    g = [b(gpu([i])) for i in range(6)]
    for seq in (0, 1, 4, 2, 3, 3, 5):  # 2 and 3 arrive late (replayed), 3 twice
        checker.feed("p", seq, g[seq], replayed=seq in (2, 3))
    checker.feed("p", 1, g[1], replayed=True)  # a replayed duplicate
    checker.assert_ok()
    assert checker.stats["batches"] == 6 and checker.stats["gaps"] == 0

    lost = check_stream([("p", 0, g[0]), ("p", 1, g[1]), ("p", 4, g[4])])
    assert rules(lost) == [Rule.SEQ_GAP] and lost[0].seq == 2 and "2 batch(es)" in lost[0].message
    assert check_stream([("p", 0, g[0]), ("p", 3, g[3])], allow_gaps=True) == []


def test_an_unhealed_gap_makes_unknown_references_unverifiable_until_a_clear():
    checker = ContractChecker(allow_gaps=True)
    # block 7 was stored in the lost batch 1: its removal cannot be judged
    checker.feed_all([("p", 0, b(gpu([1]))), ("p", 2, b(rm([7]))), ("p", 3, b(AllBlocksCleared())),
                      ("p", 4, b(rm([8])))])
    assert rules(checker.finish()) == [Rule.UNKNOWN_REMOVAL]  # only after the clear
    assert checker.stats["unverified"] == 1 and checker.stats["allowed_seq-gap"] == 1


def test_a_stream_joined_late_cannot_judge_references():
    checker = ContractChecker()
    checker.feed_all([("p", 100, b(rm([1]), off([2]))), ("p", 101, b(gpu([3])))])
    checker.assert_ok()
    assert checker.stats["unverified"] == 2


def test_strictness_is_configurable():
    bad = stream(b(gpu([1])), b(rm([2]), off([3])))
    assert rules(check_stream(bad)) == [Rule.UNKNOWN_REMOVAL, Rule.OFFLOAD_UNJOINED]
    assert rules(check_stream(bad, allow_unknown_removals=True)) == [Rule.OFFLOAD_UNJOINED]
    assert check_stream(bad, allow_unknown_removals=True, allow_unjoined_offloads=True) == []
    assert check_stream(stream(b(gpu([1], tokens=[]))), check_gpu_shape=False) == []
    assert check_stream(stream(b(gpu([1])), b(AllBlocksCleared(), gpu([2], parent=1))), check_parents=False) == []


def test_publishers_and_ranks_keep_separate_blocks():
    a = stream(b(gpu([1])), publisher="a")
    other = stream(b(rm([1])), publisher="b")
    assert rules(check_stream(a + other)) == [Rule.UNKNOWN_REMOVAL]
    ranks = stream(b(gpu([1]), rank=0), b(rm([1]), rank=1))
    v = check_stream(ranks)
    assert rules(v) == [Rule.UNKNOWN_REMOVAL] and v[0].data_parallel_rank == 1 and "rank 1" in str(v[0])
    assert check_stream(stream(b(gpu([1]), rank=0), b(rm([1]), rank=0))) == []


def test_deliveries_from_a_subscriber_are_checked_as_given():
    B, R, G = DeliveryKind.BATCH, DeliveryKind.RESET, DeliveryKind.GAP
    ds = [Delivery(B, "p", "t", 0, b(gpu([1]))), Delivery(B, "p", "t", 0, b(gpu([1]))),  # a duplicate
          Delivery(G, "p", "t", 1, None, missed=2, reason="lost"), Delivery(B, "p", "t", 3, b(rm([5]))),
          Delivery(R, "p", "t", 0), Delivery(B, "p", "t", 0, b(gpu([2]))), Delivery(B, "p", "t", 2, b(gpu([3]))),
          Delivery(G, "p", "t", 3, None, missed=1, reason="malformed")]
    checker = ContractChecker()
    checker.feed_all(ds)
    assert rules(checker.finish()) == [Rule.SEQ_GAP, Rule.SEQ_GAP, Rule.MALFORMED]
    assert "without a GAP or RESET" in checker.violations[1].message
    assert checker.stats["duplicates"] == 1 and checker.stats["unverified"] == 1


def test_assert_ok_lists_every_violation():
    checker = ContractChecker()
    checker.feed_all(stream(b(rm([1])), b(rm([2])), b(off([3]))))
    with pytest.raises(ContractError) as exc:
        checker.assert_ok()
    assert len(exc.value.violations) == 3 and all(isinstance(v, ContractViolation) for v in exc.value.violations)
    msg = str(exc.value)
    assert msg.startswith("3 stream contract violation(s)") and "seq 0" in msg and "seq 2" in msg
    assert isinstance(exc.value, AssertionError)


def _record_file(path, batches, publisher="tcp://127.0.0.1:1", start=0):
    with RecordingWriter(path) as w:
        for i, batch in enumerate(batches, start):
            w.write([b"kv@pod-x@m", i.to_bytes(8, "big"), encode_batch(batch)], publisher, float(i))
        w.write([b"junk"], publisher, 99.0)


def test_recordings_are_checked_including_malformed_messages(tmp_path):
    path = tmp_path / "r.kvrec"
    _record_file(path, [b(gpu([1])), b(rm([1])), b(rm([1]))])
    violations = check_stream(path)
    assert rules(violations) == [Rule.MALFORMED, Rule.UNKNOWN_REMOVAL]
    assert violations[1].seq == 2 and violations[1].publisher == "tcp://127.0.0.1:1"


class FakeConsumer:
    def __init__(self):
        self.calls = []

    def apply(self, pod, batch):
        self.calls.append(("apply", pod, len(batch.events)))

    def reset_pod(self, pod):
        self.calls.append(("reset", pod))


def test_feed_drives_a_consumer_and_checks_on_the_way(tmp_path, kv_vllm_capture):
    consumer = FakeConsumer()
    checker = ContractChecker()
    report = feed(consumer, kv_vllm_capture, checker=checker)
    assert report.batches == 30 and report.pods == {"pod-a"}
    assert consumer.calls[0] == ("apply", "pod-a", 1) and consumer.calls[4] == ("apply", "pod-a", 3)
    checker.assert_ok()

    consumer = FakeConsumer()
    report = feed(consumer, [("p", 0, b(gpu([1]))), ("p", 2, b()), ("p", 0, b())])
    assert consumer.calls == [("apply", "p", 1), ("reset", "p"), ("apply", "p", 0), ("reset", "p"),
                              ("apply", "p", 0)]
    assert (report.gaps, report.resets, report.batches) == (1, 1, 3)

    class GapAware(FakeConsumer):
        def on_gap(self, pod, d):
            self.calls.append(("gap", pod, d.missed))

    consumer = GapAware()
    feed(consumer, [("p", 0, b()), ("p", 3, b())])
    assert consumer.calls == [("apply", "p", 0), ("gap", "p", 2), ("apply", "p", 0)]

    class Handler:
        def __init__(self):
            self.kinds = []

        def handle(self, d):
            self.kinds.append(d.kind.value)

    consumer = Handler()
    feed(consumer, [("p", 0, b(gpu([1]))), ("p", 3, b()), ("p", 0, b())])
    assert consumer.kinds == ["batch", "gap", "batch", "reset", "batch"]


def test_our_router_takes_the_vllm_capture_within_the_contract(kv_vllm_capture, kv_feed, kv_contract):
    router = KVRouter()
    report = kv_feed(router, kv_vllm_capture)
    assert report.batches == 30 and report.gaps == 0
    assert router.stats.batches == 30 and router.pods() == ["pod-a"]
    kv_contract.assert_ok()


def test_recordtools_helpers(tmp_path, conformance_dir):
    assert topic_pod("kv@pod-a@model") == "pod-a"
    assert topic_pod("kv@pod-a@org/model@x") == "pod-a"
    assert topic_pod("") is None and topic_pod("kv@@m") is None and topic_pod("other") is None
    cap = Recording.load(conformance_dir / "vllm-0.33.0-live-pub-replay.jsonl", publisher="pod-a")
    assert len(cap) == 41 and cap.publishers == ["pod-a"]
    assert [d.seq for d in as_deliveries(cap)] == list(range(30))
    path = tmp_path / "r.kvrec"
    _record_file(path, [b(), b()], start=5)
    rec = Recording.load(path)
    assert rec.truncated_bytes == 0 and len(rec) == 3
    assert [d.seq for d in as_deliveries(path)] == [5, 6]
    assert [d.seq for d in as_deliveries(rec.records)] == [5, 6]
    with pytest.raises(TypeError, match="expected"):
        list(as_deliveries([object()]))
    healer = SeqHealer(from_zero=True)
    out = healer.push("p", 2, b()) + healer.finish()
    assert [(d.kind, d.seq, d.missed) for d in out] == [(DeliveryKind.GAP, 0, 2), (DeliveryKind.BATCH, 2, 0)]


def test_a_healer_gives_up_the_oldest_hole_past_its_bound():
    healer = SeqHealer(max_pending=3)
    out = []
    for seq in (0, 2, 3, 4, 5):
        out += healer.push("p", seq, b())
    assert [(d.kind.value, d.seq) for d in out] == [("batch", 0), ("gap", 1), ("batch", 2), ("batch", 3),
                                                   ("batch", 4), ("batch", 5)]


def test_records_passed_directly_and_bad_items(tmp_path):
    recs = [Record(0.0, "p", "pub", [b"t", (0).to_bytes(8, "big"), encode_batch(b(gpu([1])))])]
    assert check_stream(recs) == []
    with pytest.raises(TypeError):
        ContractChecker().feed_all([1, 2])
