"""The event-source role: one protocol, implementations picked by URL scheme, the same deliveries."""

from __future__ import annotations

import pytest

import kvevents
from kvevents import ConfigError, DeliveryKind, EventSource, KVEventBatch, Subscriber, ZmqEventPublisher, open_source
from kvevents.delivery import Delivery, PublisherHealth
from kvevents.recording import RecordingWriter
from kvevents.recordstream import RecordingSource
from kvevents.source import SOURCES, source_scheme

from .pubsub_helpers import batch, collect, ipc_pair, wait_connected

TOPIC = b"kv@pod-a@m"


class ListSource(EventSource):
    """A source out of the tree: registered by module path and class name, found by name."""

    def __init__(self, items):
        self.items, self.closed = list(items), False

    @classmethod
    def from_urls(cls, urls, **options):
        return cls([Delivery(DeliveryKind.BATCH, u, "", i, batch(i)) for i, u in enumerate(urls)])

    def poll(self, timeout_ms=100):
        out, self.items = self.items, []
        return out

    def health(self):
        return {}

    def close(self):
        self.closed = True

    @property
    def ended(self):
        return not self.items


def _record(path, n, *, skip=(), replayed=(), replay_after=None, publisher="tcp://10.0.0.1:5557"):
    """Live seqs 0..n-1 but ``skip``; after live seq ``replay_after``, the answer ``replayed`` + end marker."""
    with RecordingWriter(path) as w:
        for s in range(n):
            if s not in skip:
                w.write([TOPIC, s.to_bytes(8, "big"), kvevents.encode_batch(batch(s))], publisher, float(s))
            if s == replay_after:
                for r in replayed:
                    w.write([b"", TOPIC, r.to_bytes(8, "big"), kvevents.encode_batch(batch(r))], publisher, s + 0.5,
                            "replay")
                w.write([b"", b"", (-1).to_bytes(8, "big", signed=True), b""], publisher, s + 0.5, "replay")


def test_schemes_pick_the_implementation_and_bad_urls_say_what_is_wrong(tmp_path):
    assert [source_scheme(u) for u in ("tcp://127.0.0.1:1", "ipc:///x", "file:a.kvrec", "NATS://h:4222")] == \
        ["tcp", "ipc", "file", "nats"]
    for name in ("tcp", "ipc", "inproc", "zmq"):
        assert SOURCES.get(name) is Subscriber
    assert SOURCES.get("file") is RecordingSource is SOURCES.get("recording")
    ep, _ = ipc_pair()
    with open_source(ep, topic="kv@") as sub:
        assert isinstance(sub, Subscriber) and isinstance(sub, EventSource) and sub.topic == "kv@"
    with pytest.raises(ConfigError, match="names no scheme"):
        open_source("run.kvrec")
    with pytest.raises(ConfigError, match=r"unknown event source 'gopher'.*known schemes and names: .*tcp"):
        open_source("gopher://h")
    with pytest.raises(ConfigError, match="one kind of URL"):
        open_source(ep, "file:x.kvrec")
    with pytest.raises(ConfigError, match="at least one"):
        open_source()
    with pytest.raises(ConfigError, match="reads one file"):
        open_source("file:a", "file:b")


def test_a_source_registered_by_module_path_is_found_by_name():
    SOURCES.register("list-test", __name__, "ListSource")
    try:
        src = open_source("a:1", "a:2", kind="list-test")
        assert isinstance(src, ListSource)
        assert [(d.publisher, d.seq) for d in src] == [("a:1", 0), ("a:2", 1)]  # __iter__ ends when it ends
    finally:
        SOURCES.entries.pop("list-test")


def test_a_recording_source_delivers_the_healed_stream_and_its_health(tmp_path):
    path = tmp_path / "r.kvrec"
    _record(path, 12, skip=(4, 5, 9), replayed=(4, 5), replay_after=6)
    src = open_source(f"file:{path}", chunk=3)
    got = []
    while not src.ended:
        got += src.poll(0)
    assert src.poll(0) == [] and list(src) == []
    kinds = [(d.kind.value, d.seq) for d in got]
    assert kinds == [("batch", s) for s in range(9)] + [("gap", 9), ("batch", 10), ("batch", 11)]
    assert all(type(d.batch) is KVEventBatch and d.payload is None for d in got if d.kind is DeliveryKind.BATCH)
    assert [d.replayed for d in got if d.seq in (4, 5)] == [True, True]
    (name, h), = src.health().items()
    assert isinstance(h, PublisherHealth) and name == "tcp://10.0.0.1:5557"
    assert (h.received, h.gaps, h.recovered, h.unrecoverable, h.replay_requests) == (9, 2, 2, 1, 2)
    src.close()
    with pytest.raises(RuntimeError, match="closed"):
        src.poll(0)


def test_raw_deliveries_carry_the_payload_never_in_the_batch_field(tmp_path):
    path = tmp_path / "r.kvrec"
    _record(path, 3)
    got = list(RecordingSource(path, decode=False))
    assert [d.payload for d in got] == [kvevents.encode_batch(batch(s)) for s in range(3)]
    assert all(d.batch is None for d in got)


def test_a_router_runs_from_a_recording_source_until_it_ends(tmp_path):
    from consumers import KVRouter

    path = tmp_path / "r.kvrec"
    _record(path, 5)
    router = KVRouter(block_size=16, model="m")
    with open_source(f"file:{path}") as src:
        assert router.run(src) == 5  # ends by itself: no stop event needed
    assert router.pods() == ["pod-a"] and router.stats.batches == 5


def test_live_and_recorded_sources_deliver_the_same_stream(tmp_path):
    """What a Subscriber delivers from a live publisher equals what the recording of that wire delivers."""
    ep, rep = ipc_pair()
    pub = ZmqEventPublisher(ep, rep, topic=TOPIC.decode())
    path = tmp_path / "live.kvrec"
    try:
        sub = open_source(ep)
        writer = RecordingWriter(path)
        sub.tap = lambda name, socket, frames: writer.write(frames, name, 0.0, socket)
        start = wait_connected(pub, sub)
        for i in range(start, start + 5):
            pub.publish(batch(i))
        live = collect(sub, lambda g: sum(d.kind is DeliveryKind.BATCH for d in g) >= 5)
        sub.close()
        writer.close()
    finally:
        pub.shutdown()
    recorded = [d for d in RecordingSource(path) if d.seq >= start]
    assert [(d.kind, d.seq, d.batch) for d in live] == [(d.kind, d.seq, d.batch) for d in recorded]


def test_tail_reads_any_registered_source_and_ends_with_a_recording(tmp_path, capsys):
    from kvevents.cli import main

    path = tmp_path / "r.kvrec"
    _record(path, 3)
    assert main(["tail", f"file:{path}"]) == 0  # no --duration: it ends with the recording
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[1] for line in out if not line.startswith("#")] == ["seq=0", "seq=1", "seq=2"]
    assert "recv=3" in out[-1] and "SYNCED" in out[-1]
    assert main(["tail", f"file:{path}", "--replay", "ipc:///x"]) == 2
    assert "ZeroMQ endpoints" in capsys.readouterr().err
