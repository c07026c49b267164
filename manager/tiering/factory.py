"""``SecondaryTierFactory``: tier types registered by module path and class name, imported
only when a tier of that type is created."""

from __future__ import annotations

import importlib
from typing import Any, ClassVar

from kvevents.errors import ConfigError

from .base import SecondaryTierManager

__all__ = ["SecondaryTierFactory"]


class SecondaryTierFactory:
    _registry: ClassVar[dict[str, tuple[str, str]]] = {}

    @classmethod
    def register_tier(cls, tier_type: str, module_path: str, class_name: str) -> None:
        """Register ``tier_type``; the module is imported at creation. Duplicates are rejected."""
        if not isinstance(tier_type, str) or not tier_type:
            raise ConfigError(f"tier type must be a non-empty string, got {tier_type!r}")
        if tier_type in cls._registry:
            module, name = cls._registry[tier_type]
            raise ConfigError(f"secondary tier type {tier_type!r} is already registered ({module}.{name})")
        cls._registry[tier_type] = (module_path, class_name)

    @classmethod
    def supported_types(cls) -> list[str]:
        return sorted(cls._registry)

    @classmethod
    def _supported(cls) -> str:
        return ", ".join(cls.supported_types()) or "(none)"

    @classmethod
    def create_secondary_tier(cls, config: dict[str, Any], **extra: Any) -> SecondaryTierManager:
        """A tier from ``config``: ``config["type"]`` picks the class, the other entries (and
        ``extra``, e.g. ``block_io=``) are its keyword arguments."""
        if not isinstance(config, dict):
            raise ConfigError(f"secondary tier config must be a dict, got {type(config).__name__}")
        if "type" not in config:
            raise ConfigError(f"secondary tier config has no 'type'; supported types: {cls._supported()}")
        tier_type = config["type"]
        entry = cls._registry.get(tier_type) if isinstance(tier_type, str) else None
        if entry is None:
            raise ConfigError(f"unknown secondary tier type {tier_type!r}; supported types: {cls._supported()}")
        module_path, class_name = entry
        try:
            module = importlib.import_module(module_path)
        except Exception as exc:
            raise ConfigError(
                f"secondary tier type {tier_type!r}: cannot import module {module_path!r} ({exc!r}); "
                f"supported types: {cls._supported()}"
            ) from exc
        tier_cls = getattr(module, class_name, None)
        if tier_cls is None:
            raise ConfigError(
                f"secondary tier type {tier_type!r}: module {module_path!r} has no class {class_name!r}; "
                f"supported types: {cls._supported()}"
            )
        if not (isinstance(tier_cls, type) and issubclass(tier_cls, SecondaryTierManager)):
            raise ConfigError(
                f"secondary tier type {tier_type!r}: {module_path}.{class_name} is not a SecondaryTierManager"
            )
        kwargs = {k: v for k, v in config.items() if k != "type"}
        kwargs.update(extra)
        try:
            return tier_cls(tier_type, **kwargs)
        except TypeError as exc:
            raise ConfigError(f"secondary tier type {tier_type!r}: bad arguments {sorted(kwargs)}: {exc}") from exc


SecondaryTierFactory.register_tier("example", "manager.tiering.example", "ExampleSecondaryTierManager")
SecondaryTierFactory.register_tier("fs", "manager.tiering.fs", "FileSystemSecondaryTierManager")
