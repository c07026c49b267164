"""Cache policies and their registry.

Built in: ``"lru"`` and ``"arc"``. An out-of-tree policy is registered by module path and
class name and imported only when first created::

    register_cache_policy("my_policy", "my_pkg.policies", "MyPolicy")
    CPUOffloadingManager(1024, cache_policy="my_policy")

``create_cache_policy`` also accepts ``"module.path:ClassName"`` directly. An unknown name is
a :class:`kvevents.ConfigError` listing the known ones.
"""

from __future__ import annotations

from kvevents.registry import LazyRegistry

from .base import CachePolicy, RequestRecord

__all__ = ["CachePolicy", "RequestRecord", "available_cache_policies", "create_cache_policy", "register_cache_policy"]

_REGISTRY = LazyRegistry("cache policy", {
    "lru": ("manager.policies.lru", "LRUCachePolicy"),
    "arc": ("manager.policies.arc", "ARCCachePolicy"),
}, base=CachePolicy, hint=" (or 'module.path:ClassName')")


def register_cache_policy(name: str, module_path: str, class_name: str) -> None:
    """Register a policy imported lazily from ``module_path.class_name``; duplicates rejected."""
    _REGISTRY.register(name, module_path, class_name)


def available_cache_policies() -> list[str]:
    return _REGISTRY.names()


def create_cache_policy(name: str, capacity: int) -> CachePolicy:
    """A new policy instance for ``capacity`` blocks."""
    if isinstance(name, str) and name not in _REGISTRY.entries and ":" in name:
        module_path, _, class_name = name.partition(":")
        return _REGISTRY.load(name, module_path, class_name)(capacity)
    return _REGISTRY.get(name)(capacity)
