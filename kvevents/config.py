"""Publisher configuration (vLLM's KVEventsConfig fields, plus ours) and the publisher factory.

:class:`KVEventsConfig` is a ``msgspec.Struct`` whose per-key rules live in its types (sizes
``>= 1``, ``hwm >= 0``, ``replay_rate > 0``, ``overflow`` and ``mode`` as ``Literal``s);
:meth:`KVEventsConfig.from_dict` reads a parsed mapping through :func:`kvevents.settings.decode`,
so an unknown key, a wrong type or a value out of range is a ConfigError in one line naming the
key (``hwm must be int >= 0, got -1``; ``bogus: unknown key (known: buffer_bytes, ...)``).
:meth:`EventPublisherFactory.create` checks a config built by keywords the same way.

``EventPublisherFactory.create(config)`` picks the publisher by name from a registry:
``"zmq"`` and ``"null"`` are built in; ``register(name, "pkg.module", "ClassName")`` adds one that
is imported only when first created. An unknown name is a ConfigError listing the known ones.
"""

from __future__ import annotations

from functools import partial
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from .publisher_base import EventPublisher, NullEventPublisher
from .registry import LazyRegistry
from .settings import MAPPING_WORDS, decode, dotted

__all__ = ["EventPublisherFactory", "KVEventsConfig", "Mode", "Overflow"]

#: what a full publish queue does to its oldest batch (kvevents.transport.zmq.publisher)
Overflow = Literal["replay_only", "drop_oldest"]
#: whether the PUB socket binds or connects (kvevents.transport.zmq.endpoints.should_bind)
Mode = Literal["auto", "bind", "connect"]
Positive = Annotated[int, Meta(ge=1)]


class KVEventsConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    """The publisher's settings, built by keywords or read by :meth:`from_dict`."""

    # vLLM's KVEventsConfig fields, same names and meaning
    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://127.0.0.1:5557"  #: vLLM's default is tcp://*:5557 (all interfaces); ours stays on loopback
    replay_endpoint: str | None = None
    buffer_steps: Positive = 10_000
    hwm: Annotated[int, Meta(ge=0)] = 100_000  #: 0: only the publisher's hwm_bytes bound
    max_queue_size: Positive = 100_000
    topic: str = ""
    # ours
    buffer_bytes: Positive = 64 << 20
    overflow: Overflow = "replay_only"
    replay_rate: Annotated[float, Meta(gt=0)] = 20.0
    replay_burst: Positive = 5
    mode: Mode = "auto"
    legacy: bool = False

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "KVEventsConfig":
        """``data`` (parsed JSON/TOML) as a KVEventsConfig; ConfigError in one line naming the key."""
        return decode(data, cls, name=partial(dotted, root="KVEventsConfig"), words=MAPPING_WORDS)

    def publisher_kwargs(self) -> dict[str, Any]:
        d = msgspec.structs.asdict(self)
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
        # a config built by keywords skipped the type checks from_dict makes: made here
        config = KVEventsConfig() if config is None else KVEventsConfig.from_dict(msgspec.structs.asdict(config))
        if not config.enable_kv_cache_events:
            return NullEventPublisher(data_parallel_rank)
        publisher_cls = cls._registry.get(config.publisher)
        kwargs = config.publisher_kwargs()
        kwargs.update(overrides)
        if publisher_cls is NullEventPublisher:
            return NullEventPublisher(data_parallel_rank)
        return publisher_cls(data_parallel_rank=data_parallel_rank, **kwargs)
