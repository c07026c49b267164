"""The NativeIngestor: the Ingestor's interface with encoded batches applied in C.

``apply_payload(pod, payload)`` hands the payload to ``consumers._fastpath.apply``, which
parses the msgpack itself and applies the common events without creating event objects,
straight into the native index's mask table and the learned tables: GPU stores of canonical
blocks, offload stores that join one key per hash, removals of one key per hash, kv-cache
groups not indexed, eviction over the entry budget. It checks the whole batch first; a batch it
does not take (the legacy encoding, bytes hashes, a release's missing fields, anything
malformed) comes back before anything changed and is decoded once by ``decode_batch`` for the
Python path (so a malformed payload raises the same :class:`kvevents.DecodeError`). Within a
batch, the first event that needs the general path (an unknown hash, an odd block size, a LoRA
chain start, a clear, a new tier...) and every event after it go through the Python path: C
hands back where those events lie in the payload and only they are decoded (each event is
decoded once: by C or by msgspec).

C reads no router state: it reads a per-endpoint *context* (a tuple :meth:`context` builds,
current while ``Endpoints.touch`` is unchanged; a stale one is rebuilt by calling
:meth:`context` from C, after the parse, so the batch is not parsed again), adds its counts to a
tally buffer this class owns (``array('q')``, folded into ``RouterStats`` by :meth:`sync`) and
returns what Python must still do: where it stopped, what it taught the endpoint. Either way
the index, the learned hashes and every counter end exactly as :class:`Ingestor` leaves them
(tests/test_router_fastpath.py compares both through this interface).
"""

from __future__ import annotations

import functools
from array import array

import msgspec

from kvevents.codec import decode_batch
from kvevents.events import KVEvent

from .ingest import Ingestor
from .keys import _FAST

__all__ = ["NativeIngestor", "available"]

_DEFAULT_GROUPS = frozenset({None, 0})
# tally slots (consumers/_fp_apply.h)
(T_BATCHES, T_EVENTS, T_STORED, T_OFFLOAD, T_REMOVED, T_UNKNOWN, T_IGNORED, T_LEARNED, T_ROOM,
 T_EVICTED_KEYS, T_EVICTED_ENTRIES) = range(11)
_STATS = (("batches", T_BATCHES), ("events", T_EVENTS), ("blocks_stored", T_STORED),
          ("offload_blocks", T_OFFLOAD), ("blocks_removed", T_REMOVED), ("remove_unknown", T_UNKNOWN),
          ("ignored_group_events", T_IGNORED))
# result statuses
ALL, REST, OVER, WHOLE, NO_CONTEXT = 0, 1, 2, 3, 4
_EVENTS = msgspec.msgpack.Decoder(list[KVEvent])  #: the events C left (the batch's own decoder, events only)


def _rest_events(payload, left: int, start: int, end: int) -> list:
    """The ``left`` events at bytes ``start:end`` of an encoded batch C stopped in (a msgpack
    array header in front of them: each of them decoded once, by msgspec; those before by C)."""
    if left < 16:
        head = bytes((0x90 | left,))
    elif left < 1 << 16:
        head = b"\xdc" + left.to_bytes(2, "big")
    else:
        head = b"\xdd" + left.to_bytes(4, "big")
    try:
        return _EVENTS.decode(head + payload[start:end])
    except (msgspec.DecodeError, UnicodeDecodeError):  # (C checked them; decode_batch names a fault)
        events = decode_batch(payload).events
        return events[len(events) - left:]


def available(config, accel) -> bool:
    """Whether a router with ``config`` and ``accel`` (its index's C table access,
    :func:`consumers.index.accelerator`; None where the backend has none) can ingest in C."""
    return _FAST is not None and config.groups == _DEFAULT_GROUPS and accel is not None


class NativeIngestor(Ingestor):
    native = True

    def __init__(self, config, endpoints, index, learned, stats, accel) -> None:
        super().__init__(config, endpoints, index, learned, stats)
        self._accel = accel  #: the native backend's TableAccess: C writes its table directly
        self._c_apply = _FAST.apply
        self._tally = array("q", [0] * _FAST.TALLY_SLOTS)
        self._contexts: dict[str, dict[int, tuple]] = {}  #: pod -> rank -> context
        self.sync()
        # the C front half (no Python frame for a batch C applies entirely); it hands whatever
        # is left to finish_payload and calls expire_pending while joins wait
        self.apply_payload = functools.partial(  # type: ignore[method-assign]
            _FAST.ingest, self._contexts, self.eps, self.pending_by_hash, self.pending, self._tally,
            self.finish_payload, self.expire_pending, self.context)

    def sync(self, recount: bool = True) -> None:
        """Fold C's tally into the counters; ``recount=False`` leaves the learned budget's
        eviction to the end of the batch (as the Python path does) when Python goes on with it."""
        t = self._tally
        if t[T_BATCHES] or t[T_EVICTED_KEYS]:
            stats = self._stats
            for name, slot in _STATS:
                if t[slot]:
                    setattr(stats, name, getattr(stats, name) + t[slot])
            learned = self._learned
            learned.size += t[T_LEARNED]
            self._accel.evicted(t[T_EVICTED_KEYS], t[T_EVICTED_ENTRIES])
            for i in range(len(t)):
                t[i] = 0
            if recount and learned.size > learned.max_size:
                learned.recount()
        t[T_ROOM] = self._learned.max_size - self._learned.size

    def learned_changed(self) -> None:
        self._tally[T_ROOM] = self._learned.max_size - self._learned.size

    def forget_pod(self, pod: str) -> None:
        self._contexts.pop(pod, None)

    def apply_payload(self, pod: str, payload: bytes, *, model: str | None = None, strict: bool = False) -> None:
        """(Replaced per instance by the C front half, ``consumers._fastpath.ingest``.)"""
        raise NotImplementedError

    def expire_pending(self) -> None:
        """Joins wait: expire those held too many batches."""
        self.sync()
        self._expire_pending()

    def finish_payload(self, pod: str, payload: bytes, model: str | None, strict: bool, out: tuple | None) -> None:
        """What C left to Python (``out``: its result; None: the whole batch, joins wait)."""
        if out is None:
            self.apply(pod, decode_batch(payload), model=model, strict=strict)
            return
        self._finish(pod, payload, model, strict, self._contexts[pod], out)

    def _finish(self, pod: str, payload: bytes, model: str | None, strict: bool, ctxs: dict, out: tuple) -> None:
        """What C left to Python: a context to build, the whole batch or the rest of it, what it
        taught the endpoint, the learned map over its budget."""
        status, nxt, block_size, token_mask, rank, left, start, end = out
        if status == NO_CONTEXT:  # (nothing applied yet; only from a bare _fastpath.apply)
            ctxs[rank] = self.context(pod, rank, model)
            out = self._c_apply(payload, ctxs, self.eps.touch, self._tally)
            if out is not None:
                if out[0] == NO_CONTEXT:
                    raise RuntimeError("consumers._fastpath.apply refused a fresh context")
                self._finish(pod, payload, model, strict, ctxs, out)
            return
        if status == WHOLE:
            self.apply(pod, decode_batch(payload), model=model, strict=strict)
            return
        ep = self.eps.by_key[(pod, rank)]
        if block_size != ep.block_size or token_mask != self._token_mask(ep):
            ep.block_size = block_size
            ep.token_tiers.update(t for t in range(64) if token_mask >> t & 1)
            self.eps.touch += 1
        self.sync(recount=status != REST)  # (mid-batch: the learned budget is enforced after the rest)
        if status == REST:
            n0 = len(ep.lmap)
            self.apply_events(ep, _rest_events(payload, left, start, end), strict)
            learned = self._learned
            learned.size += len(ep.lmap) - n0
            if learned.size > learned.max_size:
                learned.recount()
            self.learned_changed()
        if self.eps.touch != ctxs[rank][0]:
            ctxs[rank] = self.context(pod, rank, model)  # the next batch from here finds it current

    @staticmethod
    def _token_mask(ep) -> int:
        """Token tiers whose blocks are the endpoint's block size (a tier of self-describing
        offload chunks of another size is left to Python)."""
        m = 0
        for t in ep.token_tiers:
            if t not in ep.tier_bs:
                m |= 1 << t
        return m

    def context(self, pod: str, rank: int, model: str | None) -> tuple:
        """The endpoint's context for C (consumers/_fp_apply.h ``ctx_from``), current while
        ``Endpoints.touch`` is unchanged (the Python path may change chunk lengths, odd chunks,
        token tiers, the slot layout or the tiers)."""
        ep = self.eps.by_key.get((pod, rank))
        if ep is None:
            ep = self.eps.get(pod, rank, model)
        accel = self._accel
        cap = accel.cap
        configured = self._cfg.offload_chunk_blocks
        names = tuple(self.eps.tier_names)
        bits, store_chunk, remove_one = [], [], []
        for t, name in enumerate(names):
            bits.append(t * cap + ep.slot)  # the bit's number in the MaskTable
            conf = configured.get(name)
            ck = ep.chunk_keys.get(t)
            # how an offload store joins: 0 one key per hash; 1 the same if the event has one
            # hash (else the chunk length is inferred in Python); 2 Python
            if conf is not None:
                store_chunk.append(0 if conf == 1 else 2)
                default = conf
            else:  # (unknown: Python infers it from the first join's chain depth)
                store_chunk.append(0 if ck == 1 else 2)
                default = 1 if ck is None else ck
            remove_one.append(default == 1 and not ep.odd_chunks.get(t) and t not in ep.tier_bs)
        return (self.eps.touch, ep.lmap, accel.table, ep.seed, self._bs, ep.odd, ep.block_size,
                self._token_mask(ep), names, tuple(bits), tuple(store_chunk), tuple(remove_one), accel.max_entries,
                accel.low_water)
