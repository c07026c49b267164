"""The manager's one adapter to the wire: OffloadingEvents become kvevents events, and a
step's events become one :class:`~kvevents.events.KVEventBatch`.

* :func:`offload_events_to_kv_events`: one wire event per (OffloadingEvent, KV-cache group):
  ``BlockStored(block_size=0, token_ids=[], parent_block_hash=None, medium, group_idx)`` for
  stored blocks (offload events carry neither tokens nor a block size: consumers join them
  with the engine's GPU events by hash), ``BlockRemoved(medium, group_idx)`` for removed ones;
  hashes as vLLM sends them (the low 64 bits unsigned with ``int_hashes``, else the bytes);
  nothing for a ``never_stored`` removal (keys whose store failed were never sent as stored).
* :func:`assemble_batch`: the GPU events first, then the offload events, in one batch
  stamped with the publisher's data-parallel rank; None when there is nothing to send.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvevents.events import BlockRemoved, BlockStored, KVEvent, KVEventBatch

from .base import split_offload_key
from .hashing import wire_hash

__all__ = ["assemble_batch", "offload_events_to_kv_events"]


def offload_events_to_kv_events(events: Iterable[Any], *, int_hashes: bool = True) -> list[KVEvent]:
    """OffloadingEvents as kvevents: one event per (OffloadingEvent, KV-cache group)."""
    out: list[KVEvent] = []
    for ev in events:
        if getattr(ev, "never_stored", False):
            continue  # a failed store's keys: never announced, so nothing to take back
        by_group: dict[int, list[int | bytes]] = {}
        for key in ev.keys:
            block_hash, group = split_offload_key(key)
            by_group.setdefault(group, []).append(wire_hash(block_hash, int_hashes))
        for group, hashes in by_group.items():
            if ev.removed:
                out.append(BlockRemoved(block_hashes=hashes, medium=ev.medium, group_idx=group))
            else:
                out.append(
                    BlockStored(
                        block_hashes=hashes,
                        parent_block_hash=None,
                        token_ids=[],
                        block_size=0,
                        lora_id=None,
                        medium=ev.medium,
                        lora_name=None,
                        group_idx=group,
                    )
                )
    return out


def assemble_batch(
    gpu_events: Sequence[KVEvent], offload_events: Sequence[KVEvent], *, ts: float,
    data_parallel_rank: int | None = None,
) -> KVEventBatch | None:
    """One step's batch: GPU events, then offload events; None when both are empty."""
    if not gpu_events and not offload_events:
        return None
    return KVEventBatch(ts=ts, events=[*gpu_events, *offload_events], data_parallel_rank=data_parallel_rank)
