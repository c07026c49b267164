"""Store backpressure: whether a secondary tier takes a new store job now.

A tier that cannot keep up with the stores it is offered must not queue them without end
(memory grows, the primary's pinned blocks pile up, and loads wait on a busy disk). Before a
store job is submitted, :meth:`SecondaryTierManager.admit_store` asks the tier's policy with
the tier's backlog (blocks submitted and not yet finished); a refused job is *skipped*:
nothing is written, nothing is pinned, no event claims the blocks, and the tier counts it
(``stores_skipped`` jobs, ``blocks_skipped`` blocks). Policies are plug-ins::

    register_store_policy("mine", "my_pkg.bp", "MyPolicy")
    SecondaryTierFactory.create_secondary_tier({"type": "fs", "root": ..., "store_policy": "mine"})

Built in: ``"bounded"`` (default; skip while the backlog plus the job would exceed
``max_backlog_blocks``; a job is always taken by an idle tier, so no job is too big to ever
be stored) and ``"unbounded"`` (take everything: only for tiers that never fall behind).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from kvevents.errors import ConfigError
from kvevents.registry import LazyRegistry

__all__ = [
    "BoundedBacklog",
    "StorePolicy",
    "Unbounded",
    "available_store_policies",
    "create_store_policy",
    "register_store_policy",
]


class StorePolicy(ABC):
    """Admission of store jobs into one tier (called on the scheduler thread)."""

    @abstractmethod
    def admit(self, backlog_blocks: int, job_blocks: int) -> bool:
        """Whether to submit a store job of ``job_blocks`` blocks to a tier with
        ``backlog_blocks`` blocks submitted and not yet finished."""

    def describe(self) -> str:
        return type(self).__name__


class BoundedBacklog(StorePolicy):
    def __init__(self, max_backlog_blocks: int = 512) -> None:
        if not isinstance(max_backlog_blocks, int) or max_backlog_blocks < 1:
            raise ConfigError(f"store policy 'bounded': max_backlog_blocks must be an int >= 1, "
                              f"got {max_backlog_blocks!r}")
        self.max_backlog_blocks = max_backlog_blocks

    def admit(self, backlog_blocks: int, job_blocks: int) -> bool:
        return backlog_blocks == 0 or backlog_blocks + job_blocks <= self.max_backlog_blocks

    def describe(self) -> str:
        return f"bounded(max_backlog_blocks={self.max_backlog_blocks})"


class Unbounded(StorePolicy):
    def admit(self, backlog_blocks: int, job_blocks: int) -> bool:
        return True

    def describe(self) -> str:
        return "unbounded"


_REGISTRY = LazyRegistry("store policy", {
    "bounded": ("manager.tiering.backpressure", "BoundedBacklog"),
    "unbounded": ("manager.tiering.backpressure", "Unbounded"),
}, base=StorePolicy)


def register_store_policy(name: str, module_path: str, class_name: str) -> None:
    """Register a :class:`StorePolicy` subclass under ``name`` (imported on first use)."""
    _REGISTRY.register(name, module_path, class_name)


def available_store_policies() -> list[str]:
    return _REGISTRY.names()


def create_store_policy(spec: str | StorePolicy | None, **kwargs: Any) -> StorePolicy:
    """A policy from a registered name (``kwargs`` are its arguments), an instance (kept),
    or None (the default, ``"bounded"``)."""
    if isinstance(spec, StorePolicy):
        return spec
    cls = _REGISTRY.get("bounded" if spec is None else spec)
    try:
        return cls(**kwargs)  # type: ignore[no-any-return]
    except TypeError as exc:
        raise ConfigError(f"store policy {spec!r}: bad arguments {sorted(kwargs)}: {exc}") from exc
