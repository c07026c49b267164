"""Our publisher behind vLLM's interface puts vLLM's own bytes on the wire (vLLM 0.32 and 0.33).

vLLM's ``ZmqEventPublisher`` and our ``KVEventsPublisher`` are given the same batches of vLLM's
event structs (the newer fields ``extra_keys``, ``group_idx``, ``kv_cache_spec_kind`` set); each
one's replay socket is asked for everything from seq 0 and the answers must be the same frames,
byte for byte. Our subscriber then follows our publisher live (late join by replay) and decodes
every batch. No engine: these run in any venv where ``vllm.distributed.kv_events`` imports.
"""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq
from vllm.distributed import kv_events as V

from kvevents import DeliveryKind
from kvevents.subscriber import PublisherSpec, Subscriber
from kvevents_vllm.publisher import KVEventsPublisher, register_publisher

from .engine import free_port

END = (-1).to_bytes(8, "big", signed=True)


@pytest.fixture(scope="module", autouse=True)
def registered():
    register_publisher()


def vllm_batches() -> list:
    """Fresh vLLM batches (a publisher sets data_parallel_rank on what it is given)."""
    stored = V.BlockStored(block_hashes=[11, 12], parent_block_hash=None, token_ids=list(range(8)),
                           block_size=4, lora_id=None, medium="GPU", lora_name=None,
                           extra_keys=[None, ("salt-1",)], group_idx=0, kv_cache_spec_kind="full_attention")
    child = V.BlockStored(block_hashes=[13], parent_block_hash=12, token_ids=[8, 9, 10, 11], block_size=4,
                          lora_id=None, medium="GPU", lora_name=None)
    return [
        V.KVEventBatch(ts=1000.0, events=[stored]),
        V.KVEventBatch(ts=1000.5, events=[child, V.BlockRemoved(block_hashes=[11], medium="GPU", group_idx=0)]),
        V.KVEventBatch(ts=1001.0, events=[V.AllBlocksCleared()]),
    ]


def replay_all(endpoint: str, timeout: float = 10.0) -> list[list[bytes]]:
    """Ask a replay socket for every batch from seq 0: the answer's frames up to the end marker."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart((b"", (0).to_bytes(8, "big")))
        out, deadline = [], time.monotonic() + timeout
        while True:
            assert sock.poll(max(1, int((deadline - time.monotonic()) * 1000))), "replay did not answer"
            frames = sock.recv_multipart()
            if frames[2] == END:
                return out
            out.append(frames)
    finally:
        sock.close(0)


def _replays_until(endpoint: str, n: int) -> list[list[bytes]]:
    """Replay answers, asked again until the publisher's thread has buffered ``n`` batches."""
    deadline = time.monotonic() + 10
    while True:
        got = replay_all(endpoint)
        if len(got) >= n or time.monotonic() > deadline:
            return got
        time.sleep(0.02)


def test_same_frames_as_vllms_own_publisher() -> None:
    ours_ep, ours_rep, theirs_ep, theirs_rep = (f"tcp://127.0.0.1:{free_port()}" for _ in range(4))
    ours = KVEventsPublisher(data_parallel_rank=0, endpoint=ours_ep, replay_endpoint=ours_rep, topic="kv")
    # vLLM's publisher binds only wildcard endpoints: its PUB connects to this one, its replay binds
    theirs = V.ZmqEventPublisher(data_parallel_rank=0, endpoint=theirs_ep, replay_endpoint=theirs_rep, topic="kv")
    try:
        for pub in (ours, theirs):
            for b in vllm_batches():
                pub.publish(b)
        got_ours, got_theirs = _replays_until(ours_rep, 3), _replays_until(theirs_rep, 3)
        assert len(got_ours) == 3
        assert [f[1:] for f in got_ours] == [f[1:] for f in got_theirs]  # [topic, seq, payload]
        assert [int.from_bytes(f[2], "big") for f in got_ours] == [0, 1, 2]
    finally:
        ours.shutdown()
        theirs.shutdown()


def test_our_subscriber_follows_it_live_and_by_replay() -> None:
    ep, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    pub = KVEventsPublisher(data_parallel_rank=0, endpoint=ep.replace("127.0.0.1", "*"), replay_endpoint=rep)
    first, *rest = vllm_batches()
    pub.publish(first)  # before anyone listens: the subscriber's late join replays it
    sub = Subscriber([PublisherSpec(ep, rep, "pod")], late_join=True)
    try:
        seen, deadline = [], time.monotonic() + 20
        published = False
        while len(got := [d for d in seen if d.kind is DeliveryKind.BATCH]) < 3 and time.monotonic() < deadline:
            seen += sub.poll(100)
            if got and not published:
                for b in rest:
                    pub.publish(b)
                published = True
        assert [d.seq for d in got] == [0, 1, 2]
        stored = got[0].batch.events[0]
        assert (stored.block_hashes, stored.token_ids, stored.block_size) == ([11, 12], list(range(8)), 4)
        assert [type(e).__name__ for e in got[1].batch.events] == ["BlockStored", "BlockRemoved"]
        assert type(got[2].batch.events[0]).__name__ == "AllBlocksCleared"
        assert all(d.batch.data_parallel_rank == 0 for d in got)
        # live and late-join replay may race (a gap the replay heals); nothing is lost or reset
        assert [d.kind for d in seen] == [DeliveryKind.BATCH] * 3
    finally:
        sub.close()
        pub.shutdown()


def test_data_parallel_rank_offsets_ports_and_stamps_batches() -> None:
    base, rbase = free_port(), free_port()
    pub = KVEventsPublisher(data_parallel_rank=1, endpoint=f"tcp://*:{base}", replay_endpoint=f"tcp://*:{rbase}")
    try:
        cfg = pub.get_publisher_config()
        assert (cfg.endpoint, cfg.replay_endpoint) == (f"tcp://*:{base + 1}", f"tcp://*:{rbase + 1}")
        b = vllm_batches()[0]
        pub.publish(b)
        assert b.data_parallel_rank == 1
        (frames,) = _replays_until(f"tcp://127.0.0.1:{rbase + 1}", 1)
        assert frames[3] == msgspec.msgpack.encode(b)  # vLLM's encoding, rank included
    finally:
        pub.shutdown()


def test_publish_after_shutdown_raises() -> None:
    pub = KVEventsPublisher(data_parallel_rank=0, endpoint=f"tcp://127.0.0.1:{free_port()}")
    pub.shutdown()
    with pytest.raises(RuntimeError):
        pub.publish(vllm_batches()[0])


def test_loss_counters_that_grow_are_logged_by_name(caplog) -> None:
    import logging

    pub = KVEventsPublisher(data_parallel_rank=0, endpoint=f"tcp://127.0.0.1:{free_port()}")
    log = logging.getLogger("vllm.kvevents_vllm.publisher")
    log.addHandler(caplog.handler)  # vLLM's "vllm" logger does not propagate to the root
    try:
        assert pub.check_counters() == {}
        pub._pub._stats.overflow += 3  # as the live path would count a full queue
        pub._pub._stats.overflow_lost += 1
        assert pub.check_counters() == {"overflow": 3, "overflow_lost": 1}
        assert pub.check_counters() == {}  # logged once per growth
        lines = [r.getMessage() for r in caplog.records if r.name == log.name]
        assert any("overflow +3, overflow_lost +1" in m for m in lines)
    finally:
        log.removeHandler(caplog.handler)
        pub.shutdown()
