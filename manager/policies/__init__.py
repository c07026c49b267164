"""Cache policies and their registry.

Built in: ``"lru"`` and ``"arc"``. An out-of-tree policy is registered by module path and
class name and imported only when first created::

    register_cache_policy("my_policy", "my_pkg.policies", "MyPolicy")
    CPUOffloadingManager(1024, cache_policy="my_policy")

``create_cache_policy`` also accepts ``"module.path:ClassName"`` directly. An unknown name is
a :class:`kvevents.ConfigError` listing the known ones.
"""

from __future__ import annotations

import importlib

from kvevents.errors import ConfigError

from .base import CachePolicy

__all__ = ["CachePolicy", "available_cache_policies", "create_cache_policy", "register_cache_policy"]

_REGISTRY: dict[str, tuple[str, str]] = {
    "lru": ("manager.policies.lru", "LRUCachePolicy"),
    "arc": ("manager.policies.arc", "ARCCachePolicy"),
}


def register_cache_policy(name: str, module_path: str, class_name: str) -> None:
    """Register a policy imported lazily from ``module_path.class_name``; duplicates rejected."""
    if not name or not isinstance(name, str):
        raise ConfigError(f"cache policy name must be a non-empty string, got {name!r}")
    if name in _REGISTRY:
        raise ConfigError(f"cache policy {name!r} is already registered (by {_REGISTRY[name][0]})")
    _REGISTRY[name] = (module_path, class_name)


def available_cache_policies() -> list[str]:
    return sorted(_REGISTRY)


def _load(name: str, module_path: str, class_name: str) -> type[CachePolicy]:
    try:
        module = importlib.import_module(module_path)
    except Exception as exc:
        raise ConfigError(f"cache policy {name!r}: cannot import module {module_path!r}: {exc}") from exc
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ConfigError(f"cache policy {name!r}: module {module_path!r} has no class {class_name!r}")
    if not (isinstance(cls, type) and issubclass(cls, CachePolicy)):
        raise ConfigError(f"cache policy {name!r}: {module_path}.{class_name} is not a CachePolicy subclass")
    return cls


def create_cache_policy(name: str, capacity: int) -> CachePolicy:
    """A new policy instance for ``capacity`` blocks."""
    entry = _REGISTRY.get(name)
    if entry is None:
        if isinstance(name, str) and ":" in name:
            module_path, _, class_name = name.partition(":")
            entry = (module_path, class_name)
        else:
            raise ConfigError(
                f"unknown cache policy {name!r}; known: {', '.join(available_cache_policies())} "
                "(or 'module.path:ClassName')"
            )
    return _load(name, *entry)(capacity)
