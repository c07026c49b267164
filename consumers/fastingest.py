"""``KVRouter.apply_payload``: feeding the router encoded batches, in C where it is built.

``apply(pod, batch)`` takes a decoded :class:`~kvevents.events.KVEventBatch`; building those
Python objects (msgspec's decode) costs as much as indexing them. ``apply_payload(pod,
payload)`` takes the payload bytes of a PUB frame instead. Where the optional C extension is
built (:mod:`consumers._accel`), it parses the msgpack itself and applies the common events
without creating event objects, straight into the index's C mask table
(:class:`consumers.index.NativeBlockIndex`): GPU stores of canonical-size blocks, offload stores that join
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

import functools
from typing import TYPE_CHECKING

from kvevents.codec import decode_batch

from .keys import _FAST

if TYPE_CHECKING:  # pragma: no cover
    from .ingest import Endpoint

__all__ = ["FastIngestMixin"]

_DEFAULT_GROUPS = frozenset({None, 0})


class FastIngestMixin:
    def apply_payload(self, pod: str, payload: bytes, *, model: str | None = None, strict: bool = False) -> None:
        """Feed one encoded batch from ``pod``: the same effect as ``apply(pod,
        decode_batch(payload))`` (a malformed payload raises :class:`kvevents.DecodeError`).

        Where the C extension is in use, each router binds this name to its C version
        (``_bind_fast``); this method is the Python path."""
        self._apply_payload_py(pod, payload, model, strict)

    def _bind_fast(self) -> None:
        """Shadow ``apply_payload`` with the C version for this router, where it applies."""
        if _FAST is not None and self._cfg.groups == _DEFAULT_GROUPS:  # type: ignore[attr-defined]
            self.apply_payload = functools.partial(  # type: ignore[method-assign]
                _FAST.apply_payload, self, self._fast_ctxs, self._pending_by_hash, self._pending)  # type: ignore[attr-defined]

    def _apply_payload_py(self, pod: str, payload: bytes, model: str | None, strict: bool) -> None:
        """The Python path: no C extension, kv-cache groups other than the default, or offload
        events held for their GPU events (the C version hands those batches here)."""
        self.apply(pod, decode_batch(payload), model=model, strict=strict)  # type: ignore[attr-defined]

    def _fast_rest(self, pod: str, payload: bytes, model: str | None, strict: bool, contexts: dict,
                   out: tuple) -> None:
        """What C left to Python: the whole batch, the rest of it, an eviction, a changed
        endpoint, the learned map over its budget."""
        fast = _FAST
        learned = self._learned  # type: ignore[attr-defined]
        while True:
            status, nxt, changed, block_size, token_mask, over, ep = out
            if status == 3:  # nothing applied: the whole batch needs the Python decoder
                self.apply(pod, decode_batch(payload), model=model, strict=strict)  # type: ignore[attr-defined]
                return
            if changed:
                ep.block_size = block_size
                ep.token_tiers.update(t for t in range(64) if token_mask >> t & 1)
                self._py_touch += 1
            if status == 2:  # over the entry budget: evict, then go on from the next event
                self._index.evict()  # type: ignore[attr-defined]
                out = fast.apply(payload, nxt, contexts, self._py_touch, self._fast_ctx, pod, model)
                if out is None:
                    return
                continue
            if status == 1:  # the rest of the batch through the Python path
                n0 = len(ep.lmap)
                self._apply_events(ep, decode_batch(payload).events[nxt:], strict)  # type: ignore[attr-defined]
                learned.size += len(ep.lmap) - n0
            break
        if learned.size > learned.max_size:
            learned.recount()

    def _fast_ctx(self, pod: str, model: str | None, rank: int) -> tuple:
        """The endpoint's context for the C fast path, cached per (pod, rank) until the Python
        path next runs (``_py_touch``: it may change chunk lengths, odd chunks, token tiers,
        the slot layout or the tiers)."""
        ep = self._endpoints.get((pod, rank))  # type: ignore[attr-defined]
        if ep is None:
            ep = self._endpoint(pod, rank, model)  # type: ignore[attr-defined]
        index = self._index  # type: ignore[attr-defined]
        configured = self._cfg.offload_chunk_blocks  # type: ignore[attr-defined]
        names = tuple(self._tier_names)  # type: ignore[attr-defined]
        bits, store_chunk, remove_one = [], [], []
        for t, name in enumerate(names):
            bits.append(t * index.cap + ep.slot)  # the bit's number in the MaskTable
            conf = configured.get(name)
            ck = ep.chunk_keys.get(t)
            # how an offload store joins: 0 one key per hash; 1 the same if the event has one
            # hash (else the chunk length is inferred in Python); 2 Python
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
        ctx = (self._py_touch, ep, ep.lmap, index.masks, ep.seed, self._bs, ep.odd, ep.block_size,
               token_mask, names, tuple(bits), tuple(store_chunk), tuple(remove_one), index.max_entries,
               self.stats, self._learned)
        self._fast_ctxs.setdefault(pod, {})[rank] = ctx
        return ctx
