"""Secondary tiers behind the primary: the role, the factory, the example and fs tiers, and
the :class:`TieringOffloadingManager` that composes them. See the submodules' docstrings."""

from __future__ import annotations

from typing import Any

from .base import JobMetadata, JobResult, SecondaryTierManager
from .factory import SecondaryTierFactory
from .manager import TieringOffloadingManager

__all__ = [
    "ExampleSecondaryTierManager",
    "FileSystemSecondaryTierManager",
    "JobMetadata",
    "JobResult",
    "SecondaryTierFactory",
    "SecondaryTierManager",
    "TieringOffloadingManager",
]


def __getattr__(name: str) -> Any:
    if name == "ExampleSecondaryTierManager":
        from .example import ExampleSecondaryTierManager

        return ExampleSecondaryTierManager
    if name == "FileSystemSecondaryTierManager":
        from .fs import FileSystemSecondaryTierManager

        return FileSystemSecondaryTierManager
    raise AttributeError(f"module 'manager.tiering' has no attribute {name!r}")
