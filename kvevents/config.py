"""Publisher configuration (vLLM's KVEventsConfig fields, plus ours) and the publisher factory.

``EventPublisherFactory.create(config)`` picks the publisher by name from a registry:
``"zmq"`` and ``"null"`` are built in; ``register(name, "pkg.module", "ClassName")`` adds one that
is imported only when first created. An unknown name is a ConfigError listing the known ones.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from .errors import ConfigError
from .publisher_base import EventPublisher, NullEventPublisher
from .registry import LazyRegistry


@dataclass(slots=True)
class KVEventsConfig:
    # vLLM's KVEventsConfig fields, same names and meaning
    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://127.0.0.1:5557"  #: vLLM's default is tcp://*:5557 (all interfaces); ours stays on loopback
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    # ours
    buffer_bytes: int = 64 << 20
    overflow: str = "replay_only"
    replay_rate: float = 20.0
    replay_burst: int = 5
    mode: str = "auto"
    legacy: bool = False

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "KVEventsConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown KVEventsConfig field(s) {unknown}; known: {sorted(known)}")
        return cls(**data)

    def publisher_kwargs(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("enable_kv_cache_events", "publisher"):
            d.pop(k)
        return d


class EventPublisherFactory:
    _registry = LazyRegistry("publisher", {
        "zmq": ("kvevents.transport.zmq.publisher", "ZmqEventPublisher"),
        "null": ("kvevents.publisher_base", "NullEventPublisher"),
        "nats": ("kvevents.transport.nats.publisher", "NatsEventPublisher"),
    })

    @classmethod
    def register(cls, name: str, module_path: str, class_name: str) -> None:
        cls._registry.register(name, module_path, class_name)

    @classmethod
    def known(cls) -> list[str]:
        return cls._registry.names()

    @classmethod
    def create(cls, config: KVEventsConfig | None = None, data_parallel_rank: int = 0, **overrides: Any) -> EventPublisher:
        config = config or KVEventsConfig()
        if not config.enable_kv_cache_events:
            return NullEventPublisher(data_parallel_rank)
        publisher_cls = cls._registry.get(config.publisher)
        kwargs = config.publisher_kwargs()
        kwargs.update(overrides)
        if publisher_cls is NullEventPublisher:
            return NullEventPublisher(data_parallel_rank)
        return publisher_cls(data_parallel_rank=data_parallel_rank, **kwargs)
