"""``KVRouter.apply_payload``: feeding the router encoded batches, in C where it is built.

``apply(pod, batch)`` takes a decoded :class:`~kvevents.events.KVEventBatch`; building those
Python objects (msgspec's decode) costs as much as indexing them. ``apply_payload(pod,
payload)`` takes the payload bytes of a PUB frame instead. Where the optional C extension is
built (:mod:`consumers._accel`), it parses the msgpack itself and applies the common events
without creating event objects: GPU stores of canonical-size blocks, offload stores that join
one key per hash, removals of one key per hash, kv-cache groups that are not indexed. It
checks the whole batch first; a batch it does not fully understand (the legacy encoding, bytes
hashes, a release's missing fields, anything malformed) goes to ``decode_batch`` and the
Python path before anything was changed, so a malformed payload raises the same
:class:`kvevents.DecodeError` and changes nothing. Within a batch, the first event that
needs the general path (an unknown hash, an odd block size, a LoRA chain start, a clear, a
new tier...) and every event after it go through the Python path. Either way the index, the
learned hashes and every counter end exactly as ``apply`` leaves them (tests compare both).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvevents.codec import decode_batch

from .index import _COMPACT_EVERY
from .keys import _FAST

if TYPE_CHECKING:  # pragma: no cover
    from .ingest import Endpoint

__all__ = ["FastIngestMixin"]

_DEFAULT_GROUPS = frozenset({None, 0})


class FastIngestMixin:
    def apply_payload(self, pod: str, payload: bytes, *, model: str | None = None, strict: bool = False) -> None:
        """Feed one encoded batch from ``pod``: the same effect as ``apply(pod,
        decode_batch(payload))`` (a malformed payload raises :class:`kvevents.DecodeError`)."""
        fast = _FAST
        if fast is None or self._pending_by_hash or self._cfg.groups != _DEFAULT_GROUPS:  # type: ignore[attr-defined]
            self.apply(pod, decode_batch(payload), model=model, strict=strict)  # type: ignore[attr-defined]
            return
        self._fast_n0 = -1
        out = fast.apply(payload, 0, self._fast_ctx, pod, model)
        if out[0] == 3:  # nothing applied: the whole batch needs the Python decoder
            self.apply(pod, decode_batch(payload), model=model, strict=strict)  # type: ignore[attr-defined]
            return
        ep: Endpoint = self._fast_ep
        stats = self.stats  # type: ignore[attr-defined]
        stats.batches += 1
        while True:
            status, nxt = out[0], out[1]
            self._fast_account(ep, out)
            if status == 2:  # the index's bookkeeping ran; go on from the next event
                out = fast.apply(payload, nxt, self._fast_ctx, pod, model)
                continue
            if status == 1:  # the rest of the batch through the Python path
                self._apply_events(ep, decode_batch(payload).events[nxt:], strict)  # type: ignore[attr-defined]
            break
        if self._pending:  # type: ignore[attr-defined]
            self._expire_pending()  # type: ignore[attr-defined]
        learned = self._learned  # type: ignore[attr-defined]
        learned.size += len(ep.lmap) - self._fast_n0
        if learned.size > learned.max_size:
            learned.recount()

    def _fast_account(self, ep: Endpoint, out: tuple) -> None:
        (_status, _nxt, events, stored, offload, removed_blocks, unknown, ignored, added, moved, removed,
         block_size, token_mask, _rank) = out
        stats = self.stats  # type: ignore[attr-defined]
        stats.events += events
        if stored:
            stats.blocks_stored += stored
        if offload:
            stats.offload_blocks += offload
        if removed_blocks:
            stats.blocks_removed += removed_blocks
        if unknown:
            stats.remove_unknown += unknown
        if ignored:
            stats.ignored_group_events += ignored
        index = self._index  # type: ignore[attr-defined]
        index.entries -= removed
        index._added(added, moved)  # counts, and compaction/eviction exactly where apply() runs them
        if block_size != ep.block_size:
            ep.block_size = block_size
        cached = ep.fast_tiers
        if cached is not None and token_mask != cached[7]:
            ep.token_tiers.update(t for t in range(64) if token_mask >> t & 1)
            ep.fast_tiers = None

    def _fast_ctx(self, pod: str, model: str | None, rank: int | None) -> tuple:
        """The endpoint's context for the C fast path (see ``consumers/_fastpath.c``)."""
        ep = self._endpoints.get((pod, rank or 0))  # type: ignore[attr-defined]
        if ep is None:
            ep = self._endpoint(pod, rank, model)  # type: ignore[attr-defined]
        self._fast_ep = ep
        if self._fast_n0 < 0:
            self._fast_n0 = len(ep.lmap)
        index = self._index  # type: ignore[attr-defined]
        names = self._tier_names  # type: ignore[attr-defined]
        t = ep.fast_tiers
        if t is None or t[0] != index.cap or len(t[3]) != len(names) or t[2] != self._py_touch:
            t = ep.fast_tiers = self._fast_tiers(ep)
        return (ep.lmap, index.masks, index.parents, index.intern, ep.seed, self._bs, ep.odd[0], ep.block_size,
                t[7], t[3], t[4], t[5], t[6], index.entries, index.max_entries, index.moves, _COMPACT_EVERY)

    def _fast_tiers(self, ep: Endpoint) -> tuple:
        """Per tier: name, this endpoint's bit, how offload stores join, whether a removal is
        one key per hash; and the mask of tiers whose stores carried tokens. Cached on the
        endpoint; stale once the Python path has run (``_py_touch``: it may have changed chunk
        lengths, odd chunks or token tiers), or the slot layout or the tiers changed."""
        index = self._index  # type: ignore[attr-defined]
        names = tuple(self._tier_names)  # type: ignore[attr-defined]
        configured = self._cfg.offload_chunk_blocks  # type: ignore[attr-defined]
        bits, store_chunk, remove_one = [], [], []
        for t, name in enumerate(names):
            bits.append(1 << (t * index.cap + ep.slot))
            conf = configured.get(name)
            ck = ep.chunk_keys.get(t)
            if conf is not None:
                store_chunk.append(0 if conf == 1 else 2)
                default = conf
            else:
                store_chunk.append(0 if ck == 1 else 1 if ck is None else 2)
                default = 1 if ck is None else ck
            remove_one.append(default == 1 and not ep.odd_chunks.get(t))
        token_mask = 0
        for t in ep.token_tiers:
            token_mask |= 1 << t
        return (index.cap, None, self._py_touch, names, tuple(bits), tuple(store_chunk), tuple(remove_one),
                token_mask)
