"""A GPU prefix cache for the simulated engine: hash-chained token blocks, a free queue with
LRU reuse, and the engine's GPU events.

Blocks are ``0 .. num_blocks-1``. A block in use has a ref count > 0; a block whose count
drops to 0 goes to the back of the free queue but keeps its hash, so a later request can
hit it; allocation takes from the front (least recently freed), evicting the cached hash
there (a GPU ``BlockRemoved``). A request frees its blocks tail first, so its tail is
evicted before its prefix.

When blocks become full and computed they are cached: one GPU ``BlockStored`` per call,
carrying the blocks' hashes, the parent hash, the token ids and the block size (what lets
consumers learn block sizes and join the offload events, which carry none).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from kvevents.events import MEDIUM_GPU, BlockRemoved, BlockStored, KVEvent

from .hashing import wire_hash

__all__ = ["GPUPrefixCache", "OutOfBlocksError"]


class OutOfBlocksError(RuntimeError):
    """Not enough free GPU blocks for an allocation."""


class GPUPrefixCache:
    """``num_blocks`` GPU blocks of ``block_size`` tokens with prefix caching."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        int_hashes: bool = True,
        enable_events: bool = True,
        medium: str = MEDIUM_GPU,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1 (got {num_blocks}, {block_size})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.int_hashes = int_hashes
        self.enable_events = enable_events
        self.medium = medium
        self._ref = [0] * num_blocks
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._events: list[KVEvent] = []
        # counters
        self.hit_blocks = 0
        self.queried_blocks = 0
        self.evictions = 0
        self.blocks_cached = 0
        self.duplicate_blocks = 0

    # --- queries ----------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (never used, or cached and unreferenced)."""
        return len(self._free)

    def cached_hashes(self) -> set[bytes]:
        return set(self._cached)

    def block_hash(self, block_id: int) -> bytes | None:
        return self._hash_of[block_id]

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def find_prefix(self, block_hashes: Sequence[bytes], max_blocks: int | None = None) -> list[int]:
        """Block ids of the longest cached prefix of ``block_hashes`` (at most ``max_blocks``)."""
        hits: list[int] = []
        limit = len(block_hashes) if max_blocks is None else min(max_blocks, len(block_hashes))
        for h in block_hashes[:limit]:
            b = self._cached.get(h)
            if b is None:
                break
            hits.append(b)
        self.queried_blocks += limit
        self.hit_blocks += len(hits)
        return hits

    # --- allocation -------------------------------------------------------------------------
    def allocate(self, hit_block_ids: Sequence[int], num_new: int) -> list[int]:
        """Reference the hit blocks and take ``num_new`` fresh ones; returns all, in order.

        OutOfBlocksError (and nothing changed) when the free queue cannot supply them."""
        free = self._free
        reusable = sum(1 for b in hit_block_ids if self._ref[b] == 0)
        if num_new > len(free) - reusable:
            raise OutOfBlocksError(f"need {num_new} new GPU blocks, {len(free) - reusable} free")
        for b in hit_block_ids:
            if self._ref[b] == 0:
                del free[b]
            self._ref[b] += 1
        new = [self._take() for _ in range(num_new)]
        return list(hit_block_ids) + new

    def can_allocate(self, hit_block_ids: Sequence[int], num_new: int) -> bool:
        reusable = sum(1 for b in hit_block_ids if self._ref[b] == 0)
        return num_new <= len(self._free) - reusable

    def _take(self) -> int:
        b, _ = self._free.popitem(last=False)
        h = self._hash_of[b]
        if h is not None:
            self._hash_of[b] = None
            if self._cached.get(h) == b:
                del self._cached[h]
                self.evictions += 1
                if self.enable_events:
                    self._events.append(
                        BlockRemoved(block_hashes=[wire_hash(h, self.int_hashes)], medium=self.medium)
                    )
        self._ref[b] = 1
        return b

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block; unreferenced ones join the free queue, tail first."""
        for b in reversed(block_ids):
            r = self._ref[b] - 1
            if r < 0:
                raise ValueError(f"GPU block {b} freed more often than allocated")
            self._ref[b] = r
            if r == 0:
                self._free[b] = None

    # --- caching ----------------------------------------------------------------------------
    def cache_blocks(
        self,
        block_ids: Sequence[int],
        block_hashes: Sequence[bytes],
        token_ids: Sequence[int],
        parent_hash: bytes | None,
        *,
        lora_id: int | None = None,
        lora_name: str | None = None,
    ) -> int:
        """Mark full, computed blocks as cached under their hashes and emit one BlockStored.

        ``token_ids`` are the blocks' tokens, ``block_size`` per block, in order. A hash that
        is already cached in another block leaves this block uncached (counted). Returns how
        many blocks became cached."""
        if len(block_ids) != len(block_hashes) or len(token_ids) != len(block_ids) * self.block_size:
            raise ValueError(
                f"cache_blocks: {len(block_ids)} blocks, {len(block_hashes)} hashes, "
                f"{len(token_ids)} tokens (block size {self.block_size})"
            )
        before = self.blocks_cached
        run_start = -1  # index of the first block of the current run of newly cached blocks
        for i, (b, h) in enumerate(zip(block_ids, block_hashes)):
            is_new = self._hash_of[b] != h and h not in self._cached
            if not is_new and self._hash_of[b] != h:
                self.duplicate_blocks += 1  # same content cached in another block
            if is_new:
                self._hash_of[b] = h
                self._cached[h] = b
                if run_start < 0:
                    run_start = i
            elif run_start >= 0:
                self._emit_run(block_hashes, token_ids, parent_hash, run_start, i, lora_id, lora_name)
                run_start = -1
        if run_start >= 0:
            self._emit_run(block_hashes, token_ids, parent_hash, run_start, len(block_ids), lora_id, lora_name)
        return self.blocks_cached - before

    def _emit_run(self, hashes, token_ids, parent_hash, i, j, lora_id, lora_name) -> None:
        bs = self.block_size
        parent = hashes[i - 1] if i > 0 else parent_hash
        self._emit(list(hashes[i:j]), list(token_ids[i * bs : j * bs]), parent, lora_id, lora_name)

    def _emit(self, hashes: list[bytes], tokens: list[int], parent: bytes | None, lora_id, lora_name) -> None:
        self.blocks_cached += len(hashes)
        if not self.enable_events:
            return
        w = self.int_hashes
        self._events.append(
            BlockStored(
                block_hashes=[wire_hash(h, w) for h in hashes],
                parent_block_hash=None if parent is None else wire_hash(parent, w),
                token_ids=list(tokens),
                block_size=self.block_size,
                lora_id=lora_id,
                medium=self.medium,
                lora_name=lora_name,
            )
        )

    def reset(self) -> None:
        """Forget the cached hash of every unreferenced block (one BlockRemoved for them)."""
        dropped = [h for h, b in self._cached.items() if self._ref[b] == 0]
        for h in dropped:
            self._hash_of[self._cached.pop(h)] = None
        if dropped and self.enable_events:
            w = self.int_hashes
            self._events.append(BlockRemoved(block_hashes=[wire_hash(h, w) for h in dropped], medium=self.medium))

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events
