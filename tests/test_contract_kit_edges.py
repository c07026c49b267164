"""The contract kit as a new user meets it (issue 13): what a consumer must implement, damaged and empty recordings."""

from __future__ import annotations

import textwrap

import pytest

from consumers.contract import CONSUMER_PROTOCOL, ContractChecker, Rule, feed
from consumers.recordtools import Recording
from kvevents import BlockStored, KVEventBatch, encode_batch
from kvevents.recording import RecordingWriter

pytest_plugins = ["pytester"]


def _frames(seq: int) -> list[bytes]:
    ev = BlockStored([seq], seq - 1 if seq else None, [seq] * 4, 4, None, "GPU", None)
    return [b"kv@pod-a@m", seq.to_bytes(8, "big"), encode_batch(KVEventBatch(float(seq), [ev]))]


def _recording(path, n: int, torn: bytes = b""):
    with RecordingWriter(path) as w:
        for seq in range(n):
            w.write(_frames(seq), "A", float(seq))
    if torn:
        with open(path, "ab") as f:
            f.write(torn)
    return path


class Applies:
    def __init__(self):
        self.applied = 0

    def apply(self, pod, batch):
        self.applied += 1

    def reset_pod(self, pod):
        pass


class NoResetPod:
    def apply(self, pod, batch):
        pass


def test_a_consumer_without_the_methods_is_refused_up_front_by_name(tmp_path):
    rec = _recording(tmp_path / "r.kvrec", 3)
    with pytest.raises(TypeError) as err:
        feed(object(), rec)
    assert "object cannot be fed: it has no apply() and no reset_pod()" in str(err.value)
    assert "apply(pod, batch)" in str(err.value) and "handle(delivery)" in str(err.value)
    with pytest.raises(TypeError, match="NoResetPod cannot be fed: it has no reset_pod[(][)][.]"):
        feed(NoResetPod(), rec)

    class HandleOnly:
        def __init__(self):
            self.seen = []

        def handle(self, d):
            self.seen.append(d.kind.value)

    h = HandleOnly()
    assert feed(h, rec).batches == 3 and h.seen == ["batch"] * 3
    assert "reset_pod(pod)" in CONSUMER_PROTOCOL


def test_a_damaged_recording_is_a_violation_unless_allowed(tmp_path):
    rec = Recording.load(_recording(tmp_path / "t.kvrec", 3, torn=b"\xa5\x5a\x00\x00\x00"))
    checker = ContractChecker()
    report = feed(Applies(), rec, checker=checker)
    assert report.batches == 3
    (v,) = checker.finish()
    assert v.rule is Rule.DAMAGED_RECORDING and "5 torn tail bytes" in v.message and "t.kvrec" in v.message
    lenient = ContractChecker(allow_damage=True)
    feed(Applies(), rec, checker=lenient)
    assert lenient.finish() == [] and lenient.stats["allowed_damaged-recording"] == 1


def test_an_empty_recording_is_a_violation_unless_allowed(tmp_path):
    rec = Recording.load(_recording(tmp_path / "e.kvrec", 0))
    checker = ContractChecker()
    assert feed(Applies(), rec, checker=checker).batches == 0
    (v,) = checker.finish()
    assert v.rule is Rule.EMPTY_RECORDING and "no batch delivered" in v.message
    assert checker.finish() == [v]  # reported once, however often finish() is called
    lenient = ContractChecker(allow_empty=True)
    lenient.feed_all(rec)
    assert lenient.finish() == []
    assert ContractChecker().finish() == []  # a checker fed no recording has nothing to complain of


def test_kv_feed_fails_a_test_run_on_a_truncated_or_empty_recording(pytester, tmp_path):
    torn = _recording(tmp_path / "torn.kvrec", 2, torn=b"\xa5\x5a\x00")
    empty = _recording(tmp_path / "empty.kvrec", 0)
    pytester.makepyfile(test_suite=textwrap.dedent(f"""
        import pytest

        class C:
            def apply(self, pod, batch): pass
            def reset_pod(self, pod): pass

        def test_torn(kv_feed, kv_recording):
            kv_feed(C(), kv_recording({str(torn)!r}))

        def test_empty(kv_feed, kv_recording):
            kv_feed(C(), kv_recording({str(empty)!r}))

        @pytest.mark.kv_contract(allow_damage=True, allow_empty=True)
        def test_allowed(kv_feed, kv_recording):
            kv_feed(C(), kv_recording({str(torn)!r}))
            kv_feed(C(), kv_recording({str(empty)!r}))

        def test_not_a_consumer(kv_feed, kv_recording):
            kv_feed(object(), kv_recording({str(torn)!r}))
    """))
    result = pytester.runpytest("-p", "consumers.contract_plugin")
    result.assert_outcomes(passed=1, failed=3)
    result.stdout.fnmatch_lines([
        "*[[]damaged-recording[]]*torn.kvrec is damaged (3 torn tail bytes)*",
        "*[[]empty-recording[]]*no batch delivered*",
        "*TypeError: object cannot be fed: it has no apply() and no reset_pod()*",
    ], consecutive=False)


def test_fastpath_status_names_a_source_checkout_that_shadows_the_installed_package(tmp_path, monkeypatch):
    import importlib.machinery
    import sys

    from consumers._accel import _why_missing

    src, inst = tmp_path / "checkout", tmp_path / "site-packages"
    (src / "consumers").mkdir(parents=True)
    (src / "consumers" / "_fastpath.c").write_text("/* source only */")
    (src / "setup.py").write_text("")
    monkeypatch.setattr(sys, "path", [str(src), str(inst)])
    why = _why_missing(src / "consumers")
    assert "not built in the source checkout" in why and "no C compiler" not in why.split(";")[0]
    (inst / "consumers").mkdir(parents=True)
    (inst / "consumers" / f"_fastpath{importlib.machinery.EXTENSION_SUFFIXES[0]}").write_bytes(b"")
    why = _why_missing(src / "consumers")
    assert why.startswith(f"not loaded: this process imports consumers from {src / 'consumers'}")
    assert f"shadows the installed package at {inst / 'consumers'}" in why
    monkeypatch.setattr(sys, "path", [str(src)])
    (src / "setup.py").unlink()
    assert _why_missing(tmp_path / "elsewhere" / "consumers").startswith("not built (no C compiler")
