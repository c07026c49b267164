"""CLI verbs inspect / record / replay / convert-capture, and record + replay over ipc:// end to end."""

from __future__ import annotations

import json
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import zmq

from kvevents import BlockStored, KVEventBatch, encode_batch
from kvevents.cli_record import main
from kvevents.recorder import Recorder, replay_recording
from kvevents.recording import RecordingWriter, convert_capture, read_recording
from kvevents.recordstream import iter_deliveries

CAPTURE = "vllm-0.33.0-live-pub-replay.jsonl"
END = [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
TOPIC = b"kv@pod-a@m"


@pytest.fixture
def ipc_dir():
    d = tempfile.mkdtemp(prefix="kvr", dir="/tmp")  # short: ipc paths are limited to ~107 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def capture_rec(conformance_dir, tmp_path):
    out = tmp_path / "cap.kvrec"
    convert_capture(conformance_dir / CAPTURE, out)
    return out


def _frames(seq: int) -> list[bytes]:
    ev = BlockStored([seq], seq - 1 if seq else None, [seq] * 4, 4, None, "GPU", None)
    return [TOPIC, seq.to_bytes(8, "big"), encode_batch(KVEventBatch(float(seq), [ev]))]


def _wait(cond, timeout=20.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.005)
    pytest.fail(f"timed out waiting for {what}")


# ---- inspect / convert-capture -----------------------------------------------------------------


def test_convert_capture_then_inspect_text_and_json(conformance_dir, tmp_path, capsys):
    out = tmp_path / "cap.kvrec"
    assert main(["convert-capture", str(conformance_dir / CAPTURE), "-o", str(out)]) == 0
    assert "wrote 41 messages" in capsys.readouterr().err

    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "messages    41 (pub 30, replay 11)" in text
    assert "truncated tail 0 bytes, bad records 0" in text
    lines = text.splitlines()
    row = next(line for line in lines if line.startswith(f"capture:{CAPTURE}"))
    assert row.split() == [f"capture:{CAPTURE}", "kv@pod-a@demo-model", "30", "10", "0..29", "0", "30", "0", "0", "0", "0"]
    events = {tuple(line.split()[:2]): line.split()[2:] for line in lines if line.startswith("Block")}
    assert events == {("BlockStored", "GPU"): ["30", "120"], ("BlockStored", "CPU"): ["6", "12"],
                      ("BlockRemoved", "GPU"): ["6", "12"]}

    assert main(["inspect", str(out), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["messages"] == {"pub": 30, "replay": 11}
    assert s["file"]["truncated_bytes"] == 0 and s["file"]["version"] == 1
    (p,) = s["publishers"].values()
    assert (p["first_seq"], p["last_seq"], p["live_gaps"], p["batches"], p["replay_ends"]) == (0, 29, [], 30, 1)
    assert s["time"]["span_s"] >= 0 and s["time"]["first"] <= s["time"]["last"]


def test_inspect_reports_gaps_resets_and_a_torn_tail(tmp_path, capsys):
    path = tmp_path / "g.kvrec"
    with RecordingWriter(path) as w:
        for seq in [0, 1, 2, 6, 7, 0, 1]:  # 3..5 lost live, then a restart (seq back to 0)
            w.write(_frames(seq), "A", float(seq))
        w.write([b"", *_frames(3)], "A", 9.0, socket="replay")
    with open(path, "ab") as f:
        f.write(b"\xa5\x5a\x00\x00")
    assert main(["inspect", str(path), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    p = s["publishers"]["A"]
    assert p["live_gaps"] == [[3, 5]] and p["resets"] == 1 and p["replay_messages"] == 1
    assert p["unrecovered"] == 3 and p["batches"] == 7 and p["last_seq"] == 1
    assert s["file"]["truncated_bytes"] == 4
    assert main(["inspect", str(path)]) == 0
    text = capsys.readouterr().out
    assert "live gaps (first..last missing seq):" in text and "A: 3..5" in text
    assert "truncated tail 4 bytes" in text


@pytest.mark.parametrize("argv", [
    ["inspect", "{bad}"],
    ["inspect", "{missing}"],
    ["record", "foo://nowhere", "-o", "{out}"],
    ["record", "tcp://no-such-host.invalid:5557", "-o", "{out}"],
    ["record", "tcp://127.0.0.1:99999", "-o", "{out}"],
    ["record", "ipc:///tmp/a", "ipc:///tmp/b", "--replay", "ipc:///tmp/c", "-o", "{out}"],
    ["record", "ipc:///tmp/a", "-o", "{nodir}"],
    ["replay", "{rec}", "--to", "nonsense"],
    ["replay", "{rec}", "--to", "ipc:///tmp/x", "--to", "ipc:///tmp/y"],
    ["replay", "{rec}", "--to", "ipc:///tmp/x", "--speed", "-1"],
    ["replay", "{rec}", "--to", "ipc:///tmp/x", "--publisher", "nobody"],
    ["replay", "{bad}", "--to", "ipc:///tmp/x"],
    ["convert-capture", "{bad}", "-o", "{out}"],
])
def test_bad_input_is_one_line_and_exit_code_2(argv, tmp_path, capture_rec, capsys):
    bad = tmp_path / "bad.kvrec"
    bad.write_text("not a recording\n")
    names = {"bad": bad, "missing": tmp_path / "missing.kvrec", "out": tmp_path / "out.kvrec",
             "nodir": tmp_path / "no" / "out.kvrec", "rec": capture_rec}
    assert main([a.format(**names) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kvevents {argv[0]}: error: ") and "\n" not in err and "Traceback" not in err


def test_a_bad_file_exits_2_without_traceback_in_a_real_process(tmp_path):
    bad = tmp_path / "bad.kvrec"
    bad.write_bytes(b"\x89PNG....")
    proc = subprocess.run([sys.executable, "-m", "kvevents.cli_record", "inspect", str(bad)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "not a kvevents recording" in proc.stderr


# ---- record ----------------------------------------------------------------------------------


def test_recorder_keeps_every_frame_and_heals_a_gap_by_replay(tmp_path, ipc_dir):
    ctx = zmq.Context.instance()
    pub_ep, rep_ep = f"ipc://{ipc_dir}/pub", f"ipc://{ipc_dir}/rep"
    xpub = ctx.socket(zmq.XPUB)  # XPUB: we see the recorder's subscription arrive
    router = ctx.socket(zmq.ROUTER)
    xpub.bind(pub_ep)
    router.bind(rep_ep)
    path = tmp_path / "live.kvrec"
    stop = threading.Event()
    writer = RecordingWriter(path)
    recorder = Recorder(writer, [pub_ep], replay_endpoints=[rep_ep], topic="kv@")
    thread = threading.Thread(target=recorder.run, args=(stop,), kwargs={"progress": lambda r: None})
    thread.start()
    try:
        assert xpub.poll(20_000), "no subscription"
        assert xpub.recv() == b"\x01kv@"
        frames = {s: _frames(s) for s in range(20)}
        live = [s for s in range(20) if s not in (10, 11, 12)]
        for s in live:
            xpub.send_multipart(frames[s])
        xpub.send_multipart([b"other-topic", (0).to_bytes(8, "big"), b"x"])  # filtered by the subscription
        assert router.poll(20_000), "no replay request"
        ident, empty, start = router.recv_multipart()
        assert (empty, int.from_bytes(start, "big")) == (b"", 10)
        for s in range(10, 20):
            router.send_multipart([ident, b"", *frames[s]])
        router.send_multipart([ident, *END])
        src = recorder.sources[pub_ep]
        _wait(lambda: src.replay == 11 and src.pub == len(live), what="the recorder to take everything")
        assert (src.gaps, src.replay_requests, src.last_seq, src.malformed) == (1, 1, 19, 0)
    finally:
        stop.set()
        thread.join(10)
        recorder.close()
        writer.close()
        xpub.close(0)
        router.close(0)
    records, reader = read_recording(path)
    assert reader.truncated_bytes == 0
    assert [r.frames for r in records if r.socket == "pub"] == [frames[s] for s in live]
    assert [r.frames for r in records if r.socket == "replay"] == [[b"", *frames[s]] for s in range(10, 20)] + [END]
    assert {r.publisher for r in records} == {pub_ep}
    ts = [r.recv_ts for r in records]
    assert ts == sorted(ts) and abs(ts[0] - time.time()) < 600
    ds = list(iter_deliveries(records))
    assert [(d.kind.value, d.seq) for d in ds] == [("batch", s) for s in range(20)]


def test_record_stops_on_sigterm_and_leaves_a_readable_file(tmp_path, ipc_dir):
    out = tmp_path / "idle.kvrec"
    proc = subprocess.Popen([sys.executable, "-m", "kvevents.cli_record", "record", f"ipc://{ipc_dir}/none",
                             "-o", str(out)], stderr=subprocess.PIPE, text=True)
    try:
        _wait(lambda: out.exists() and out.stat().st_size > 0, 60, "the recording header")
        # progress comes once a second: wait for one line, then stop it
        line = proc.stderr.readline()
        assert line.startswith("recording ") and f"ipc://{ipc_dir}/none seq -" in line
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert "wrote 0 messages" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
    records, reader = read_recording(out)
    assert records == [] and reader.meta["endpoints"] == [f"ipc://{ipc_dir}/none"]


# ---- replay ------------------------------------------------------------------------------------


def test_replay_publishes_with_the_recorded_seqs_and_answers_replay_requests(capture_rec, ipc_dir):
    ctx = zmq.Context.instance()
    pub_ep, rep_ep = f"ipc://{ipc_dir}/pub", f"ipc://{ipc_dir}/rep"
    original = {r.seq: r.frames for r in read_recording(capture_rec)[0] if r.socket == "pub"}
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub_ep)
    published, stop, result = threading.Event(), threading.Event(), []
    name = f"capture:{CAPTURE}"
    thread = threading.Thread(target=lambda: result.append(replay_recording(
        capture_rec, {name: (pub_ep, rep_ep)}, speed=0, stop=stop, linger=60,
        on_published=lambda report: published.set())))
    thread.start()
    dealer = ctx.socket(zmq.DEALER)
    try:
        assert published.wait(30)
        dealer.connect(rep_ep)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        answers = []
        while not answers or answers[-1] != END:
            assert dealer.poll(20_000), "replay answer did not end"
            answers.append(dealer.recv_multipart())
        assert answers[:-1] == [[b"", *original[s]] for s in range(30)]
        live = []
        while sub.poll(0):
            live.append(sub.recv_multipart())
        seqs = [int.from_bytes(f[1], "big") for f in live]
        assert seqs == sorted(seqs) and all(f == original[s] for s, f in zip(seqs, live))
    finally:
        stop.set()
        thread.join(20)
        sub.close(0)
        dealer.close(0)
    (report,) = result
    assert report.published == {name: 30} and report.unsent == 0 and report.gaps == 0


def test_replay_keeps_the_recorded_spacing_scaled_by_speed(tmp_path, ipc_dir):
    path = tmp_path / "slow.kvrec"
    with RecordingWriter(path) as w:
        for i, t in enumerate((100.0, 100.15, 100.3)):
            w.write(_frames(i), "A", t)
    for speed, at_least in ((1.0, 0.3), (2.0, 0.15)):
        stamps = []
        replay_recording(path, {"A": (f"ipc://{ipc_dir}/p{speed}", None)}, speed=speed,
                         on_publish=lambda name, seq: stamps.append(time.monotonic()))
        assert len(stamps) == 3 and stamps[-1] - stamps[0] >= at_least - 0.005


class _Lines(threading.Thread):
    def __init__(self, stream):
        super().__init__(daemon=True)
        self.stream, self.lines = stream, queue.Queue()
        self.start()

    def run(self):
        for line in self.stream:
            self.lines.put(line)

    def wait_for(self, text, timeout=60.0):
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"no line with {text!r}")
            if text in line:
                return line


def test_cli_replay_then_record_round_trip_over_ipc(capture_rec, tmp_path, ipc_dir, capsys):
    pub_ep, rep_ep = f"ipc://{ipc_dir}/pub", f"ipc://{ipc_dir}/rep"
    out = tmp_path / "again.kvrec"
    cli = [sys.executable, "-m", "kvevents.cli_record"]
    replayer = subprocess.Popen(cli + ["replay", str(capture_rec), "--to", pub_ep, "--replay-endpoint", rep_ep,
                                       "--speed", "0", "--start-delay", "0", "--linger", "120"],
                                stderr=subprocess.PIPE, text=True)
    recorder = None
    lines = _Lines(replayer.stderr)
    try:
        lines.wait_for("published 30 batches")
        recorder = subprocess.Popen(cli + ["record", pub_ep, "--replay", rep_ep, "--backfill", "-q", "-o", str(out)])

        def healed() -> int:
            if not out.exists():  # the header appears atomically (written, then renamed into place)
                return 0
            records, _ = read_recording(out)
            return sum(d.kind.value == "batch" for d in iter_deliveries(records, late_join=True))

        _wait(lambda: healed() == 30, 60, "30 batches in the new recording")
        recorder.send_signal(signal.SIGTERM)
        replayer.send_signal(signal.SIGTERM)
        assert recorder.wait(30) == 0 and replayer.wait(30) == 0
    finally:
        for p in (recorder, replayer):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        lines.join(10)
        replayer.stderr.close()
    original = {r.seq: r.frames for r in read_recording(capture_rec)[0] if r.socket == "pub"}
    records, reader = read_recording(out)
    assert reader.meta["backfill"] is True and reader.truncated_bytes == 0
    replayed = [r.frames for r in records if r.socket == "replay" and not r.is_end_marker]
    assert replayed[:30] == [[b"", *original[s]] for s in range(30)]
    assert all(r.frames == original[r.seq] for r in records if r.socket == "pub")
    assert main(["inspect", str(out), "--json"]) == 0
    (p,) = json.loads(capsys.readouterr().out)["publishers"].values()
    assert p["publisher"] == pub_ep and p["batches"] == 30 and p["unrecovered"] == 0
