"""Issue 13's CLI rough edges: what a new user trips over with record / replay / inspect / tail / demo."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading

import pytest
import zmq

from kvevents import BlockStored, KVEventBatch, encode_batch
from kvevents.cli_record import EXIT_BROKEN_PIPE, main
from kvevents.recorder import replay_recording
from kvevents.recording import RecordingWriter

END = [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]


def _frames(seq: int, topic: bytes = b"kv@pod-a@m") -> list[bytes]:
    ev = BlockStored([seq], seq - 1 if seq else None, [seq] * 4, 4, None, "GPU", None)
    return [topic, seq.to_bytes(8, "big"), encode_batch(KVEventBatch(float(seq), [ev]))]


@pytest.fixture
def rec(tmp_path):
    path = tmp_path / "r.kvrec"
    with RecordingWriter(path) as w:
        for seq in range(5):
            w.write(_frames(seq), "A", 100.0 + seq / 100)
    return path


@pytest.fixture
def ipc(tmp_path_factory):
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="kvx", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_replay_topic_empty_string_publishes_under_the_empty_topic(rec, ipc):
    """vLLM's default topic is "": ``--topic ""`` must not fall back to the recorded topic."""
    pub_ep, rep_ep = f"ipc://{ipc}/pub", f"ipc://{ipc}/rep"
    published, stop = threading.Event(), threading.Event()
    t = threading.Thread(target=replay_recording, args=(rec, {"A": (pub_ep, rep_ep)}),
                         kwargs=dict(speed=0, topic="", stop=stop, linger=60,
                                     on_published=lambda r: published.set()))
    t.start()
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    try:
        assert published.wait(30)
        dealer.connect(rep_ep)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        answers = []
        while not answers or answers[-1] != END:
            assert dealer.poll(20_000)
            answers.append(dealer.recv_multipart())
    finally:
        stop.set()
        t.join(20)
        dealer.close(0)
    assert [a[1] for a in answers[:-1]] == [b""] * 5  # recorded topic was kv@pod-a@m


def test_replay_connecting_where_nobody_listens_says_so(rec, capsys):
    """replay --to tcp://127.0.0.1:P connects, and so does ``tail``: nothing would ever flow."""
    ep = f"tcp://127.0.0.1:{_free_port()}"
    assert main(["replay", str(rec), "--to", ep, "--start-delay", "0"]) == 2
    err = capsys.readouterr().err
    assert f"nothing listens on {ep}" in err and "--mode bind" in err


def test_replay_connecting_to_a_bound_peer_is_fine(rec, capsys):
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    port = sub.bind_to_random_port("tcp://127.0.0.1")
    try:
        assert main(["replay", str(rec), "--to", f"tcp://127.0.0.1:{port}", "--speed", "0",
                     "--start-delay", "0"]) == 0
        assert "done: 5 batches published" in capsys.readouterr().err
    finally:
        sub.close(0)


def test_replay_prints_progress_while_publishing(rec, ipc, capsys):
    assert main(["replay", str(rec), "--to", f"ipc://{ipc}/p", "--speed", "0", "--start-delay", "0",
                 "--progress-every", "0"]) == 0
    err = capsys.readouterr().err.splitlines()
    progress = [line for line in err if line.startswith("replaying: ")]
    assert progress[0] == "replaying: 1 batches published (last: A seq 0)"
    assert progress[-1] == "replaying: 5 batches published (last: A seq 4)"
    assert err.index(progress[-1]) < next(i for i, line in enumerate(err) if line.startswith("done:"))


def test_inspect_into_a_closed_pipe_is_quiet(rec):
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the first byte, as after `| head -1` has its line
    try:
        proc = subprocess.run([sys.executable, "-m", "kvevents.cli", "inspect", "--json", str(rec)],
                              stdout=w, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(w)
    assert proc.returncode == EXIT_BROKEN_PIPE
    assert proc.stderr == ""


@pytest.mark.parametrize("content,expected", [
    (b"\x00\xff\xfe binary", "is not a capture: byte 1 is not UTF-8 text"),
    (b'{"a": 1}\n', "line 1: not a capture line (no 'socket' key"),
    (b"hello\n", "line 1: not a capture line"),
    (b"\x89KVREC\r\n....", "is already a kvevents recording"),
])
def test_convert_capture_names_the_file_and_the_expected_format(tmp_path, capsys, content, expected):
    bad = tmp_path / "in.data"
    bad.write_bytes(content)
    assert main(["convert-capture", str(bad), "-o", str(tmp_path / "o.kvrec")]) == 2
    err = capsys.readouterr().err.strip()
    assert str(bad) in err and expected in err and "JSON Lines" in err and "\n" not in err


def test_record_with_a_dead_replay_endpoint_exits_3_as_tail_does(tmp_path, ipc, capsys):
    out = tmp_path / "r.kvrec"
    rc = main(["record", f"ipc://{ipc}/pub", "--replay", f"ipc://{ipc}/nobody", "--probe-timeout", "0.2",
               "--duration", "1", "-o", str(out)])
    assert rc == 3
    err = capsys.readouterr().err
    assert f"replay endpoint ipc://{ipc}/nobody did not answer within 0.2s" in err
    assert not out.exists()  # nothing written: no misleading 'wrote 0 messages'


def test_demo_interrupted_by_sigint_exits_130_with_the_summary(tmp_path):
    import signal
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "kvevents.cli", "demo", "--duration", "120", "--engines", "1",
                             "--no-baseline", "--record", str(tmp_path / "d.kvrec")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=root)
    lines = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("t="):  # running: the first progress line
                break
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(lines) + rest
    assert proc.returncode == 130, text + err
    assert "summary (stopped by SIGINT" in text and "Traceback" not in err


def test_a_publisher_never_heard_is_connecting_not_synced(capsys):
    from kvevents import HealthState
    from kvevents.cli import main as cli_main
    from kvevents.tracker import SeqTracker

    t = SeqTracker("p", now=0.0)
    assert t.state(0.1, 10) is HealthState.CONNECTING
    assert t.state(100.0, 10) is HealthState.CONNECTING  # never heard: not STALE either
    t.on_live(0, KVEventBatch(1.0, []), 0.2)
    assert t.state(0.3, 10) is HealthState.SYNCED
    t2 = SeqTracker("q", can_replay=True, late_join=True, now=0.0)
    t2.on_replay_end(0.1)  # an empty ring answered: heard
    assert t2.state(0.2, 10) is HealthState.SYNCED
    ep = f"tcp://127.0.0.1:{_free_port()}"  # nobody there
    assert cli_main(["tail", ep, "--duration", "0.3", "--health-every", "0.1"]) == 0
    health = [line for line in capsys.readouterr().out.splitlines() if line.startswith("# health")]
    assert health and all(f"{ep} CONNECTING" in line for line in health)
