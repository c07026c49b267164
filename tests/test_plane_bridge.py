"""The bridge and the JetStream source against a real nats-server (see plane_helpers)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from consumers import KVRouter
from kvevents import DeliveryKind, EventPublisherFactory, KVEventsConfig, ZmqEventPublisher, encode_batch
from kvevents.errors import DecodeError
from kvevents.transport.nats.bridge import Bridge, EngineSpec
from kvevents.transport.nats.wire import id_matches, pack, parse_headers, plane_headers, subject_for, token, unpack
from tests.plane_helpers import nats_server, read_all, stream_state, wait_for  # noqa: F401
from tests.pubsub_helpers import batch, ipc_pair

BATCH, RESET, GAP = DeliveryKind.BATCH, DeliveryKind.RESET, DeliveryKind.GAP


def _kinds(ds, pod=None):
    return [(d.kind.value, d.seq) for d in ds if pod is None or d.publisher == pod]


def test_subject_tokens_and_headers_are_checked() -> None:
    assert token("a.b c>*") == "a_b_c__"
    assert subject_for("kvevents", "meta/llama.3", "pod.1") == "kvevents.meta_llama_3.pod_1"
    h = plane_headers("gap", "p", "t", 2, 5, 1, missed=3)
    m = parse_headers(h)
    assert (m.kind, m.pod, m.rank, m.seq, m.run, m.missed, m.reason) == ("gap", "p", 2, 5, 1, 3, "lost")
    mid = h["Nats-Msg-Id"]
    assert mid.startswith("p:1:gap:5:") and id_matches(m, mid)  # + a nonce: the next id is unguessable
    assert plane_headers("gap", "p", "t", 2, 5, 1, missed=3)["Nats-Msg-Id"] != mid
    assert not id_matches(m, "p:1:gap:5") and not id_matches(m, mid.replace("gap:5", "gap:6"))
    for bad, what in (({**h, "Kv-Kind": "x"}, "Kv-Kind"), ({**h, "Kv-Seq": "-1"}, "Kv-Seq"),
                      ({k: v for k, v in h.items() if k != "Kv-Run"}, "Kv-Run"), (None, "no headers")):
        with pytest.raises(DecodeError, match=what):
            parse_headers(bad)


@pytest.mark.parametrize("pack", [1, 8])
def test_bridge_to_source_same_deliveries_and_same_index_as_direct(nats_server, pack) -> None:
    pub_ep, rep_ep = ipc_pair()
    with ZmqEventPublisher(endpoint=pub_ep, replay_endpoint=rep_ep, topic="kv@pod-a@m") as pub, \
            Bridge(nats_server.url, [EngineSpec("pod-a", pub_ep, rep_ep, "m")], pack=pack) as bridge:
        batches = [batch(i, 3) for i in range(300)]
        for b in batches:
            pub.publish(b)
        wait_for(lambda: bridge.stats["batches"] >= 300, "300 batches bridged", pump=lambda: bridge.poll(20))
        assert bridge.sender.flush(10)
    messages = stream_state(nats_server.url)[0]
    assert messages == 300 if pack == 1 else 300 // 8 <= messages < 300  # packed: fewer messages, same batches
    got, stats = read_all(nats_server.url)
    assert _kinds(got) == [("batch", i) for i in range(300)]
    assert [d.payload for d in got] == [encode_batch(b) for b in batches]
    assert stats["duplicates"] == stats["malformed"] == stats["stream_gaps"] == 0
    via_plane, direct = KVRouter(), KVRouter()
    for d in got:
        via_plane.handle(d)
    for b in batches:
        direct.apply("pod-a", b, model="m")
    assert via_plane.entries() == direct.entries() > 0
    assert via_plane.score(list(range(16))) == direct.score(list(range(16)))


def _bridge_cmd(url, pub_ep, rep_ep, status, pack=1):
    return [sys.executable, "-m", "kvevents.transport.nats.cli", "bridge", "--nats", url,
            "--engine", f"pod-a={pub_ep},{rep_ep},model=m", "--status-file", str(status), "--pack", str(pack)]


def _stored_batches(url: str) -> int:
    """Batches the stream holds (a packed message counts its batches): its last message's last seq + 1."""
    import asyncio

    import nats

    async def go():
        nc = await nats.connect(url)
        try:
            m = parse_headers((await nc.jetstream().get_last_msg("KVEVENTS", "kvevents.m.pod-a")).headers)
            return m.seq + m.count
        except Exception:
            return 0
        finally:
            await nc.close()
    return asyncio.run(go())


def test_packed_bodies_are_checked() -> None:
    body = pack([b"a", b"bcd", b""])
    assert unpack(body, 3) == [b"a", b"bcd", b""]
    with pytest.raises(DecodeError, match="holds 3 batches"):
        unpack(body, 4)
    with pytest.raises(DecodeError, match="truncated"):
        unpack(body[:-2] + b"\x00\x00\x00\x09", 3)
    with pytest.raises(DecodeError, match="Kv-Count"):
        parse_headers({**plane_headers("batch", "p", "t", 0, 1, 0), "Kv-Count": "0"})


def test_a_packed_message_stops_growing_below_the_servers_payload_limit() -> None:
    """Large batches pack fewer to a message: a body past nats-server's max_payload (1 MB) would
    be refused, and the connection with it."""
    from types import SimpleNamespace

    from kvevents.transport.nats.bridge import MAX_PACKED_BYTES, _Pod

    pod = _Pod(EngineSpec("p", "ipc:///x"), "kvevents.default.p")
    items = [(pod, "batch", s, bytes([s]) * 100_000, "t", 0, 0, "") for s in range(32)]
    msgs = Bridge._messages(SimpleNamespace(pack=32), items)
    sizes = [sum(map(len, body)) if isinstance(body, list) else len(body) for _, body, _ in msgs]
    assert len(msgs) > 1 and max(sizes) <= MAX_PACKED_BYTES
    got = [p for _, body, h in msgs for p in unpack(b"".join(body) if isinstance(body, list) else body,
                                                       int(h.get("Kv-Count", 1)))]
    assert got == [it[3] for it in items]  # every batch once, in order
    assert [int(h["Kv-Seq"]) for _, _, h in msgs] == [0] + [sum(int(h.get("Kv-Count", 1)) for _, _, h in msgs[:i])
                                                            for i in range(1, len(msgs))]



def test_a_packing_bridge_takes_what_is_already_waiting_up_to_pack_then_stops() -> None:
    """A round keeps polling without waiting while deliveries come, up to ``pack`` per engine:
    fuller messages, no wait for more; the batches go out once each, in order."""
    from types import SimpleNamespace

    from kvevents import DeliveryKind
    from kvevents.delivery import Delivery
    from kvevents.transport.nats.bridge import _Pod

    def drains(first, sizes):
        for n in sizes:
            yield [Delivery(DeliveryKind.BATCH, "p", "t", s, None, 0.0, payload=b"b%d" % s)
                   for s in range(first, first + n)]
            first += n
    waits = []
    ready = drains(0, [64, 64, 64, 10])

    def poll(timeout_ms):
        waits.append(timeout_ms)
        return next(ready, [])
    sent = []
    bridge = Bridge.__new__(Bridge)
    bridge.pack, bridge.max_held = 150, 10
    bridge.stats = dict.fromkeys(("batches", "resets", "gaps", "resume_skipped", "resumed_pods", "held_overflow"), 0)
    bridge.pods = {"p": _Pod(EngineSpec("p", "ipc:///x"), "kvevents.default.p")}
    bridge.sub = SimpleNamespace(poll=poll)
    bridge.sender = SimpleNamespace(put_many=sent.extend)
    assert bridge.poll(50) == 2  # 192 batches taken (three drains: 192 >= 150), packed 150 + 42
    assert waits == [50, 0, 0]
    assert [int(h.get("Kv-Count", 1)) for _, _, h in sent] == [150, 42]
    assert bridge.poll(50) == 1 and waits[3:] == [50, 0]  # the last 10, then nothing waiting: no more polls
    got = [p for _, body, h in sent for p in unpack(b"".join(body) if isinstance(body, list) else body,
                                                    int(h.get("Kv-Count", 1)))]
    assert got == [b"b%d" % s for s in range(202)] and bridge.stats["batches"] == 202

@pytest.mark.parametrize("pack", [1, 4])
def test_bridge_kill9_mid_stream_stream_holds_every_batch_once_in_order(nats_server, tmp_path, pack) -> None:
    pub_ep, rep_ep = ipc_pair()
    total = 1500
    status = tmp_path / "bridge.json"
    with ZmqEventPublisher(endpoint=pub_ep, replay_endpoint=rep_ep, topic="kv@pod-a@m") as pub:
        first = subprocess.Popen(_bridge_cmd(nats_server.url, pub_ep, rep_ep, status, pack))
        try:
            wait_for(status.exists, "the bridge's status file")
            for i in range(600):
                pub.publish(batch(i, 2))
            # killed while it is forwarding: some of the first 600 stored, the rest still to come
            wait_for(lambda: _stored_batches(nats_server.url) >= 200, "200 batches stored before the kill")
            os.kill(first.pid, signal.SIGKILL)
            first.wait()
            stored_at_kill = _stored_batches(nats_server.url)
            for i in range(600, total):  # the engine goes on while no bridge runs
                pub.publish(batch(i, 2))
            second = subprocess.Popen(_bridge_cmd(nats_server.url, pub_ep, rep_ep, status, pack))
            try:
                wait_for(lambda: _stored_batches(nats_server.url) >= total, f"{total} batches in the stream")
            finally:
                second.send_signal(signal.SIGTERM)
                assert second.wait(30) == 0
        finally:
            if first.poll() is None:
                first.kill()
    assert stored_at_kill < total  # the kill really was mid-stream
    count, _ = stream_state(nats_server.url)
    assert count == total if pack == 1 else count < total  # nothing twice (packed: fewer, fuller messages)
    got, stats = read_all(nats_server.url)
    assert _kinds(got) == [("batch", i) for i in range(total)]  # every batch, once, in order
    assert [d.payload for d in got] == [encode_batch(batch(i, 2)) for i in range(total)]
    assert stats["duplicates"] == 0  # no batch stored twice, packed or not


def test_engine_restart_through_the_plane_clears_the_pod(nats_server) -> None:
    pub_ep, rep_ep = ipc_pair()
    bridge = Bridge(nats_server.url, [EngineSpec("pod-a", pub_ep, rep_ep, "m")])
    try:
        with ZmqEventPublisher(endpoint=pub_ep, replay_endpoint=rep_ep, topic="kv@pod-a@m") as pub:
            n1 = [0]

            def first_run():  # published while the bridge runs, so it sees the seqs live (a restart is
                for _ in range(20):  # told by the live seq going back; late-join replay is not live)
                    pub.publish(batch(n1[0]))
                    n1[0] += 1
                bridge.poll(10)
            wait_for(lambda: bridge.sub.health()["pod-a"].received >= 1000, "1000 live batches", pump=first_run)
            wait_for(lambda: bridge.stats["batches"] >= n1[0], "the first run bridged", pump=lambda: bridge.poll(10))
            n1 = n1[0]
        with ZmqEventPublisher(endpoint=pub_ep, replay_endpoint=rep_ep, topic="kv@pod-a@m") as pub:
            second = []

            def engine_step():  # the restarted engine: seqs from 0 again, other blocks
                # (ZeroMQ can tell a restart only while the new seqs stay below the old run's last one)
                if len(second) < 900:
                    pub.publish(batch(1000 + len(second)))
                    second.append(len(second))
                bridge.poll(10)
            wait_for(lambda: bridge.stats["resets"] >= 1, "the restart seen", pump=engine_step)
            n2 = len(second)
            wait_for(lambda: bridge.stats["batches"] >= n1 + n2, "the rest of the second run", pump=lambda: bridge.poll(10))
        assert bridge.sender.flush(10)
    finally:
        bridge.close()
    got, _ = read_all(nats_server.url)
    kinds = _kinds(got)
    assert kinds[:n1] == [("batch", i) for i in range(n1)]
    assert kinds[n1][0] == "reset"
    assert kinds[n1 + 1:] == [("batch", i) for i in range(n2)]  # the new run's early seqs healed by replay
    router = KVRouter()
    for d in got:
        router.handle(d)
    direct = KVRouter()
    for i in range(n2):
        direct.apply("pod-a", batch(1000 + i), model="m")
    assert router.entries() == direct.entries()  # the first run's blocks are gone, as with direct ZeroMQ


def test_nats_server_restart_bridge_and_source_resume_without_loss(nats_server) -> None:
    from kvevents.transport.nats.source import JetStreamSource

    pub_ep, rep_ep = ipc_pair()
    got = []
    with ZmqEventPublisher(endpoint=pub_ep, replay_endpoint=rep_ep, topic="kv@pod-a@m") as pub, \
            Bridge(nats_server.url, [EngineSpec("pod-a", pub_ep, rep_ep, "m")]) as bridge, \
            JetStreamSource(nats_server.url, durable="live") as src:
        for i in range(200):
            pub.publish(batch(i))
        wait_for(lambda: len(got) >= 200, "the first 200 read", pump=lambda: (bridge.poll(10), got.extend(src.poll(10))))
        nats_server.restart()
        for i in range(200, 400):
            pub.publish(batch(i))
        wait_for(lambda: len([d for d in got if d.kind is BATCH]) >= 400, "all 400 read after the restart",
                 pump=lambda: (bridge.poll(10), got.extend(src.poll(10))))
        assert bridge.sender.flush(10)
    assert _kinds(got) == [("batch", i) for i in range(400)]
    assert stream_state(nats_server.url)[0] == 400


def test_nats_publisher_from_the_factory_and_its_restart(nats_server) -> None:
    cfg = KVEventsConfig(enable_kv_cache_events=True, publisher="nats", endpoint=nats_server.url, topic="kv@pod-n@m")
    pub = EventPublisherFactory.create(cfg)
    for i in range(50):
        pub.publish(batch(i))
    assert pub.shutdown(10).clean
    pub = EventPublisherFactory.create(cfg)  # the engine restarts
    for i in range(3):
        pub.publish(batch(100 + i))
    assert pub.shutdown(10).clean
    got, _ = read_all(nats_server.url)
    assert _kinds(got) == [("batch", i) for i in range(50)] + [("reset", 0)] + [("batch", i) for i in range(3)]
    assert {d.publisher for d in got} == {"kv@pod-n@m"}


def test_open_source_picks_the_jetstream_source_for_nats_urls(nats_server) -> None:
    from kvevents.errors import ConfigError
    from kvevents.source import EventSource, open_source
    from kvevents.transport.nats.source import JetStreamSource

    with open_source(nats_server.url, durable="via-registry") as src:
        assert isinstance(src, JetStreamSource) and isinstance(src, EventSource)
        assert src.poll(10) == []
    with pytest.raises(ConfigError, match="one nats:// URL"):
        open_source(nats_server.url, nats_server.url)
