"""``kvevents demo``: the simulated cluster runs, heals its injected gaps, accounts for every
batch, records a readable stream, and the KV-aware router beats round-robin on hit tokens."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvdemo.run import DemoOptions, execute
from kvdemo.workload import Workload, WorkloadConfig
from kvevents.recording import RecordingReader
from kvevents.recordstream import summarize

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    rec = tmp_path_factory.mktemp("demo") / "demo.kvrec"
    out = io.StringIO()
    code, run = execute(DemoOptions(duration=3.0, engines=2, record=str(rec), drop_rate=0.02, seed=1), out)
    return code, run, out.getvalue(), rec


def test_short_run_exits_0_and_prints_progress_and_summary(short_run):
    code, run, text, rec = short_run
    assert code == 0, text
    assert "t= 1.0s" in text and "events" in text and "healed" in text  # live progress
    assert "summary (stopped by duration" in text
    assert f"recording: {rec}" in text
    assert "SILENTLY LOST 0" in text and text.rstrip().endswith("result: OK")
    assert run.workload.requests > 0 and sum(n.engine.requests_finished for n in run.nodes) > 0


def test_nothing_lost_silently_and_gaps_were_healed(short_run):
    _code, run, _text, _rec = short_run
    for n in run.nodes:
        st = run.streams[n.name]
        assert n.published() > 0
        assert st.batches + st.lost == n.published(), n.name  # every numbered batch accounted for
        assert n.publisher.stats()["overflow"] == 0
    assert run.silently_lost() == 0
    injected = sum(n.publisher.stats()["live_dropped"] for n in run.nodes)
    healed = run.sub.stats()["recovered"]
    if injected:
        assert healed > 0  # the injected loss really was healed by replay
    assert sum(t.lost for t in run.streams.values()) == 0  # replay covered every drop
    # the router applied every batch the subscriber delivered
    assert run.router.stats.batches == sum(t.batches for t in run.streams.values())
    assert not run.router.stats.errors


def test_router_beats_or_equals_round_robin_on_hit_tokens(short_run):
    _code, run, _text, _rec = short_run
    r, rr = run.routed, run.shadow_rr
    assert r.requests == rr.requests > 0 and r.prompt_tokens == rr.prompt_tokens
    assert r.total >= rr.total  # by the router's own index, at pick time
    routed = sum(n.engine.gpu_hit_tokens + n.engine.offload_hit_tokens for n in run.nodes)
    baseline = sum(n.engine.gpu_hit_tokens + n.engine.offload_hit_tokens for n in run.baseline)
    assert routed >= baseline > 0  # measured by the engines of the two clusters
    assert sum(n.engine.load_verify_failures for n in run.nodes + run.baseline) == 0


def test_recording_is_readable_and_holds_every_batch(short_run):
    _code, run, _text, rec = short_run
    with RecordingReader(rec) as reader:
        records = list(reader)
        assert reader.truncated_bytes == 0 and reader.bad_records == 0
    assert records and reader.meta["source"] == "kvevents demo"
    s = summarize(rec)
    by_ep = {n.endpoint: n for n in run.nodes}
    assert set(s["publishers"]) == set(by_ep)
    for ep, p in s["publishers"].items():
        assert p["batches"] == by_ep[ep].published() and p["unrecovered"] == 0
    media = {e["medium"] for e in s["events"]}
    assert {"GPU", "CPU"} <= media  # GPU events and offload events both travelled


def test_sigterm_stops_cleanly_with_the_summary(tmp_path):
    rec = tmp_path / "long.kvrec"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "kvevents.cli", "demo", "--duration", "120", "--engines", "2",
                             "--no-baseline", "--record", str(rec)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 30
        lines = []
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("t="):  # running: the first progress line
                break
        assert any(x.startswith("t=") for x in lines), "".join(lines) + proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        rest, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(lines) + rest
    assert proc.returncode == 0, text + err
    assert "summary (stopped by SIGTERM" in text and "SILENTLY LOST 0" in text
    assert f"recording: {rec}" in text and rec.stat().st_size > 0
    assert "Traceback" not in err


@pytest.mark.parametrize("args, message", [
    (["--engines", "0"], "positive integer"),
    (["--duration", "-1"], "positive number of seconds"),
    (["--prometheus-port", "70000"], "TCP port"),
])
def test_bad_flags_are_one_line_errors(args, message):
    proc = subprocess.run([sys.executable, "-m", "kvevents.cli", "demo", *args], capture_output=True, text=True,
                          cwd=ROOT, timeout=30)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_workload_shares_prefixes_and_extends_conversations():
    w = Workload(WorkloadConfig(seed=3))
    reqs = [w.next_request() for _ in range(300)]
    assert w.follow_ups > 0 and w.new_conversations > 0
    by_conv = {}
    for r in reqs:
        prev = by_conv.get(r.conversation)
        if prev is not None:  # a follow-up extends the conversation's previous prompt
            assert r.turn == prev.turn + 1 and r.tokens[: len(prev.tokens)] == prev.tokens
            assert len(r.tokens) > len(prev.tokens)
        by_conv[r.conversation] = r
    docs = [r.document for r in reqs if r.turn == 1]
    assert max(docs.count(d) for d in set(docs)) > 3  # Zipf: a hot document is shared
    again = Workload(WorkloadConfig(seed=3))
    assert [again.next_request().tokens for _ in range(20)] == [r.tokens for r in reqs[:20]]  # deterministic
