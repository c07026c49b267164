"""Our managers under vLLM's class names and constructor signatures.

vLLM code (and vLLM's own unit tests, see ``benchmarks/vllm_unit_tally.py``) builds managers
directly: ``CPUOffloadingManager(num_chunks, cache_policy, ...)``,
``TieringOffloadingManager(primary_tier=..., secondary_tiers=[...])`` with vLLM-written tiers.
These classes build ours behind :class:`~kvevents_vllm.manager_adapter.KVEventsManagerAdapter`:

- :class:`CPUOffloadingManager`: our CPU tier (the built-in cache policies only: ours loads
  policies by name); ``store_threshold`` / ``max_tracker_size`` are our tier's store admission
  (:mod:`manager.admission`);
- :class:`CPUPrimaryTierOffloadingManager`: the same over vLLM's shared region (its
  ``create_kv_memoryview()`` is the host buffer secondary tiers move bytes through);
- :class:`TieringOffloadingManager`: our tiering manager over such a primary and vLLM-written
  tiers, each run by :class:`~kvevents_vllm.vllm_tiers.VllmTier`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvevents.errors import ConfigError
from manager.base import NumpyBlockIO
from manager.cpu import CPUOffloadingManager as OurCPUManager
from manager.tiering import TieringOffloadingManager as OurTieringManager

from .manager_adapter import KVEventsManagerAdapter
from .vllm_tiers import VllmTier

__all__ = ["CPUOffloadingManager", "CPUPrimaryTierOffloadingManager", "TieringOffloadingManager"]


class CPUOffloadingManager(KVEventsManagerAdapter):
    """vLLM's ``CPUOffloadingManager(num_chunks, cache_policy, ...)``, ours inside."""

    def __init__(self, num_chunks: int, cache_policy: str = "lru", cache_policy_module_path: str | None = None,
                 enable_events: bool = False, store_threshold: int = 1, max_tracker_size: int = 64_000,
                 info: Any = None) -> None:
        if cache_policy_module_path is not None:
            raise ConfigError("cache_policy_module_path is not supported: our cache policies are chosen by name")
        super().__init__(OurCPUManager(num_chunks, cache_policy, enable_events, "CPU",
                                       store_threshold=store_threshold, max_tracker_size=max_tracker_size))
        self.num_chunks = num_chunks


class CPUPrimaryTierOffloadingManager(CPUOffloadingManager):
    """vLLM's primary tier over a shared region: ``mmap_region.create_kv_memoryview()`` is the
    host buffer (``[num_chunks, chunk_bytes]``)."""

    def __init__(self, num_chunks: int, mmap_region: Any, cache_policy: str = "lru",
                 cache_policy_module_path: str | None = None, enable_events: bool = False, info: Any = None) -> None:
        super().__init__(num_chunks, cache_policy, cache_policy_module_path, enable_events, info=info)
        view = mmap_region.create_kv_memoryview()
        array = np.asarray(view)
        self.block_io = NumpyBlockIO(array.reshape(array.shape[0], -1).view(np.uint8))


class TieringOffloadingManager(KVEventsManagerAdapter):
    """vLLM's ``TieringOffloadingManager(primary_tier, secondary_tiers)``: our tiering manager,
    the vLLM-written tiers each behind a :class:`VllmTier`."""

    def __init__(self, primary_tier: CPUPrimaryTierOffloadingManager, secondary_tiers: list[Any] | None = None,
                 tier_poll_interval_s: float = 0.0) -> None:
        if not isinstance(primary_tier, CPUOffloadingManager):
            raise ConfigError(f"primary_tier must be this module's CPU manager, got {type(primary_tier).__name__}")
        io = getattr(primary_tier, "block_io", None)
        tiers = [VllmTier(getattr(t, "tier_type", "vllm"), tier=t) for t in (secondary_tiers or ())]
        super().__init__(OurTieringManager(primary_tier.inner, tiers, block_io=io))
        self.primary_tier = primary_tier
        self.secondary_tiers = list(secondary_tiers or ())
