"""The Ingestor: events -> index operations.

It owns what joining needs: the learned engine-hash maps (through the endpoints' maps), the
offload events waiting for their GPU event (pending joins), and the counters of what it did.
:class:`Ingestor` is the pure-Python path; :class:`consumers.nativeingest.NativeIngestor` is
the same interface with the common events of an encoded batch applied in C. Storing a GPU
block (token ids -> keys -> index chain) has one Python place: :meth:`Ingestor._store_tokens`.
"""

from __future__ import annotations

from collections import OrderedDict
from math import gcd

from kvevents.codec import decode_batch
from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from .endpoints import Endpoint, Endpoints
from .index import Index
from .keys import chain_keys, model_seed
from .learned import LearnedMap
from .router_config import RouterConfig, RouterInputError, RouterStats

__all__ = ["Ingestor"]

#: offload joins per (endpoint, tier) whose chain depth is always checked; after that, one in this many
_DEPTH_ALWAYS = 64
#: a depth walk longer than this gives no evidence (the chain root is too far to count)
_DEPTH_LIMIT = 1 << 15
#: chunk hashes remembered per (endpoint, tier) while an inferred extent may still shrink
_PROVISIONAL_CAP = 4096


def _lora(ev: BlockStored) -> str | None:
    if ev.lora_name is not None:
        return ev.lora_name
    return None if ev.lora_id is None else f"lora-id:{ev.lora_id}"


class Ingestor:
    """Applies batches to the index for the endpoints of one router."""

    native = False  #: whether encoded batches are applied in C (NativeIngestor)

    def __init__(self, config: RouterConfig, endpoints: Endpoints, index: Index, learned: LearnedMap,
                 stats: RouterStats) -> None:
        self._cfg = config
        self._bs = config.block_size
        self.eps = endpoints
        self._index = index
        self._learned = learned
        self._stats = stats
        self._slots = endpoints.slots
        self._tier_names = endpoints.tier_names
        self.pending: OrderedDict = OrderedDict()  #: (hash, slot, tier) -> batch number it was held at
        self.pending_by_hash: dict[object, list] = {}

    # --- the interface ----------------------------------------------------------------------
    def sync(self) -> None:
        """Bring ``stats`` and the learned/index counters up to date (the C path tallies apart)."""

    def apply(self, pod: str, batch: KVEventBatch, *, model: str | None = None, strict: bool = False) -> None:
        """One decoded batch from ``pod`` (its ``data_parallel_rank`` picks the endpoint)."""
        if type(batch) is not KVEventBatch and not isinstance(batch, KVEventBatch):
            raise TypeError(f"apply expects a KVEventBatch, got {type(batch).__name__}")
        self.sync()
        rank = batch.data_parallel_rank
        ep = self.eps.by_key.get((pod, rank or 0))
        if ep is None:
            ep = self.eps.get(pod, rank, model)
        self._stats.batches += 1
        lmap = ep.lmap
        n0 = len(lmap)
        self.apply_events(ep, batch.events, strict)
        if self.pending:
            self._expire_pending()
        n1 = len(lmap)
        if n1 != n0:
            learned = self._learned
            learned.size += n1 - n0
            if learned.size > learned.max_size:
                learned.recount()
            self.learned_changed()

    def apply_payload(self, pod: str, payload: bytes, *, model: str | None = None, strict: bool = False) -> None:
        """One encoded batch: ``apply(pod, decode_batch(payload))`` (one decode)."""
        self.apply(pod, decode_batch(payload), model=model, strict=strict)

    def learned_changed(self) -> None:
        """Hook: the learned maps' size moved on the Python path."""

    def clear_endpoint(self, ep: Endpoint) -> None:
        """Drop everything ``ep`` holds: its index bits, its pending joins, its odd chunks."""
        self.sync()
        self.eps.touch += 1
        self._index.clear(ep.slot)
        self._drop_pending_of(ep.slot)
        ep.odd_chunks.clear()
        ep.chunk_joined.clear()
        if ep.unreliable:  # its index is known again (empty): certain
            ep.unreliable = False
            self.eps.uncertain.pop(ep.pod, None)
            self.eps.gen += 1

    def forget_pod(self, pod: str) -> None:
        """``pod`` was removed (caches of its endpoints go)."""

    def error(self, kind: str, msg: str, strict: bool) -> None:
        self._stats.errors[kind] = self._stats.errors.get(kind, 0) + 1
        if strict:
            raise RouterInputError(msg)

    def _block_keys(self, ep: Endpoint, v: object, bs: int = 0) -> tuple[int | None, int]:
        """(last complete key, keys completed) of an engine block's learned value (``bs``: the
        block size of the tier the hash was stored in, when it is not the GPU's). A plain int is
        a block of one canonical block: a block of several carries its count in its value, so
        what an offload joins never depends on whether the joining endpoint has told its own
        block size yet (a replay, which knows it earlier, joins the same keys)."""
        if type(v) is int:
            return v, (bs // self._bs) or 1  # type: ignore[return-value]
        k, _tail, n = v  # type: ignore[misc]
        return (k if n else None), n

    # --- one batch ------------------------------------------------------------------------
    def apply_events(self, ep: Endpoint, events: list, strict: bool) -> None:
        """Apply one batch's events. The common shapes (engine block = canonical block,
        offload chunk = one block, every hash known) run inline; the rest goes to the
        general methods below."""
        stats = self._stats
        stats.events += len(events)
        self.eps.touch += 1  # the C fast path's cached per-endpoint context may be stale now
        groups = self._cfg.groups
        tiers = self.eps.tiers
        index = self._index
        C = self._bs
        lmap = ep.lmap
        odd = ep.odd
        lget = lmap.get
        store_tokens = self._store_tokens
        for ev in events:
            cls = type(ev)
            if cls is BlockStored or cls is BlockRemoved:
                if ev.group_idx not in groups:
                    stats.ignored_group_events += 1
                    continue
                medium = ev.medium
                tier = tiers.get("GPU" if medium is None else medium)
                if tier is None:
                    tier = self.eps.tier(medium)
                    if tier < 0:  # (a removal from a tier never indexed has nothing to remove)
                        if cls is BlockStored:
                            self.error("too_many_tiers", f"pod {ep.pod!r}: medium {medium!r} is one tier too "
                                        f"many (max_tiers={self._cfg.max_tiers})", strict)
                        continue
                if cls is BlockRemoved:
                    self._remove(ep, ev.block_hashes, tier)
                    continue
                hashes = ev.block_hashes
                toks = ev.token_ids
                if toks:
                    store_tokens(ep, ev, tier, strict)
                    continue
                # offload store: no tokens; join by engine hash
                configured = self._cfg.offload_chunk_blocks.get(self._tier_names[tier])
                if configured is None:
                    ck = ep.chunk_keys.get(tier)
                    if ck != 1 and len(hashes) > 1:
                        self._infer_chunk(ep, tier, hashes)
                        ck = ep.chunk_keys.get(tier)
                    one = ck == 1  # (unknown: _join infers it from the chain depth)
                else:
                    one = configured == 1
                if one and ep.block_size == C and not odd[0]:
                    keys = list(map(lget, hashes))
                    if None not in keys:
                        stats.offload_blocks += len(keys)
                        index.store(ep.slot, tier, keys, chain=False)
                        continue
                self._store_offload(ep, hashes, tier)
            elif cls is AllBlocksCleared:
                stats.clears += 1
                self.clear_endpoint(ep)
            else:
                self.error("unknown_event", f"pod {ep.pod!r}: not a KV event: {cls.__name__}", strict)

    # --- GPU-style stores (tokens) ----------------------------------------------------------
    def _store_tokens(self, ep: Endpoint, ev: BlockStored, tier: int, strict: bool) -> None:
        """Store a token-carrying block: THE Python place (the C path does the canonical case
        of this, checked against it by tests/test_router_fastpath.py)."""
        hashes = ev.block_hashes
        toks = ev.token_ids
        E = ev.block_size
        n = len(hashes)
        if E <= 0 or n == 0 or len(toks) != n * E:
            self.error("bad_block_stored", f"pod {ep.pod!r}: BlockStored with {n} hashes, block_size {E} and "
                        f"{len(toks)} token ids (want hashes * block_size)", strict)
            return
        lmap = ep.lmap
        ph = ev.parent_block_hash
        if ph is None:
            pv: object = ep.seed if ev.lora_name is None and ev.lora_id is None else model_seed(ep.model, _lora(ev))
        else:
            pv = lmap.get(ph)
            if pv is None:
                self._stats.orphan_blocks += n
                return
        if ep.block_size != E:
            if tier == 0 or not ep.block_size:  # the GPU's block size is the endpoint's
                ep.block_size = E
            elif ep.tier_bs.get(tier) != E:
                ep.tier_bs[tier] = E  # a self-describing offload store: its chunk's extent, exactly
                self.eps.touch += 1
        if tier not in ep.token_tiers:
            ep.token_tiers.add(tier)
        if E == self._bs and type(pv) is int:  # (an engine block of several canonical ones: the general path)
            keys = None
            if hashes[0] in lmap:  # already learned (e.g. from another pod): no hashing
                keys = list(map(lmap.get, hashes))
                if None in keys or (ep.odd[0] and not all(type(k) is int for k in keys)):
                    keys = None
            if keys is None:
                keys = chain_keys(toks, pv, E)  # type: ignore[arg-type]
                lmap.update(zip(hashes, keys))
            parent = None if ph is None else pv
        else:
            seed = pv if ph is None else ep.seed if ev.lora_name is None and ev.lora_id is None else \
                model_seed(ep.model, _lora(ev))
            keys, parent = self._store_general(lmap, hashes, toks, E, pv, seed)  # type: ignore[arg-type]
            ep.odd[0] = True
        self._stats.blocks_stored += n
        if keys:
            self._index.store(ep.slot, tier, keys, parent)  # type: ignore[arg-type]
        if self.pending_by_hash:
            self._resolve_pending(ep.model, hashes)

    def _store_general(self, lmap: dict, hashes: list, toks: list, E: int, pv: object, seed: int):
        """Engine blocks that do not end on canonical boundaries: carry the partial tail."""
        C = self._bs
        if type(pv) is int:
            k, tail = pv, ()
        else:
            k, tail, _n = pv  # type: ignore[misc]
        parent = None if k == seed else k
        keys: list[int] = []
        for i, h in enumerate(hashes):
            seq = tail + tuple(toks[i * E : (i + 1) * E])
            full = len(seq) // C * C
            ks = chain_keys(seq[:full], k, C) if full else []
            if ks:
                keys.extend(ks)
                k = ks[-1]
            tail = seq[full:]
            lmap[h] = (k, tail, len(ks))

        return keys, parent

    # --- offload stores (no tokens): join by engine hash ------------------------------------
    def _store_offload(self, ep: Endpoint, hashes: list, tier: int) -> None:
        """The general offload join (chunks of several keys, unknown hashes, partial blocks)."""
        lmap = ep.lmap
        for h in hashes:
            if h in lmap:
                self._join(ep, tier, h)
            else:
                self._hold(ep, tier, h)

    def _infer_chunk(self, ep: Endpoint, tier: int, hashes: list) -> None:
        """Chunk length (in keys) = gcd of the distances between consecutive chunk hashes of
        one offload event: a chunk is named by its last block, so a distance is a whole
        number of chunks (a skipped, already-offloaded chunk only makes it a multiple)."""
        lmap = ep.lmap
        limit = self._cfg.max_chunk_keys
        g = ep.chunk_keys.get(tier, 0)
        for a, b in zip(hashes, hashes[1:]):
            va, vb = lmap.get(a), lmap.get(b)
            if va is None or vb is None:
                continue
            ka, _ = self._block_keys(ep, va)
            kb, _ = self._block_keys(ep, vb)
            if ka is None or kb is None:
                continue
            between = self._index.keys_between(kb, ka, limit)
            if between:
                g = gcd(g, len(between))
                if g == 1:
                    break
        if g:
            self._set_extent(ep, tier, g)

    def _depth_evidence(self, ep: Endpoint, tier: int, k: int) -> None:
        """A chunk of m keys ends at a chain depth (keys from the root) that is a multiple of
        m: the depth of a joined chunk's last key bounds the extent from above. Checked for the
        first joins of a tier, then sampled. A walk that does not end at a key the index holds
        without a parent (the parent was evicted) is no evidence, nor is the depth of an endpoint
        whose engine blocks are not whole canonical blocks (its chunks are not whole keys)."""
        seen = ep.chunk_seen.get(tier, 0) + 1
        ep.chunk_seen[tier] = seen
        if (seen > _DEPTH_ALWAYS and seen % _DEPTH_ALWAYS) or ep.block_size % self._bs:  # (partial blocks)
            return
        index = self._index
        path = index.lineage(k, _DEPTH_LIMIT)
        if len(path) >= _DEPTH_LIMIT or not index.match(path[:1], range(len(self._tier_names)), self.eps.slots)[0]:
            return  # (the walk's first key is no longer held: maybe not a root, its link gone)
        self._set_extent(ep, tier, len(path))

    def _set_extent(self, ep: Endpoint, tier: int, g: int) -> None:
        """Fold evidence ``g`` (a multiple of the chunk extent, in keys) into the tier's estimate.
        The estimate only shrinks; when it does, chunks joined with the larger extent give
        their extra keys back (the score may under-report, never over-report)."""
        cur = ep.chunk_keys.get(tier)
        new = g if cur is None else gcd(cur, g)
        if new == cur:
            return
        ep.chunk_keys[tier] = new
        self.eps.touch += 1  # the C path's context says how this tier joins
        if cur is None:
            self._stats.chunk_inferred += 1
            return
        self._stats.chunk_rederived += 1
        joined = ep.chunk_joined.pop(tier, None)
        if not joined:
            return
        index = self._index
        odd = ep.odd_chunks.get(tier) or {}
        keep: set = set()
        drop: set = set()
        for h in joined:
            v = ep.lmap.get(h)
            if v is None or h in odd:
                continue
            k, _n = self._block_keys(ep, v)
            if k is None:
                continue
            old = index.lineage(k, cur)
            keep.update(old[-new:])
            drop.update(old)
        drop -= keep
        if drop:
            index.remove(ep.slot, tier, list(drop))
        if new > 1:
            ep.chunk_joined[tier] = joined

    def _chunk_default(self, ep: Endpoint, tier: int, n: int) -> int:
        configured = self._cfg.offload_chunk_blocks.get(self._tier_names[tier])
        if configured is not None:
            return configured * n
        return ep.chunk_keys.get(tier, n)

    def _join(self, ep: Endpoint, tier: int, h: object) -> None:
        k, n = self._block_keys(ep, ep.lmap[h])
        self._stats.offload_blocks += 1
        if k is None:
            return
        index = self._index
        inferred = self._cfg.offload_chunk_blocks.get(self._tier_names[tier]) is None
        if inferred and ep.chunk_keys.get(tier) != 1:
            self._depth_evidence(ep, tier, k)
        default = self._chunk_default(ep, tier, n)
        keys = [k] if default == 1 else index.lineage(k, default)
        if len(keys) != default:
            ep.odd_chunks.setdefault(tier, {})[h] = len(keys)
        elif inferred and default > 1:
            joined = ep.chunk_joined.get(tier)
            if joined is None:
                joined = ep.chunk_joined[tier] = {}
            if len(joined) < _PROVISIONAL_CAP:
                joined[h] = None
        index.store(ep.slot, tier, keys, chain=False)

    # --- pending offload events -----------------------------------------------------------
    def _hold(self, ep: Endpoint, tier: int, h: object) -> None:
        key = (h, ep.slot, tier)
        pending = self.pending
        if key in pending:
            pending.move_to_end(key)
            pending[key] = self._stats.batches
            return
        if len(pending) >= self._cfg.pending_capacity:
            old, _ = pending.popitem(last=False)
            self._unlink_pending(old)
            self._stats.pending_dropped += 1
        pending[key] = self._stats.batches
        self.pending_by_hash.setdefault(h, []).append(key)
        self._stats.pending_held += 1

    def _unlink_pending(self, key: tuple) -> None:
        lst = self.pending_by_hash.get(key[0])
        if lst is not None:
            try:
                lst.remove(key)
            except ValueError:
                pass
            if not lst:
                del self.pending_by_hash[key[0]]

    def _resolve_pending(self, model: str, hashes: list) -> None:
        by_hash = self.pending_by_hash
        for h in hashes:
            lst = by_hash.get(h)
            if not lst:
                continue
            for key in list(lst):
                ep = self._slots.get(key[1])
                if ep is None or ep.model != model or h not in ep.lmap:
                    continue
                del self.pending[key]
                lst.remove(key)
                self._stats.pending_resolved += 1
                self._stats.offload_blocks -= 1  # _join counts it again
                self._join(ep, key[2], h)
            if not lst:
                del by_hash[h]

    def _expire_pending(self) -> None:
        pending = self.pending
        horizon = self._stats.batches - self._cfg.pending_max_batches
        while pending:
            key = next(iter(pending))
            if pending[key] >= horizon:
                break
            del pending[key]
            self._unlink_pending(key)
            self._stats.pending_expired += 1

    def _drop_pending_of(self, slot: int) -> None:
        for key in [k for k in self.pending if k[1] == slot]:
            del self.pending[key]
            self._unlink_pending(key)
            self._stats.pending_cancelled += 1

    # --- removals -------------------------------------------------------------------------
    def _remove(self, ep: Endpoint, hashes: list, tier: int) -> None:
        lmap = ep.lmap
        index = self._index
        token_tier = tier in ep.token_tiers or (tier == 0 and not ep.token_tiers)
        odd = ep.odd_chunks.get(tier)
        for h in hashes:
            v = lmap.get(h)
            key = (h, ep.slot, tier)
            if key in self.pending:
                del self.pending[key]
                self._unlink_pending(key)
                self._stats.pending_cancelled += 1
                continue
            if v is None:
                self._stats.remove_unknown += 1
                continue
            self._stats.blocks_removed += 1
            k, n = self._block_keys(ep, v, ep.tier_bs.get(tier, 0))
            if k is None:
                continue
            joined = ep.chunk_joined.get(tier)
            if joined:
                joined.pop(h, None)
            if token_tier:
                keys = [k] if n == 1 else index.lineage(k, n)
            else:
                nk = odd.pop(h, None) if odd else None
                keys = index.lineage(k, nk or self._chunk_default(ep, tier, n))
            index.remove(ep.slot, tier, keys)
