"""Applying events to the index: the part of KVRouter that learns, joins and removes.

Kept apart from :mod:`consumers.router` (endpoints, lifecycle, scoring entry points) so
each stays small. :class:`IngestMixin` works on the attributes KVRouter sets up.
"""

from __future__ import annotations

from collections import OrderedDict
from math import gcd
from typing import TYPE_CHECKING

from kvevents.events import AllBlocksCleared, BlockRemoved, BlockStored

from .keys import chain_keys, model_seed
from .router_config import RouterInputError

if TYPE_CHECKING:  # pragma: no cover
    from .index import BlockIndex, LearnedMap
    from .router_config import RouterConfig, RouterStats

__all__ = ["Endpoint", "IngestMixin"]


class Endpoint:
    """One engine: a pod's data-parallel rank. Owns one slot (bit lane) in the index."""

    __slots__ = ("pod", "rank", "slot", "model", "lmap", "odd", "seed", "block_size", "chunk_keys",
                 "odd_chunks", "token_tiers", "unreliable")

    def __init__(self, pod: str, rank: int, slot: int, model: str, lmap: dict, odd: list) -> None:
        self.pod = pod
        self.rank = rank
        self.slot = slot
        self.model = model
        self.lmap = lmap  #: the model's engine-hash -> key map (shared by every endpoint of the model)
        self.odd = odd  #: [True] once the model's map holds a non-int (partial block) value
        self.seed = model_seed(model)  #: chain seed without LoRA
        self.block_size = 0  #: engine block size, learned from token-carrying events
        self.chunk_keys: dict[int, int] = {}  #: tier -> keys per offloaded chunk (inferred)
        self.odd_chunks: dict[int, dict[object, int]] = {}  #: tier -> chunk hash -> keys, if not the default
        self.token_tiers: set[int] = set()  #: tiers whose stores carried tokens
        self.unreliable = False

    def __repr__(self) -> str:
        return f"Endpoint({self.pod!r}, rank={self.rank}, slot={self.slot}, model={self.model!r})"


def _lora(ev: BlockStored) -> str | None:
    if ev.lora_name is not None:
        return ev.lora_name
    return None if ev.lora_id is None else f"lora-id:{ev.lora_id}"


class IngestMixin:
    _cfg: RouterConfig
    _index: BlockIndex
    _learned: LearnedMap
    stats: RouterStats
    _bs: int
    _tiers: dict[str, int]
    _tier_names: list[str]
    _slots: dict[int, Endpoint]
    _pending: OrderedDict
    _pending_by_hash: dict[object, list]
    _gen: int
    _py_touch: int

    # --- helpers --------------------------------------------------------------------------
    def _error(self, kind: str, msg: str, strict: bool) -> None:
        self.stats.errors[kind] = self.stats.errors.get(kind, 0) + 1
        if strict:
            raise RouterInputError(msg)

    def _tier(self, medium: str | None) -> int:
        name = "GPU" if medium is None else medium
        t = self._tiers.get(name)
        if t is None:
            if len(self._tiers) >= self._cfg.max_tiers:
                return -1
            t = self._tiers[name] = len(self._tiers)
            self._tier_names.append(name)
            self._py_touch += 1
        return t

    def _block_keys(self, ep: Endpoint, v: object) -> tuple[int | None, int]:
        """(last complete key, keys completed) of an engine block's learned value."""
        if type(v) is int:
            return v, (ep.block_size // self._bs) or 1  # type: ignore[return-value]
        k, _tail, n = v  # type: ignore[misc]
        return (k if n else None), n

    # --- one batch ------------------------------------------------------------------------
    def _apply_events(self, ep: Endpoint, events: list, strict: bool) -> None:
        """Apply one batch's events. The common shapes (engine block = canonical block,
        offload chunk = one block, every hash known) run inline; the rest goes to the
        general methods below."""
        stats = self.stats
        stats.events += len(events)
        self._py_touch += 1  # the C fast path's cached per-endpoint context may be stale now
        groups = self._cfg.groups
        tiers = self._tiers
        index = self._index
        C = self._bs
        lmap = ep.lmap
        odd = ep.odd
        lget = lmap.get
        for ev in events:
            cls = type(ev)
            if cls is BlockStored or cls is BlockRemoved:
                if ev.group_idx not in groups:
                    stats.ignored_group_events += 1
                    continue
                medium = ev.medium
                tier = tiers.get("GPU" if medium is None else medium)
                if tier is None:
                    tier = self._tier(medium)
                    if tier < 0:  # (a removal from a tier never indexed has nothing to remove)
                        if cls is BlockStored:
                            self._error("too_many_tiers", f"pod {ep.pod!r}: medium {medium!r} is one tier too "
                                        f"many (max_tiers={self._cfg.max_tiers})", strict)
                        continue
                if cls is BlockRemoved:
                    self._remove(ep, ev.block_hashes, tier)
                    continue
                hashes = ev.block_hashes
                toks = ev.token_ids
                if toks:
                    n = len(hashes)
                    ph = ev.parent_block_hash
                    if ev.block_size == C and n and len(toks) == n * C:
                        if ph is None:
                            pv = ep.seed if ev.lora_name is None and ev.lora_id is None else \
                                model_seed(ep.model, _lora(ev))
                        else:
                            pv = lget(ph)
                        if type(pv) is int:
                            keys = None
                            if hashes[0] in lmap:  # already learned (e.g. from another pod): no hashing
                                keys = list(map(lget, hashes))
                                if None in keys or (odd[0] and not all(type(k) is int for k in keys)):
                                    keys = None
                            if keys is None:
                                keys = chain_keys(toks, pv, C)
                                lmap.update(zip(hashes, keys))
                            if ep.block_size != C:
                                ep.block_size = C
                            if tier not in ep.token_tiers:
                                ep.token_tiers.add(tier)
                            stats.blocks_stored += n
                            index.add_chain(keys, 1 << (tier * index.cap + ep.slot), None if ph is None else pv)
                            if self._pending_by_hash:
                                self._resolve_pending(ep.model, hashes)
                            continue
                    self._store_tokens(ep, ev, tier, strict)
                    continue
                # offload store: no tokens; join by engine hash
                configured = self._cfg.offload_chunk_blocks.get(self._tier_names[tier])
                if configured is None:
                    ck = ep.chunk_keys.get(tier)
                    if ck != 1 and len(hashes) > 1:
                        self._infer_chunk(ep, tier, hashes)
                        ck = ep.chunk_keys.get(tier)
                    one = ck is None or ck == 1
                else:
                    one = configured == 1
                if one and ep.block_size == C and not odd[0]:
                    keys = list(map(lget, hashes))
                    if None not in keys:
                        stats.offload_blocks += len(keys)
                        index.add(keys, 1 << (tier * index.cap + ep.slot))
                        continue
                self._store_offload(ep, hashes, tier)
            elif cls is AllBlocksCleared:
                stats.clears += 1
                self._clear_endpoint(ep)
            else:
                self._error("unknown_event", f"pod {ep.pod!r}: not a KV event: {cls.__name__}", strict)

    # --- GPU-style stores (tokens) ----------------------------------------------------------
    def _store_tokens(self, ep: Endpoint, ev: BlockStored, tier: int, strict: bool) -> None:
        hashes = ev.block_hashes
        toks = ev.token_ids
        E = ev.block_size
        n = len(hashes)
        if E <= 0 or n == 0 or len(toks) != n * E:
            self._error("bad_block_stored", f"pod {ep.pod!r}: BlockStored with {n} hashes, block_size {E} and "
                        f"{len(toks)} token ids (want hashes * block_size)", strict)
            return
        C = self._bs
        lmap = ep.lmap
        ph = ev.parent_block_hash
        seed = model_seed(ep.model, _lora(ev))
        if ph is None:
            pv: object = seed
        else:
            pv = lmap.get(ph)
            if pv is None:
                self.stats.orphan_blocks += n
                return
        ep.block_size = E
        if tier not in ep.token_tiers:
            ep.token_tiers.add(tier)
        if E % C == 0 and type(pv) is int:
            m = E // C
            keys = None
            if m == 1 and hashes[0] in lmap:  # already learned (e.g. from another pod): no hashing
                keys = list(map(lmap.get, hashes))
                if None in keys or type(keys[-1]) is not int:
                    keys = None
            if keys is None:
                keys = chain_keys(toks, pv, C)  # type: ignore[arg-type]
                lmap.update(zip(hashes, keys if m == 1 else keys[m - 1 :: m]))
            parent = None if ph is None else pv
            self.stats.blocks_stored += n
            self._index.add_chain(keys, 1 << (tier * self._index.cap + ep.slot), parent)  # type: ignore[arg-type]
            if self._pending_by_hash:
                self._resolve_pending(ep.model, hashes)
            return
        else:
            keys, parent = self._store_general(lmap, hashes, toks, E, pv, seed)
            ep.odd[0] = True
        self.stats.blocks_stored += n
        if keys:
            self._index.add_chain(keys, 1 << (tier * self._index.cap + ep.slot), parent)  # type: ignore[arg-type]
        if self._pending_by_hash:
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
            ep.chunk_keys[tier] = g

    def _chunk_default(self, ep: Endpoint, tier: int, n: int) -> int:
        configured = self._cfg.offload_chunk_blocks.get(self._tier_names[tier])
        if configured is not None:
            return configured * n
        return ep.chunk_keys.get(tier, n)

    def _join(self, ep: Endpoint, tier: int, h: object) -> None:
        k, n = self._block_keys(ep, ep.lmap[h])
        self.stats.offload_blocks += 1
        if k is None:
            return
        index = self._index
        default = self._chunk_default(ep, tier, n)
        keys = [k] if default == 1 else index.walk_back(k, default)
        if len(keys) != default:
            ep.odd_chunks.setdefault(tier, {})[h] = len(keys)
        index.add(keys, 1 << (tier * index.cap + ep.slot))

    # --- pending offload events -----------------------------------------------------------
    def _hold(self, ep: Endpoint, tier: int, h: object) -> None:
        key = (h, ep.slot, tier)
        pending = self._pending
        if key in pending:
            pending.move_to_end(key)
            pending[key] = self.stats.batches
            return
        if len(pending) >= self._cfg.pending_capacity:
            old, _ = pending.popitem(last=False)
            self._unlink_pending(old)
            self.stats.pending_dropped += 1
        pending[key] = self.stats.batches
        self._pending_by_hash.setdefault(h, []).append(key)
        self.stats.pending_held += 1

    def _unlink_pending(self, key: tuple) -> None:
        lst = self._pending_by_hash.get(key[0])
        if lst is not None:
            try:
                lst.remove(key)
            except ValueError:
                pass
            if not lst:
                del self._pending_by_hash[key[0]]

    def _resolve_pending(self, model: str, hashes: list) -> None:
        by_hash = self._pending_by_hash
        for h in hashes:
            lst = by_hash.get(h)
            if not lst:
                continue
            for key in list(lst):
                ep = self._slots.get(key[1])
                if ep is None or ep.model != model or h not in ep.lmap:
                    continue
                del self._pending[key]
                lst.remove(key)
                self.stats.pending_resolved += 1
                self.stats.offload_blocks -= 1  # _join counts it again
                self._join(ep, key[2], h)
            if not lst:
                del by_hash[h]

    def _expire_pending(self) -> None:
        pending = self._pending
        horizon = self.stats.batches - self._cfg.pending_max_batches
        while pending:
            key = next(iter(pending))
            if pending[key] >= horizon:
                break
            del pending[key]
            self._unlink_pending(key)
            self.stats.pending_expired += 1

    def _drop_pending_of(self, slot: int) -> None:
        for key in [k for k in self._pending if k[1] == slot]:
            del self._pending[key]
            self._unlink_pending(key)
            self.stats.pending_cancelled += 1

    # --- removals -------------------------------------------------------------------------
    def _remove(self, ep: Endpoint, hashes: list, tier: int) -> None:
        lmap = ep.lmap
        index = self._index
        bit = 1 << (tier * index.cap + ep.slot)
        token_tier = tier in ep.token_tiers or (tier == 0 and not ep.token_tiers)
        odd = ep.odd_chunks.get(tier)
        for h in hashes:
            v = lmap.get(h)
            key = (h, ep.slot, tier)
            if key in self._pending:
                del self._pending[key]
                self._unlink_pending(key)
                self.stats.pending_cancelled += 1
                continue
            if v is None:
                self.stats.remove_unknown += 1
                continue
            self.stats.blocks_removed += 1
            k, n = self._block_keys(ep, v)
            if k is None:
                continue
            if token_tier:
                keys = [k] if n == 1 else index.walk_back(k, n)
            else:
                nk = odd.pop(h, None) if odd else None
                keys = index.walk_back(k, nk or self._chunk_default(ep, tier, n))
            index.remove(keys, bit)

    def _clear_endpoint(self, ep: Endpoint) -> None:
        self._py_touch += 1
        self._index.clear_bits(self._index.slot_bits(ep.slot))
        self._drop_pending_of(ep.slot)
        ep.odd_chunks.clear()
        if ep.unreliable:
            ep.unreliable = False
            self._gen += 1
