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
