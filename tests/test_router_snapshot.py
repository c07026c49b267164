"""Router snapshots: a round trip restores the full state; restoring then re-applying the
stream from any point at or before the snapshot ends where a router that never stopped ends;
corrupt, truncated, future-version and foreign snapshots are refused with a SnapshotError
naming what was wrong (and leave an empty router: a cold start)."""

from __future__ import annotations

import struct

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumers import INDEX_BACKENDS, KVRouter, RouterConfig, SnapshotError
from consumers.snapshot import SNAPSHOT_VERSION
from kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, encode_batch
from kvevents.errors import ConfigError, KVEventsError

from .test_router_fastpath import scenario, state


def _backends() -> list[str]:
    out = []
    for name in INDEX_BACKENDS.names():
        try:
            INDEX_BACKENDS.get(name).create(16, max_tiers=3)
            out.append(name)
        except ConfigError:
            pass
    return out


def _feed(r: KVRouter, steps, raw: bool) -> None:
    for pod, action, batch in steps:
        if action == "reset":
            r.reset_pod(pod)
        elif action == "remove_pod":
            r.remove_pod(pod)
        if raw:
            r.apply_payload(pod, encode_batch(batch))
        else:
            r.apply(pod, batch)


def _causal(batches):
    """The shared generator's streams, made what an engine sends: a hash names a block's content
    and LoRA (the generator's ignore the LoRA: a LoRA block gets hashes of its own here); a
    block is stored after its parent (a child before its parent is dropped here: the first pass
    would count it an orphan, a replay that has seen the parent would not); and an engine removes
    from an offload tier only chunks it stored there, has not removed since and whose blocks it
    computed (their GPU store was sent before: a hash never taught anywhere in the stream is kept,
    it stays unknown, a counted no-op in every pass).

    Why the last rule: a removal from an offload tier names a chunk, and the router removes that
    chunk's keys (walking back the tier's chunk extent), while an offload of a hash not taught yet
    is held and joins when the hash is taught. A replay knows every hash taught before the
    snapshot, so it joins such an offload in place. The generator's removals also name hashes a
    pod never offloaded (a block inside another chunk), or held chunks no engine could have
    evicted yet; then (1) such a removal and the held join cover the same keys and no longer
    commute (the first pass removes first and joins later, a replay joins first), or (2) the
    removal cancels the hold, so the first pass never sees the chunk's depth while the replay
    joins it, and the chunk extent inferred from chain depths differs. No router can tell which
    keys a removal of a never-stored chunk meant, nor learn from a chunk it never saw; for chunks
    an engine did store, chunks of one extent never overlap, so held joins and removals commute.

    And an engine offloads a block only after its GPU store was sent (a block is computed, then
    copied out): an offload naming a hash this pod is taught only later in the stream is left out
    here (a hash never taught anywhere stays: held, never joined, in every pass). The first pass
    holds such an offload and joins it when the GPU store arrives, against the chain that store
    builds; after a reset of the pod in the replayed part, a replay that already knows the hash
    joins it in place, against a chain the reset removed, and the chunk extent inferred from
    chain depth differs (found by this test, 2026-11-27)."""
    taught = {h for _, _, b in batches for ev in b.events if _teaches(ev) for h in ev.block_hashes}
    taught |= {h ^ _LORA for h in taught}
    out = []
    seen: set = set()
    taught_to: dict = {}  # pod -> the hashes its GPU stores have taught so far
    held: dict = {}  # (pod, rank, medium) -> chunk hashes stored there (not removed since)
    for pod, action, b in batches:
        rank = b.data_parallel_rank or 0
        if action in ("reset", "remove_pod"):
            for key in [key for key in held if key[0] == pod]:
                del held[key]
        evs = []
        for ev in b.events:
            if isinstance(ev, BlockStored) and ev.lora_name is not None:
                ev = msgspec.structs.replace(ev, block_hashes=[h ^ _LORA for h in ev.block_hashes],
                                             parent_block_hash=None if ev.parent_block_hash is None
                                             else ev.parent_block_hash ^ _LORA)
            if isinstance(ev, BlockStored) and ev.token_ids:
                if ev.parent_block_hash is not None and ev.parent_block_hash not in seen:
                    continue
                if _teaches(ev):
                    seen.update(ev.block_hashes)
                    taught_to.setdefault(pod, set()).update(ev.block_hashes)
            elif isinstance(ev, BlockStored):  # an offload: of blocks this pod computed before, or never taught
                known = taught_to.get(pod, ())
                hs = [h for h in ev.block_hashes if h in known or h not in taught]
                if not hs:
                    continue
                if len(hs) != len(ev.block_hashes):
                    ev = msgspec.structs.replace(ev, block_hashes=hs)
            if isinstance(ev, BlockStored) and ev.group_idx in (None, 0):
                held.setdefault((pod, rank, ev.medium or "GPU"), set()).update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved) and ev.medium not in (None, "GPU"):
                mine = held.setdefault((pod, rank, ev.medium), set())
                hs = [h for h in ev.block_hashes if (h in mine and h in seen) or h not in taught]
                mine.difference_update(hs)
                if not hs:
                    continue
                ev = msgspec.structs.replace(ev, block_hashes=hs)
            elif isinstance(ev, AllBlocksCleared):
                for key in [key for key in held if key[:2] == (pod, rank)]:
                    del held[key]
            evs.append(ev)
        out.append((pod, action, KVEventBatch(b.ts, evs, b.data_parallel_rank)))
    return out


_LORA = 0x5A5A_5A5A_5A5A_5A5A


def _teaches(ev) -> bool:
    """A GPU store the router learns hashes from: with tokens, of the first KV-cache group (it
    ignores the others' events, so a parent stored only in another group is not known to it)."""
    return isinstance(ev, BlockStored) and bool(ev.token_ids) and ev.group_idx in (None, 0)


def _full(r: KVRouter) -> dict:
    return state(r)  # (links ride with their keys in the index's records: recency order, no dict order)


def _scores(r: KVRouter, batches) -> list:
    prompts = [[t for ev in b.events for t in getattr(ev, "token_ids", [])] for _, _, b in batches[:3]]
    return [{p: (s.tokens_by_tier, s.state) for p, s in r.score(pr).items()} for pr in prompts]


@pytest.mark.parametrize("index", _backends())
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenario(), data=st.data())
def test_restore_then_replay_from_at_or_before_the_snapshot_equals_never_stopping(index, sc, data):
    batches, config = sc
    batches = _causal(batches)
    # (within the budgets: an eviction, an expired or dropped join depends on how many batches
    # a router has seen, which re-applied batches change)
    config = dict(config, index=index, max_entries=1 << 20, pending_capacity=1 << 20, pending_max_batches=1 << 20)
    raw = data.draw(st.booleans())
    at = data.draw(st.integers(0, len(batches)))
    start = data.draw(st.integers(0, at))
    never = KVRouter(RouterConfig(**config))
    _feed(never, batches, raw)
    before = KVRouter(RouterConfig(**config))
    _feed(before, batches[:at], raw)
    snap = before.snapshot(stream_seq=at)
    replica = KVRouter(RouterConfig(**config))
    info = replica.restore(snap)
    assert (info.stream_seq, info.version, info.entries) == (at, SNAPSHOT_VERSION, before.entries())
    assert _full(replica) == _full(before)  # everything, counters and recency order included
    assert replica.state_digest() == before.state_digest()
    _feed(replica, batches[start:], raw)
    assert replica.state_digest() == never.state_digest()
    assert _scores(replica, batches) == _scores(never, batches)


@pytest.mark.parametrize("index", _backends())
@pytest.mark.parametrize("raw", [False, True])
def test_an_offload_before_the_endpoint_told_its_block_size_joins_the_whole_engine_block(index, raw):
    """Found by the property above (about 1 in 1,000 streams): rank 1 of a pod teaches a 4-token
    engine block (2 canonical blocks); rank 0 offloads that hash before its own first GPU event.
    The join took its key count from the joining endpoint's block size, unknown (0) there: one
    key; a replay from before, with the block size known by then, joined two. A learned value
    now carries its own key count, so both join the whole block."""
    cfg = RouterConfig(model="m", block_size=2, index=index, offload_chunk_blocks={"CPU": 1})
    h = 0xE4
    steps = [("w", "batch", KVEventBatch(0.0, [BlockStored([h], None, [1, 1, 1, 1], 4, None, "GPU", None)], 1)),
             ("w", "batch", KVEventBatch(0.0, [BlockStored([h], None, [], 0, None, "CPU", None),
                                               BlockStored([h], None, [1, 1, 1, 1], 4, None, "GPU", None)], 0))]
    never = KVRouter(cfg)
    _feed(never, steps, raw)
    assert never.score([1, 1, 1, 1])["w"].matched_tokens == 4
    replica = KVRouter(cfg)
    replica.restore(never.snapshot())
    _feed(replica, steps, raw)
    assert replica.state_digest() == never.state_digest()


def _router() -> KVRouter:
    r = KVRouter(model="m", block_size=2)
    r.apply("p", KVEventBatch(0.0, [BlockStored([1, 2], None, [1, 2, 3, 4], 2, None, "GPU", None),
                                    BlockStored([9], None, [], 0, None, "CPU", None)], 0))
    return r


def test_a_restore_replaces_what_the_router_held():
    r = _router()
    snap = r.snapshot()
    r.apply("q", KVEventBatch(0.0, [BlockStored([5], None, [7, 7], 2, None, "GPU", None)], 0))
    assert r.pods() == ["p", "q"]
    info = r.restore(snap)
    assert info.stream_seq is None and r.pods() == ["p"] and r.counters()["pending"] == 1
    assert r.pick([1, 2, 3, 4]) == "p"


@pytest.mark.parametrize("damage, message", [
    (lambda b: b[:10], "truncated: 10 bytes"),
    (lambda b: b[:-1], "truncated or padded"),
    (lambda b: b + b"x", "truncated or padded"),
    (lambda b: b[:-3] + bytes([b[-3] ^ 1]) + b[-2:], "checksum does not match"),
    (lambda b: b"XXXXXXXX" + b[8:], "not a router snapshot"),
    (lambda b: b[:8] + struct.pack(">I", SNAPSHOT_VERSION + 1) + b[12:], f"version {SNAPSHOT_VERSION + 1} is not "
                                                                         "supported.*newer release"),
])
def test_damaged_snapshots_are_refused_by_name_and_leave_a_cold_router(damage, message):
    snap = _router().snapshot(stream_seq=3)
    r = _router()
    with pytest.raises(SnapshotError, match=message) as exc:
        r.restore(damage(snap))
    assert isinstance(exc.value, KVEventsError)
    # refused before anything changed, or the parts were reset: never half a state
    assert r.pods() in (["p"], []) and (r.entries() > 0) == (r.pods() == ["p"])


def test_a_snapshot_of_another_configuration_is_refused():
    snap = _router().snapshot()
    with pytest.raises(SnapshotError, match="block_size=2.*this router has block_size=16"):
        KVRouter(model="m").restore(snap)


@pytest.mark.parametrize("index", _backends())
def test_a_version_1_snapshot_is_read_and_its_learned_ints_converted(index):
    """Version 1's learned ints meant a block of the endpoint's block size; version 2's a block
    of one canonical block. A router of 4-token engine blocks over 2-token canonical ones,
    written as version 1 wrote it, restores to the state it had."""
    import hashlib

    from consumers.snapshot import MAGIC, _HEAD, _Body

    r = KVRouter(RouterConfig(model="m", block_size=2, index=index))
    r.apply("w", KVEventBatch(0.0, [BlockStored([7, 8], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU", None)], 0))
    body = msgspec.msgpack.decode(r.snapshot()[_HEAD.size + 4:], type=_Body)
    assert [v[1:] for v in body.learned[0][3]] == [[[], 2], [[], 2]]  # version 2: each value counts its keys
    body.learned[0][3] = [v[0] for v in body.learned[0][3]]  # what version 1 wrote: plain ints
    body.learned[0][1] = False
    raw = msgspec.msgpack.encode(body)
    v1 = MAGIC[:4] + _HEAD.pack(MAGIC[4:], 1, len(raw), hashlib.blake2b(raw, digest_size=16).digest()) + raw
    back = KVRouter(RouterConfig(model="m", block_size=2, index=index))
    back.restore(v1)
    assert back.state_digest() == r.state_digest()
    back.apply("w", KVEventBatch(0.0, [BlockRemoved([8], "GPU")], 0))  # a whole engine block: 2 keys
    assert back.score([1, 2, 3, 4, 5, 6, 7, 8])["w"].matched_tokens == 4
