"""Router snapshots: the whole state of a :class:`~consumers.KVRouter` as bytes, and back.

A snapshot holds everything the index and its joins need — entries by tier (every key's mask,
oldest first, and its parent link), the learned engine-hash maps in their order, the pending
joins, every endpoint (slot, model, learned block size, chunk lengths, token tiers, state),
per-pod model/health/publisher attribution, the tiers table — plus the counters and the stream
sequence it covers (``stream_seq``, given by the caller: the last sequence applied).

Format (version 2; version 1 is read too)::

    b"KVRSNAP\\0" | version u32 BE | body length u64 BE | blake2b-128 of the body | body

The body is msgpack (msgspec) of :class:`_Body`; keys, masks and parents are packed arrays
(little-endian u64 words), so a 1M-key index costs ~30-40 bytes per key. Anything wrong —
bad magic, a future version, a length or checksum that does not match, a body that does not
decode or does not fit this router's configuration — raises :class:`SnapshotError` naming it.

Version 2 changed what a learned value means, not the layout: a plain int is an engine block of
exactly one canonical block (a block of several is ``[key, [], n]``). In version 1 an int stood
for a block of the endpoint's block size; restoring one converts the ints of every model whose
endpoints all told one block size of several canonical blocks (a model whose endpoints disagree
cannot be converted exactly and keeps them as they are).
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from dataclasses import dataclass
from typing import Any

import msgspec

from kvevents.errors import KVEventsError

from .index import IndexImage

# ``KVRouter`` in annotations is consumers.router.KVRouter, left a string (not imported, not even
# under TYPE_CHECKING): the router imports this module, and the floor rules allow no circle.
__all__ = ["SNAPSHOT_VERSION", "SnapshotError", "SnapshotInfo", "load_into", "save", "state_digest"]

MAGIC = b"KVRSNAP\x00"
SNAPSHOT_VERSION = 2
_READS = (1, 2)
_HEAD = struct.Struct(">4sIQ16s")  # (the magic's second half is checked with it)
_HEADER_LEN = 4 + _HEAD.size
_NOPAR = (1 << 64) - 1


class SnapshotError(KVEventsError, ValueError):
    """A snapshot that cannot be restored: corrupt, truncated, a future version, or made for
    another configuration. The message names what was wrong."""


@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    version: int
    stream_seq: int | None
    entries: int  #: (key, endpoint, tier) entries restored
    keys: int
    pods: int
    nbytes: int


def _join_state(ep) -> list:
    """What the offload join inferred for an endpoint (consumers/ingest.py)."""
    return [sorted(ep.tier_bs.items()), [[t, list(d)] for t, d in sorted(ep.chunk_joined.items())],
            sorted(ep.chunk_seen.items())]


class _Body(msgspec.Struct, array_like=True):
    stream_seq: int | None
    block_size: int
    max_tiers: int
    cap: int
    tiers: list[str]
    keys: bytes  #: u64 LE per key, oldest first
    words: int  #: u64 words per mask
    masks: bytes  #: `words` u64 LE per key
    parents: bytes  #: u64 LE per key (2**64 - 1: none)
    learned: list  #: [model, odd, keys, values] per model (values: int or [key, tail, n])
    learned_counts: list[int]  #: size, evicted
    #: [pod, rank, slot, model, block_size, chunk_keys, odd_chunks, token_tiers, unreliable,
    #:  [tier_bs, chunk_joined, chunk_seen]] (the last element is absent in snapshots made before it)
    endpoints: list
    free_slots: list[int]
    next_slot: int
    pod_model: dict[str, str]
    pub_pod: dict[str, str]
    health: dict[str, str]
    pending: list  #: [hash, slot, tier, held at batch], oldest first
    index_counts: list[int]  #: evicted keys, evicted entries
    stats: dict[str, Any]


def _u64le(values: list[int]) -> bytes:
    a = array("Q", values)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def _from_u64le(data: bytes, what: str) -> list[int]:
    if len(data) % 8:
        raise SnapshotError(f"snapshot {what}: {len(data)} bytes is not a whole number of u64 words")
    a = array("Q")
    a.frombytes(data)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()


def _body(router: KVRouter, stream_seq: int | None) -> _Body:
    stats = router.stats  # (first: folds what the C path tallied)
    image = router.index.snapshot()
    eps = router.endpoints
    cfg = router.config
    words = max(1, (image.width * cfg.max_tiers + 63) // 64)
    width = words * 8
    keys, masks, parents = [], bytearray(), []
    for k, m, p in image.records:
        keys.append(k)
        masks += m.to_bytes(width, "little")
        parents.append(_NOPAR if p is None else p)
    learned = router.learned
    lmaps = []
    for model, lmap in learned.maps.items():
        ks, vs = [], []
        for h, v in lmap.items():
            ks.append(h)
            vs.append(v)
        lmaps.append([model, bool(learned.odd[model][0]), ks, vs])
    ep_rows = [[ep.pod, ep.rank, ep.slot, ep.model, ep.block_size, sorted(ep.chunk_keys.items()),
                [[t, list(d.items())] for t, d in sorted(ep.odd_chunks.items())], sorted(ep.token_tiers),
                ep.unreliable, _join_state(ep)] for ep in eps]
    pending = [[h, slot, tier, at] for (h, slot, tier), at in router.ingestor.pending.items()]
    return _Body(stream_seq, cfg.block_size, cfg.max_tiers, image.width, list(eps.tier_names), _u64le(keys), words,
                 bytes(masks), _u64le(parents), lmaps, [learned.size, learned.evicted], ep_rows,
                 list(eps.free_slots), eps.next_slot, dict(eps.pod_model), dict(eps.pub_pod), dict(eps.health),
                 pending, [image.evicted_keys, image.evicted_entries], stats.as_dict())


def save(router: KVRouter, stream_seq: int | None = None) -> bytes:
    if stream_seq is not None and (not isinstance(stream_seq, int) or stream_seq < 0):
        raise ValueError(f"stream_seq must be a non-negative int or None, got {stream_seq!r}")
    body = msgspec.msgpack.encode(_body(router, stream_seq))
    digest = hashlib.blake2b(body, digest_size=16).digest()
    return MAGIC[:4] + _HEAD.pack(MAGIC[4:], SNAPSHOT_VERSION, len(body), digest) + body


def _parse(data: bytes) -> tuple[int, _Body]:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise SnapshotError(f"snapshot must be bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < _HEADER_LEN:
        raise SnapshotError(f"snapshot truncated: {len(data)} bytes, the header alone is {_HEADER_LEN}")
    magic2, version, length, digest = _HEAD.unpack_from(data, 4)
    if data[:4] + magic2 != MAGIC:
        raise SnapshotError(f"not a router snapshot (magic {data[:8]!r}, want {MAGIC!r})")
    if version not in _READS:
        raise SnapshotError(f"snapshot version {version} is not supported (this router reads versions "
                            f"{', '.join(map(str, _READS))}"
                            f"{'; it is from a newer release' if version > SNAPSHOT_VERSION else ''})")
    body = data[_HEADER_LEN:]
    if len(body) != length:
        raise SnapshotError(f"snapshot truncated or padded: body of {len(body)} bytes, header says {length}")
    if hashlib.blake2b(body, digest_size=16).digest() != digest:
        raise SnapshotError("snapshot corrupt: the body's checksum does not match the header's")
    try:
        return version, msgspec.msgpack.decode(body, type=_Body)
    except msgspec.DecodeError as exc:  # (a checksum collision or a writer bug)
        raise SnapshotError(f"snapshot body does not decode: {exc}") from None


def _value(v: object) -> object:
    if type(v) is list:
        return (v[0], tuple(v[1]), v[2])
    return v


def load_into(router: KVRouter, data: bytes) -> SnapshotInfo:
    """Replace ``router``'s state with the snapshot's (the router's configuration stays)."""
    version, b = _parse(data)
    cfg = router.config
    if b.block_size != cfg.block_size or b.max_tiers != cfg.max_tiers:
        raise SnapshotError(f"snapshot made with block_size={b.block_size}, max_tiers={b.max_tiers}; this router "
                            f"has block_size={cfg.block_size}, max_tiers={cfg.max_tiers}")
    keys = _from_u64le(b.keys, "keys")
    parents = _from_u64le(b.parents, "parents")
    width = b.words * 8
    if len(parents) != len(keys) or len(b.masks) != width * len(keys) or b.cap * b.max_tiers > b.words * 64:
        raise SnapshotError(f"snapshot inconsistent: {len(keys)} keys, {len(parents)} parents, "
                            f"{len(b.masks)} mask bytes of {width} per key")
    try:
        router._reset_parts()
        eps = router.endpoints
        fb = int.from_bytes
        masks = b.masks
        router.index.restore(IndexImage(b.cap, [(k, fb(masks[i * width:(i + 1) * width], "little"),
                                                 None if p == _NOPAR else p)
                                                for i, (k, p) in enumerate(zip(keys, parents))], *b.index_counts))
        for name in b.tiers:
            eps.tier(name)
        if list(eps.tier_names) != b.tiers:
            raise SnapshotError(f"snapshot tiers {b.tiers} do not extend this router's {eps.tier_names}")
        learned = router.learned
        for model, odd, ks, vs in b.learned:
            lmap = learned.for_model(model)
            lmap.update(list(zip(ks, map(_value, vs))))
            learned.odd[model][0] = odd
        learned.size, learned.evicted = b.learned_counts
        from .endpoints import Endpoint

        for pod, rank, slot, model, bsz, chunk, odd_chunks, token_tiers, unreliable, *join in b.endpoints:
            ep = Endpoint(pod, rank, slot, model, learned.for_model(model), learned.odd[model])
            if join:
                tier_bs, joined, seen = join[0]
                ep.tier_bs = {t: n for t, n in tier_bs}
                ep.chunk_joined = {t: dict.fromkeys(hs) for t, hs in joined}
                ep.chunk_seen = {t: n for t, n in seen}
            ep.block_size = bsz
            ep.chunk_keys = {t: n for t, n in chunk}
            ep.odd_chunks = {t: {h: n for h, n in d} for t, d in odd_chunks}
            ep.token_tiers = set(token_tiers)
            ep.unreliable = unreliable
            if unreliable and router.config.relearn_batches:  # (its re-learning starts over)
                eps.uncertain[pod] = router.config.relearn_batches
            eps.by_key[(pod, rank)] = ep
            eps.slots[slot] = ep
        if version == 1:
            _from_v1(router)
        eps.free_slots[:] = b.free_slots
        eps.next_slot = b.next_slot
        eps.pod_model.update(b.pod_model)
        eps.pub_pod.update(b.pub_pod)
        eps.health.update(b.health)
        ing = router.ingestor
        for h, slot, tier, at in b.pending:
            key = (h, slot, tier)
            ing.pending[key] = at
            ing.pending_by_hash.setdefault(h, []).append(key)
        stats = router.stats
        for name, v in b.stats.items():
            if hasattr(stats, name):
                setattr(stats, name, dict(v) if isinstance(v, dict) else v)
        eps.touch += 1
        eps.gen += 1
        ing.learned_changed()
    except SnapshotError:
        router._reset_parts()
        raise
    except (TypeError, ValueError, KeyError, IndexError) as exc:
        router._reset_parts()  # a cold start, not half a state
        raise SnapshotError(f"snapshot content does not fit: {type(exc).__name__}: {exc}") from None
    return SnapshotInfo(SNAPSHOT_VERSION, b.stream_seq, router.entries(), len(keys), len(router.pods()), len(data))


def _from_v1(router: KVRouter) -> None:
    """Version 1's learned ints meant a block of the endpoint's block size: where a model's
    endpoints told one size of m > 1 canonical blocks, its ints become ``(key, (), m)``."""
    C = router.config.block_size
    learned = router.learned
    for model, lmap in learned.maps.items():
        sizes = {ep.block_size for ep in router.endpoints if ep.model == model and ep.block_size}
        if len(sizes) != 1:
            continue
        E = sizes.pop()
        if E % C or E // C < 2:  # (one canonical block: ints already; partial blocks: tuples already)
            continue
        ints = [(h, (v, (), E // C)) for h, v in lmap.items() if type(v) is int]
        if ints:
            lmap.update(ints)
            learned.odd[model][0] = True


def state_digest(router: KVRouter) -> str:
    """A digest of everything the router answers and joins from, in canonical form: per key
    the (pod, rank, tier) holding it and its parent; the learned maps; the pending joins by
    (hash, pod, rank, tier); every endpoint's learned shape and state; pod attribution and
    health. Two routers with equal digests give the same answers and joins. Left out: counters,
    the stream seq, pending joins' ages, slot numbers (which free slot a re-created endpoint
    gets is naming, not state) and recency order (a replayed offload can join a key later than
    the first pass did, which only changes which key an eviction would take first), and the
    offload join's inferred chunk extents with the chunks it may still re-derive (estimates from
    evidence: a replayed offload that joins a hash the first pass held and then saw cancelled
    adds evidence the first pass never had; both estimates bound the same true extent)."""
    image = router.index.snapshot()
    eps = router.endpoints
    tiers = list(eps.tier_names)
    owner = {t * image.width + ep.slot: (ep.pod, ep.rank, name) for ep in eps if ep.slot < image.width
             for t, name in enumerate(tiers)}
    h = hashlib.blake2b(digest_size=16)
    enc = msgspec.msgpack.Encoder()
    for k, m, p in sorted(image.records, key=lambda it: it[0]):
        held = []
        while m:
            low = m & -m
            held.append(owner.get(low.bit_length() - 1, ("?", low.bit_length() - 1, "")))
            m ^= low
        held.sort()
        h.update(enc.encode([k, held, p]))
    learned = router.learned
    h.update(enc.encode(sorted([model, bool(learned.odd[model][0]), [[a, b] for a, b in lmap.items()]]
                               for model, lmap in learned.maps.items())))
    by_slot = {ep.slot: ep for ep in eps}
    h.update(enc.encode(sorted([repr(hh), by_slot[slot].pod, by_slot[slot].rank, tiers[t]]
                               for hh, slot, t in router.ingestor.pending)))
    h.update(enc.encode(sorted([ep.pod, ep.rank, ep.model, ep.block_size,
                                sorted([t, sorted(d.items(), key=repr)] for t, d in ep.odd_chunks.items()),
                                sorted(ep.token_tiers), ep.unreliable, sorted(ep.tier_bs.items())]
                               for ep in eps)))
    h.update(enc.encode([tiers, sorted(eps.pod_model.items()), sorted(eps.pub_pod.items()),
                         sorted(eps.health.items())]))
    return h.hexdigest()
