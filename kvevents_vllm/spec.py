"""``KVEventsOffloadingSpec``: our tiered offload manager and transfer workers as a vLLM spec.

Use it with vLLM's offloading connector::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "KVEventsOffloadingSpec",
                                      "cpu_bytes_to_use": 268435456,
                                      "kvevents": {"secondary_tiers": [{"type": "fs", "root": "/var/kv"}]}}}'

The plugin registers the name with vLLM's ``OffloadingSpecFactory``; without the plugin,
``"spec_module_path": "kvevents_vllm.spec"`` loads the same class. The keys are described in
:mod:`kvevents_vllm.config`; a bad key, an unknown tier type or an unsupported vLLM fails the
engine's start-up with one line naming it.

Scheduler side: :meth:`get_manager` is :class:`manager.spec_cpu.CPUOffloadingSpec`'s manager
(CPU tier, secondary tiers behind it) behind :class:`~kvevents_vllm.manager_adapter.KVEventsManagerAdapter`.
Worker side: :meth:`get_worker` is :class:`~kvevents_vllm.worker.KVEventsOffloadingWorker`.
The two share the host buffer through :mod:`kvevents_vllm.host`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from vllm.v1.kv_offload.base import OffloadingSpec as VllmOffloadingSpec

from kvevents.errors import ConfigError

from .config import PluginConfig, parse_extra_config
from .versions import check_vllm_version

log = logging.getLogger(__name__)

__all__ = ["SPEC_NAME", "KVEventsOffloadingSpec", "register_spec"]

#: the name vLLM's OffloadingSpecFactory knows our spec by (``"spec_name"``)
SPEC_NAME = "KVEventsOffloadingSpec"


def _check_tiers(cfg: PluginConfig) -> None:
    from manager.tiering import SecondaryTierFactory

    from .vllm_tiers import register_vllm_tiers

    register_vllm_tiers()
    for i, tier in enumerate(cfg.secondary_tiers):
        try:
            SecondaryTierFactory.get_tier_class(tier)
        except ConfigError as exc:
            raise ConfigError(f"kv_connector_extra_config['kvevents']['secondary_tiers'][{i}]: {exc}") from None


class KVEventsOffloadingSpec(VllmOffloadingSpec):
    """vLLM's spec role over our manager (scheduler side) and transfer workers (worker side)."""

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        """The CPU-tier metrics our manager's ``get_stats()`` reports (vLLM's names)."""
        from vllm.v1.kv_offload.base import OffloadingGaugeMetadata, OffloadingHistogramMetadata
        from vllm.v1.kv_offload.cpu.common import CPUOffloadingMetrics as M

        definitions = {
            M.CPU_CACHE_USAGE_PERC: OffloadingGaugeMetadata(
                documentation="Share of the CPU tier's blocks pinned by transfers in flight (0 to 1)."),
            M.CPU_CACHE_WRITE_USAGE_PERC: OffloadingGaugeMetadata(
                documentation="Share of the CPU tier's blocks reserved by stores not completed yet (0 to 1)."),
            M.CPU_CACHE_READ_USAGE_PERC: OffloadingGaugeMetadata(
                documentation="Share of the CPU tier's blocks pinned by loads not completed yet (0 to 1)."),
            M.CPU_ALLOCATION_SIZE: OffloadingHistogramMetadata(
                documentation="Blocks asked for by each store reservation in the CPU tier.",
                buckets=(1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)),
        }
        threshold = extra_config.get("store_threshold", 0) if isinstance(extra_config, Mapping) else 0
        if isinstance(threshold, int) and threshold >= 2:  # (a bad value is refused by __init__)
            from vllm.v1.kv_offload.base import OffloadingCounterMetadata

            definitions[M.STORES_SKIPPED] = OffloadingCounterMetadata(
                documentation="Blocks offered for store into the CPU tier and not stored: offered fewer than "
                              "store_threshold times so far.")
        return definitions

    def __init__(self, config: Any) -> None:
        self.vllm_release = check_vllm_version()
        super().__init__(config)
        self.plugin_config = parse_extra_config(self.extra_config)
        _check_tiers(self.plugin_config)
        self.world_size = max(1, int(config.parallel.world_size))
        self.num_chunks = self._num_chunks()
        self._manager: Any = None
        self._worker: Any = None

    def _num_chunks(self) -> int:
        cfg = self.plugin_config
        if cfg.cpu_blocks is not None:
            return cfg.cpu_blocks
        per_block = int(self.config.worker_kv_bytes_per_block) * self.world_size
        if per_block <= 0:
            return 0  # vLLM did not say the block size (checked where the blocks are needed)
        return int(cfg.cpu_bytes_to_use or 0) // (per_block * self.blocks_per_chunk)

    def _need_chunks(self) -> int:
        if self.num_chunks < 1:
            raise ConfigError(
                f"kv_connector_extra_config['cpu_bytes_to_use'] ({self.plugin_config.cpu_bytes_to_use}) holds no "
                f"offloaded block of {self.config.worker_kv_bytes_per_block * self.world_size * self.blocks_per_chunk}"
                " bytes; raise it or give 'kvevents': {'cpu_blocks': N}"
            )
        return self.num_chunks

    # -- scheduler side ------------------------------------------------------------------------
    def get_manager(self) -> Any:
        if self._manager is None:
            from manager.spec_cpu import CPUOffloadingSpec

            from .manager_adapter import KVEventsManagerAdapter

            cfg = self.plugin_config
            # a vLLM-written tier is built with vLLM's signature: it gets this spec
            tiers = [dict(t, offloading_spec=self) if t.get("type") == "vllm" else t for t in cfg.secondary_tiers]
            ours = CPUOffloadingSpec(self._need_chunks(), cache_policy=cfg.eviction_policy,
                                     enable_events=self.kv_events_config.enable_kv_cache_events,
                                     secondary_tiers=tiers, strict=cfg.strict,
                                     store_threshold=cfg.store_threshold, max_tracker_size=cfg.max_tracker_size)
            inner = ours.get_manager()
            self._manager = KVEventsManagerAdapter(inner, bind=self._binder(inner) if cfg.secondary_tiers else None)
        return self._manager

    def _binder(self, inner: Any):
        engine_id, world_size = self.config.engine_id, self.world_size

        def bind() -> bool:
            from .host import open_block_io

            io = open_block_io(engine_id, world_size)
            if io is None:
                return False
            inner.bind_block_io(io)
            return True

        return bind

    # -- worker side ---------------------------------------------------------------------------
    def get_worker(self, kv_caches: Any) -> Any:
        if self._worker is None:
            from .worker import KVEventsOffloadingWorker

            devices = {t.tensor.device.type for t in kv_caches.tensors}
            if not devices <= {"cpu", "cuda"}:
                raise ConfigError(f"KVEventsOffloadingSpec: KV cache on {sorted(devices)}; supported: cpu, cuda")
            self._worker = KVEventsOffloadingWorker(
                kv_caches, blocks_per_chunk=self.blocks_per_chunk, num_chunks=self._need_chunks(),
                engine_id=self.config.engine_id, rank=int(self.config.parallel.rank),
                shared=bool(self.plugin_config.secondary_tiers),  # only secondary tiers read it
            )
        return self._worker


def register_spec() -> None:
    """Make ``KVEventsOffloadingSpec`` known to vLLM's OffloadingSpecFactory (idempotent)."""
    try:
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory
    except ImportError as exc:  # a vLLM without kv_offload: nothing to register into
        log.warning("kvevents_vllm: vLLM has no OffloadingSpecFactory (%s); spec not registered", exc)
        return
    if SPEC_NAME not in OffloadingSpecFactory._registry:
        OffloadingSpecFactory.register_spec(SPEC_NAME, __name__, "KVEventsOffloadingSpec")
