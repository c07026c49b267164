"""The :class:`OffloadingSpec` role: one config builds both sides of offloading.

As in vLLM's kv_offload, a spec is what an engine is configured with. The scheduler side asks
it for the manager (:meth:`OffloadingSpec.get_manager`, built once); the worker side hands it
the device KV cache and gets the transfer worker and the host buffer's block I/O
(:meth:`OffloadingSpec.create_handlers`, vLLM's ``get_handlers``). The manager is told about
the host buffer through its role (:meth:`~manager.base.OffloadingManager.bind_block_io`), so
nobody reaches past it to wire tiers.

Specs are registered by name and imported on first use (:data:`SPECS`, a
:class:`kvevents.registry.LazyRegistry`): ``create_spec({"spec": "cpu", "num_blocks": 4096,
"secondary_tiers": [{"type": "fs", ...}]})``. :class:`ManagerSpec` wraps a manager built by
hand (what ``SimEngine(manager, ...)`` does).

``create_handlers`` differs from vLLM's ``get_handlers`` in shape: vLLM yields
``(src_type, dst_type, handler)`` per direction; ours returns one :class:`OffloadingHandlers`
(a worker that copies both ways, and the host buffer as a :class:`~manager.base.BlockIO`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvevents.errors import ConfigError
from kvevents.registry import LazyRegistry

from .base import BlockIO, NumpyBlockIO, OffloadingManager
from .transfer_base import NumpyTransferWorker, TransferWorker, as_layers

__all__ = ["SPECS", "ManagerSpec", "OffloadingHandlers", "OffloadingSpec", "create_spec", "create_transfer_worker",
           "register_spec"]


@dataclass(slots=True)
class OffloadingHandlers:
    """The worker side one spec built: the transfer worker (device <-> host rows, in device
    blocks), the host buffer seen one offloaded block per row, and that block count."""

    worker: TransferWorker
    host_block_io: BlockIO
    host_blocks: int


def create_transfer_worker(device_cache: Any, host_blocks: Any) -> TransferWorker:
    """A numpy worker for a numpy array or a list of them (torch is not imported), else the
    torch worker (:func:`manager.transfer.TorchTransferWorker`: CUDA streams or a CPU thread).
    ``host_blocks``: a number of host blocks, or host arrays/tensors (one per layer)."""
    layers = as_layers(device_cache)
    if layers and isinstance(layers[0], np.ndarray):
        return NumpyTransferWorker(device_cache, host_blocks)
    from .transfer import TorchTransferWorker  # needs torch: imported only here

    return TorchTransferWorker(device_cache, host_blocks)


class OffloadingSpec(ABC):
    """Builds the manager, the transfer worker and the host block I/O from one config.

    ``offloaded_block_size``: tokens per offloaded block (None: the engine's GPU block size).
    ``extra_config``: free-form entries a spec may read (vLLM's ``kv_connector_extra_config``).
    """

    def __init__(self, *, offloaded_block_size: int | None = None, extra_config: dict[str, Any] | None = None) -> None:
        if offloaded_block_size is not None and (
            isinstance(offloaded_block_size, bool) or not isinstance(offloaded_block_size, int)
            or offloaded_block_size < 1
        ):
            raise ConfigError(f"offloaded_block_size must be a positive int or None, got {offloaded_block_size!r}")
        self.offloaded_block_size = offloaded_block_size
        self.extra_config = dict(extra_config or {})
        self._manager: OffloadingManager | None = None

    # -- scheduler side ---------------------------------------------------------------------
    @abstractmethod
    def create_manager(self) -> OffloadingManager:
        """A new manager for this config (called once, by :meth:`get_manager`)."""

    def get_manager(self) -> OffloadingManager:
        """The manager the scheduler-side connector drives (built on first call, then the same)."""
        if self._manager is None:
            self._manager = self.create_manager()
        return self._manager

    def num_host_blocks(self) -> int:
        """How many offloaded blocks the host buffer holds: the manager's ``num_blocks``."""
        n = self.get_manager().num_blocks
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(
                f"{type(self).__name__}: the manager has no num_blocks ({n!r}) to size the host buffer; "
                "give host_blocks"
            )
        return n

    # -- worker side ------------------------------------------------------------------------
    def create_handlers(self, device_cache: Any, *, blocks_per_chunk: int = 1,
                        host_blocks: int | None = None) -> OffloadingHandlers:
        """The transfer worker for ``device_cache`` (a numpy array or a torch tensor shaped
        ``[num_device_blocks, ...]``) over a host buffer of ``host_blocks`` offloaded blocks
        (default :meth:`num_host_blocks`) of ``blocks_per_chunk`` device blocks each; the host
        buffer's :class:`BlockIO` is bound to the manager (its tiers move bytes through it)."""
        if isinstance(blocks_per_chunk, bool) or not isinstance(blocks_per_chunk, int) or blocks_per_chunk < 1:
            raise ConfigError(f"blocks_per_chunk must be a positive int, got {blocks_per_chunk!r}")
        n = self.num_host_blocks() if host_blocks is None else int(host_blocks)
        if n < 1:
            raise ConfigError(f"host_blocks must be >= 1, got {host_blocks!r}")
        worker = create_transfer_worker(device_cache, n * blocks_per_chunk)
        io = NumpyBlockIO(worker.host_array().reshape(n, -1))
        self.get_manager().bind_block_io(io)
        return OffloadingHandlers(worker, io, n)

    def get_handlers(self, device_cache: Any, **kw: Any) -> OffloadingHandlers:
        """vLLM's name for :meth:`create_handlers` (one struct here, not a generator)."""
        return self.create_handlers(device_cache, **kw)


class ManagerSpec(OffloadingSpec):
    """A spec over a manager built by hand: ``get_manager()`` is that manager."""

    def __init__(self, manager: OffloadingManager, **kw: Any) -> None:
        if not isinstance(manager, OffloadingManager):
            raise TypeError(f"ManagerSpec needs an OffloadingManager, got {type(manager).__name__}")
        super().__init__(**kw)
        self._manager = manager

    def create_manager(self) -> OffloadingManager:
        assert self._manager is not None
        return self._manager


#: spec name -> (module, class), imported when first created
SPECS = LazyRegistry("offloading spec", {
    "cpu": ("manager.spec_cpu", "CPUOffloadingSpec"),
}, base=OffloadingSpec)


def register_spec(name: str, module_path: str, class_name: str) -> None:
    """Register a spec imported lazily from ``module_path.class_name``; duplicates rejected."""
    SPECS.register(name, module_path, class_name)


def create_spec(config: dict[str, Any]) -> OffloadingSpec:
    """A spec from ``config``: ``config["spec"]`` (default ``"cpu"``) picks the class, the other
    entries are its keyword arguments."""
    if not isinstance(config, dict):
        raise ConfigError(f"offloading spec config must be a dict, got {type(config).__name__}")
    name = config.get("spec", "cpu")
    cls = SPECS.get(name)
    kwargs = {k: v for k, v in config.items() if k != "spec"}
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ConfigError(f"offloading spec {name!r}: bad arguments {sorted(kwargs)}: {exc}") from exc
