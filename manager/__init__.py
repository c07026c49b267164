"""manager: the tiered KV offload manager (CPU primary tier, cache policies, secondary tiers).

The data model is imported eagerly (numpy only); everything else is loaded on first use, so
``import manager`` never imports torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import base as _base
from .base import *  # noqa: F403  (the data model: base.__all__)

#: public name -> module (relative to this package) that defines it, imported on first use.
_LAZY = {
    "CPUOffloadingManager": ".cpu",
    "CachePolicy": ".policies",
    "register_cache_policy": ".policies",
    "create_cache_policy": ".policies",
    "SecondaryTierManager": ".tiering",
    "JobMetadata": ".tiering",
    "JobResult": ".tiering",
    "SecondaryTierFactory": ".tiering",
    "TieringOffloadingManager": ".tiering",
    "ExampleSecondaryTierManager": ".tiering",
    "FileSystemSecondaryTierManager": ".tiering",
    "OffloadingConnectorScheduler": ".connector",
    "offload_events_to_kv_events": ".wire",
    "assemble_batch": ".wire",
    "OffloadingSpec": ".spec",
    "OffloadingHandlers": ".spec",
    "ManagerSpec": ".spec",
    "create_spec": ".spec",
    "register_spec": ".spec",
    "CPUOffloadingSpec": ".spec_cpu",
    "EngineRequest": ".connector_types",
    "SchedulerOutput": ".connector_types",
    "ConnectorError": ".connector_types",
    "SimEngine": ".engine_sim",
    "StepStats": ".engine_sim",
    "TransferWorker": ".transfer_base",
    "NumpyTransferWorker": ".transfer_base",
    "TransferResult": ".transfer_base",
    "TorchTransferWorker": ".transfer",
}

__all__ = [*_base.__all__, *_LAZY]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'manager' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value
