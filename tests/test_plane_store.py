"""The replicas' shared state under concurrent use, against a real nats-server: the purge floor
must see every live replica's cover while the others re-put theirs (a floor computed without one
purges messages that replica has not read), and a snapshot read must finish — with one whole,
checked version — while its owner saves a newer one over it."""

from __future__ import annotations

import asyncio

import nats
import pytest

from kvservice.planestore import PlaneStore, SnapshotLoadError, open_envelope, stream_identity
from tests.plane_helpers import nats_server  # noqa: F401

IDENT = stream_identity("KVEVENTS", ["kvevents.>"], "created-in-a-test")  #: saved without a stream here


async def _load(store: PlaneStore, name: str) -> bytes:
    """The router part of a saved snapshot, read whole and checked (no stream to check seqs against)."""
    data, _ = await store.read(name)
    return open_envelope(data, IDENT, 1 << 62)[0]


def _run(url: str, body):
    async def go():
        nc = await nats.connect(url)
        try:
            store = PlaneStore(nc.jetstream(), storage="memory", ttl=5.0)
            await store.open()
            return await asyncio.wait_for(body(store, nc.jetstream()), 60)
        finally:
            await nc.close()
    return asyncio.run(go())


def test_covers_lists_every_live_replica_while_they_heartbeat(nats_server) -> None:
    names = ("a", "b", "c")

    async def body(store: PlaneStore, js):
        for n in names:
            await store.cover(n, 10)
        stop = asyncio.Event()

        async def beat(n):  # a replica re-putting its cover as fast as it can
            i = 10
            while not stop.is_set():
                i += 1
                await store.cover(n, i)
                await asyncio.sleep(0)
        beats = [asyncio.create_task(beat(n)) for n in names]
        seen = []
        try:
            for _ in range(300):
                seen.append(await store.covers())
        finally:
            stop.set()
            await asyncio.gather(*beats)
        return seen
    seen = _run(nats_server.url, body)
    short = [c for c in seen if sorted(c) != sorted(names)]
    assert not short, f"{len(short)} of {len(seen)} reads left a live cover out, e.g. {short[0]}"
    assert all(v >= 10 for c in seen for v in c.values())


def test_a_snapshot_read_while_it_is_saved_again_gives_one_whole_version(nats_server) -> None:
    size = 300_000  # several chunks (nats-py's object store writes 128 KiB chunks)

    async def body(store: PlaneStore, js):
        store.CHUNK_POLL = 0.05
        await store.save("r", bytes([0]) * size, 1, identity=IDENT)
        stop = asyncio.Event()

        async def saver():
            v = 0
            while not stop.is_set():
                v = (v + 1) % 250
                await store.save("r", bytes([v]) * size, v + 1, identity=IDENT)
                await asyncio.sleep(0.02)  # a replica saves every few seconds; this one far more often
        task = asyncio.create_task(saver())
        reads = []
        try:
            for _ in range(40):
                data = await _load(store, "r")
                reads.append(data)
        finally:
            stop.set()
            await task
        return reads, store.reads_replaced
    reads, replaced = _run(nats_server.url, body)
    assert len(reads) == 40
    for data in reads:
        assert len(data) == size and data.count(data[:1]) == size, "a read mixed two versions"
    assert replaced >= 0  # counted when a read met a newer save (how often depends on timing)


def test_a_snapshot_whose_chunks_are_gone_is_a_named_error_not_a_hang(nats_server) -> None:
    async def body(store: PlaneStore, js):
        store.CHUNK_POLL, store.CHUNK_WAIT = 0.1, 0.3
        await store.save("r", b"x" * 1000, 5, identity=IDENT)
        info = await store.obs.get_info("r")
        await js.purge_stream(f"OBJ_{store.snapshots_bucket}", subject=f"$O.{store.snapshots_bucket}.C.{info.nuid}")
        with pytest.raises(SnapshotLoadError, match=r"no chunk .* after 0 of \d+ bytes"):
            await store.read("r")
        return True
    assert _run(nats_server.url, body)


def test_candidates_lists_every_snapshot_while_replicas_save_theirs(nats_server) -> None:
    async def body(store: PlaneStore, js):
        for i, n in enumerate(("a", "b")):
            await store.save(n, b"s" * 200_000, 10 + i, identity=IDENT)
        stop = asyncio.Event()

        async def saver(n, base):
            i = base
            while not stop.is_set():
                i += 2
                await store.save(n, b"s" * 200_000, i, identity=IDENT)
        tasks = [asyncio.create_task(saver("a", 10)), asyncio.create_task(saver("b", 11))]
        seen = []
        try:
            for _ in range(150):
                seen.append(await asyncio.wait_for(store.candidates(), 10))
        finally:
            stop.set()
            await asyncio.gather(*tasks)
        return seen
    seen = _run(nats_server.url, body)
    wrong = [c for c in seen if sorted(n for _, n in c) != ["a", "b"]]
    assert not wrong, f"{len(wrong)} of {len(seen)} listings were wrong, e.g. {wrong[0]}"
    assert all(c == sorted(c, reverse=True) and all(seq >= 10 for seq, _ in c) for c in seen)


def test_a_purge_moves_no_consumer_past_a_message_it_has_not_read(nats_server) -> None:
    # nats-server moves every consumer of a purged subject to that subject's first remaining
    # message: purging a subject up to the cut would make a replica that has just started at the
    # cut skip the other subjects' messages before that subject's next one.
    from nats.js import api

    async def body(store: PlaneStore, js):
        store.stream = "PURGETEST"
        await js.add_stream(name="PURGETEST", subjects=["pt.>"], storage=api.StorageType.MEMORY)
        layout = ["pt.a"] * 10 + ["pt.b"] * 13 + ["pt.a"] * 2 + ["pt.b"] * 5  # seqs 1-10 a, 11-23 b, 24-25 a, 26-30 b
        for subject in layout:
            await js.publish(subject, b"x")
        cut = 22  # a replica covering 21 starts reading at 22 (a pt.b message; pt.a's next is 24)
        await js.add_consumer("PURGETEST", api.ConsumerConfig(
            durable_name="fresh", ack_policy=api.AckPolicy.ALL,
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=cut))
        purged = await store.purge_below(12) + await store.purge_below(cut)
        sub = await js.pull_subscribe_bind("fresh", stream="PURGETEST")
        got = [m.metadata.sequence.stream for m in await sub.fetch(9, timeout=5)]
        left = (await js.stream_info("PURGETEST")).state.messages
        later = await store.purge_below(31)  # both subjects published since: all but each one's last go
        lasts = [(await js.get_last_msg("PURGETEST", s)).seq for s in ("pt.a", "pt.b")]
        return got, purged, left, later, (await js.stream_info("PURGETEST")).state.messages, lasts
    got, purged, left, later, finally_left, lasts = _run(nats_server.url, body)
    assert got == list(range(22, 31)), f"the consumer at 22 skipped: {got}"
    # below the cut only pt.b's 11 could go (pt.a kept its 1-10: it published nothing in 12-21)
    assert (purged, left) == (1, 29)
    assert (later, finally_left, lasts) == (27, 2, [25, 30])
