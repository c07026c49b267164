"""``CPUOffloadingSpec`` (spec ``"cpu"``): a CPU primary tier, optionally with secondary tiers
behind it (a :class:`~manager.tiering.TieringOffloadingManager`), from one config::

    spec = CPUOffloadingSpec(4096, cache_policy="arc",
                             secondary_tiers=[{"type": "fs", "root": "/var/kv", "capacity_blocks": 65536}])
    manager = spec.get_manager()               # scheduler side
    handlers = spec.create_handlers(kv_cache)  # worker side: transfer worker + host BlockIO
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvevents.errors import ConfigError

from .admission import check_admission_settings
from .base import OffloadingManager
from .cpu import CPUOffloadingManager
from .spec import OffloadingSpec

__all__ = ["CPUOffloadingSpec"]


class CPUOffloadingSpec(OffloadingSpec):
    """``num_blocks`` host blocks under ``cache_policy``; ``secondary_tiers``: tier configs for
    :meth:`~manager.tiering.SecondaryTierFactory.create_secondary_tier` (in lookup order);
    ``strict``: the tiering manager's request-lifecycle strict mode; ``store_threshold`` /
    ``max_tracker_size``: the CPU tier's store admission (:mod:`manager.admission`; a threshold
    >= 2 without secondary tiers only: it would refuse their promotions too)."""

    def __init__(
        self,
        num_blocks: int,
        *,
        cache_policy: str = "lru",
        enable_events: bool = True,
        medium: str = "CPU",
        secondary_tiers: Sequence[dict[str, Any]] = (),
        strict: bool = False,
        store_threshold: int = 0,
        max_tracker_size: int = 64_000,
        **kw: Any,
    ) -> None:
        super().__init__(**kw)
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ConfigError(f"CPUOffloadingSpec: num_blocks must be a positive int, got {num_blocks!r}")
        if isinstance(secondary_tiers, (dict, str)) or not all(isinstance(t, dict) for t in secondary_tiers):
            raise ConfigError("CPUOffloadingSpec: secondary_tiers must be a list of tier configs (dicts)")
        check_admission_settings(store_threshold, max_tracker_size, "CPUOffloadingSpec: ")
        if store_threshold >= 2 and secondary_tiers:
            raise ConfigError("CPUOffloadingSpec: store_threshold >= 2 cannot be used with secondary_tiers "
                              "(their promotions into the CPU tier would be refused by its admission filter)")
        self.store_threshold, self.max_tracker_size = store_threshold, max_tracker_size
        self.num_blocks = num_blocks
        self.cache_policy = cache_policy
        self.enable_events = enable_events
        self.medium = medium
        self.secondary_tiers = [dict(t) for t in secondary_tiers]
        self.strict = strict

    def create_manager(self) -> OffloadingManager:
        primary = CPUOffloadingManager(self.num_blocks, self.cache_policy, self.enable_events, self.medium,
                                       store_threshold=self.store_threshold, max_tracker_size=self.max_tracker_size)
        if not self.secondary_tiers:
            return primary
        from .tiering import SecondaryTierFactory, TieringOffloadingManager

        tiers = [SecondaryTierFactory.create_secondary_tier(dict(t)) for t in self.secondary_tiers]
        return TieringOffloadingManager(primary, tiers, strict=self.strict)

    def num_host_blocks(self) -> int:
        return self.num_blocks
