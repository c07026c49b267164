"""``SecondaryTierFactory``: tier types registered by module path and class name, imported
only when a tier of that type is created."""

from __future__ import annotations

from typing import Any, ClassVar

from kvevents.errors import ConfigError
from kvevents.registry import LazyRegistry

from .base import SecondaryTierManager

__all__ = ["SecondaryTierFactory"]


class SecondaryTierFactory:
    _registry: ClassVar[LazyRegistry] = LazyRegistry("secondary tier type", base=SecondaryTierManager,
                                                     known_label="supported types")

    @classmethod
    def register_tier(cls, tier_type: str, module_path: str, class_name: str) -> None:
        """Register ``tier_type``; the module is imported at creation. Duplicates are rejected."""
        cls._registry.register(tier_type, module_path, class_name)

    @classmethod
    def supported_types(cls) -> list[str]:
        return cls._registry.names()

    @classmethod
    def get_tier_class(cls, tier_type: str | dict[str, Any]) -> type[SecondaryTierManager]:
        """The class registered for ``tier_type`` (a type name, or a tier config with a
        ``"type"``), imported now; :class:`~kvevents.errors.ConfigError` for an unknown type."""
        if isinstance(tier_type, dict):
            tier_type = cls._type_of(tier_type)
        return cls._registry.get(tier_type)

    @classmethod
    def _type_of(cls, tier_config: Any) -> str:
        if not isinstance(tier_config, dict):
            raise ConfigError(f"secondary tier config must be a dict, got {type(tier_config).__name__}")
        if "type" not in tier_config:
            raise ConfigError(f"secondary tier config has no 'type'; {cls._registry.known()}")
        return tier_config["type"]

    @classmethod
    def create_secondary_tier(cls, tier_config: dict[str, Any], **extra: Any) -> SecondaryTierManager:
        """A tier from ``tier_config``: ``tier_config["type"]`` picks the class, the other entries
        (and ``extra``, e.g. ``block_io=``) are its keyword arguments."""
        tier_type = cls._type_of(tier_config)
        tier_cls = cls._registry.get(tier_type)
        kwargs = {k: v for k, v in tier_config.items() if k != "type"}
        kwargs.update(extra)
        try:
            return tier_cls(tier_type, **kwargs)
        except TypeError as exc:
            raise ConfigError(f"secondary tier type {tier_type!r}: bad arguments {sorted(kwargs)}: {exc}") from exc


SecondaryTierFactory.register_tier("example", "manager.tiering.example", "ExampleSecondaryTierManager")
SecondaryTierFactory.register_tier("fs", "manager.tiering.fs", "FileSystemSecondaryTierManager")
