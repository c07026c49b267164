"""The contract kit's pytest plugin, run inside pytester: fixtures, the marker, failing a test with every violation."""

from __future__ import annotations

import sys
import textwrap

pytest_plugins = ["pytester"]

PLUGIN = ("-p", "consumers.contract_plugin")

HELPERS = """
from kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

def gpu(h):
    return BlockStored(list(h), None, [0] * 4 * len(h), 4, None, "GPU", None)

def rm(h, medium="GPU"):
    return BlockRemoved(list(h), medium)

def b(*ev):
    return KVEventBatch(1.0, list(ev))
"""


def _suite(pytester, body: str) -> None:
    pytester.makepyfile(helpers=HELPERS, test_suite=textwrap.dedent(body))


def test_kv_contract_fails_the_test_listing_every_violation(pytester):
    _suite(pytester, """
        import pytest
        from helpers import b, gpu, rm

        def test_good(kv_contract):
            kv_contract.feed("pod", 0, b(gpu([1])))
            kv_contract.feed("pod", 1, b(rm([1])))

        def test_bad(kv_contract):
            kv_contract.feed("pod", 0, b(gpu([1])))
            kv_contract.feed("pod", 1, b(rm([2])))
            kv_contract.feed("pod", 2, b(rm([3], medium="CPU")))

        def test_gap_left_open(kv_contract):
            kv_contract.feed("pod", 0, b())
            kv_contract.feed("pod", 5, b())

        @pytest.mark.kv_contract(allow_unknown_removals=True)
        def test_lenient(kv_contract):
            kv_contract.feed("pod", 0, b(rm([9])))

        def test_explicit_assert(kv_contract):
            kv_contract.feed("pod", 0, b(rm([9])))
            with pytest.raises(AssertionError, match="unknown-removal"):
                kv_contract.assert_ok()

        def test_own_failure_wins(kv_contract):
            kv_contract.feed("pod", 0, b(rm([9])))
            assert 1 == 2, "the test's own failure"

        @pytest.mark.kv_contract(no_such_option=True)
        def test_bad_option(kv_contract):
            pass
    """)
    result = pytester.runpytest(*PLUGIN)
    result.assert_outcomes(passed=3, failed=3, errors=1)
    out = result.stdout.str()
    result.stdout.fnmatch_lines([
        "*TypeError: @pytest.mark.kv_contract:*no_such_option*",
        "*_ test_bad _*",
        "kv_contract: 2 stream contract violation(s):",
        "*[[]unknown-removal[]] publisher 'pod' seq 1 event #0: removes GPU block(s) [[]2[]] never stored before*",
        "*[[]unknown-removal[]] publisher 'pod' seq 2 event #0: removes CPU block(s) [[]3[]]*",
        "*[[]seq-gap[]] publisher 'pod' seq 1: 4 batch(es) from seq 1 lost for good*",
        "*the test's own failure*",
    ])
    assert "_execution.py" not in out  # the violations are the whole report, no traceback
    assert "test_lenient" not in out.split("short test summary")[-1]


def test_kv_feed_and_kv_recording_with_a_consumer(pytester, monkeypatch, conformance_dir):
    capture = conformance_dir / "vllm-0.33.0-live-pub-replay.jsonl"
    _suite(pytester, f"""
        from kvevents.recording import convert_capture

        class Consumer:
            def __init__(self):
                self.applied, self.pods = 0, set()
            def apply(self, pod, batch):
                self.applied += 1
                self.pods.add(pod)
            def reset_pod(self, pod):
                raise AssertionError("no reset expected")

        def test_capture_converted_and_fed(kv_recording, kv_feed, tmp_path):
            out = tmp_path / "cap.kvrec"
            convert_capture({str(capture)!r}, out)
            for rec in (kv_recording(out), kv_recording({str(capture)!r})):
                assert len(rec) == 41
                consumer = Consumer()
                report = kv_feed(consumer, rec)
                assert consumer.applied == report.batches == 30 and consumer.pods == {{"pod-a"}}

        def test_vllm_capture_fixture(kv_vllm_capture, kv_contract):
            kv_contract.feed_all(kv_vllm_capture)
            assert kv_contract.stats["batches"] == 30
    """)
    monkeypatch.setenv("KVEVENTS_CAPTURE", str(capture))
    result = pytester.runpytest(*PLUGIN)
    result.assert_outcomes(passed=2)


def test_an_entry_point_named_like_the_module_coexists_with_pytest_plugins(pytester, monkeypatch):
    """What pyproject's pytest11 entry point will do: auto-load, and not clash with `pytest_plugins`.

    Also: kv_vllm_capture skips the test when the capture cannot be found.
    """
    dist = pytester.mkdir("site") / "kv_contract_probe-0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: kv-contract-probe\nVersion: 0\n")
    (dist / "entry_points.txt").write_text("[pytest11]\nconsumers.contract_plugin = consumers.contract_plugin\n")
    pytester.makepyfile(test_a="""
        def test_auto_loaded(kv_contract):
            from kvevents import KVEventBatch
            kv_contract.feed("p", 0, KVEventBatch(0.0, []))
    """, test_b="""
        pytest_plugins = ["consumers.contract_plugin"]

        def test_also_declared(kv_contract):
            pass
    """, test_c="""
        def test_needs_capture(kv_vllm_capture):
            pass
    """)
    monkeypatch.setenv("PYTHONPATH", str(pytester.path / "site") + ":" + ":".join(sys.path))
    monkeypatch.delenv("KVEVENTS_CAPTURE", raising=False)
    monkeypatch.setenv("KVEVENTS_SHARED", str(pytester.path / "nowhere"))
    result = pytester.runpytest_subprocess("-rs")
    result.assert_outcomes(passed=2, skipped=1)
    result.stdout.fnmatch_lines(["*vllm-0.33.0-live-pub-replay.jsonl not found*"])
