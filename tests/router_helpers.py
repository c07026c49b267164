"""Event builders shared by the router tests."""

from __future__ import annotations

from kvevents import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

BS = 16


def toks(block: int, n: int = 1, bs: int = BS, salt: int = 0) -> list[int]:
    """Token ids of ``n`` blocks starting at block index ``block``: distinct per block."""
    out: list[int] = []
    for b in range(block, block + n):
        out.extend(1000 * (b + 1) + salt * 100_000 + i for i in range(bs))
    return out


def gpu(hashes, parent, tokens, bs=BS, lora=None, medium="GPU", group=None):
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=list(tokens),
                       block_size=bs, lora_id=None, medium=medium, lora_name=lora, group_idx=group)


def off(hashes, medium="CPU", parent=None):
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=[], block_size=0,
                       lora_id=None, medium=medium, lora_name=None)


def rm(hashes, medium="GPU"):
    return BlockRemoved(block_hashes=list(hashes), medium=medium)


def clear():
    return AllBlocksCleared()


def batch(*events, rank=None, ts=0.0):
    return KVEventBatch(ts=ts, events=list(events), data_parallel_rank=rank)
