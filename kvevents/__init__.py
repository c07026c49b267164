"""kvevents: KV-cache event streaming, wire-compatible with vLLM."""

from .codec import BatchDecoder, BatchEncoder, decode_batch, encode_batch, peek_ts
from .config import EventPublisherFactory, KVEventsConfig
from .delivery import Delivery, DeliveryKind, HealthState, PublisherHealth
from .endpoints import offset_endpoint
from .publisher import ZmqEventPublisher
from .publisher_base import EventPublisher, NullEventPublisher, ShutdownReport
from .subscriber import PublisherSpec, Subscriber
from .errors import ConfigError, DecodeError, EndpointError, KVEventsError
from .events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEvent,
    KVEventBatch,
)

__version__ = "0.1.0"

__all__ = [
    "Delivery",
    "DeliveryKind",
    "EventPublisher",
    "EventPublisherFactory",
    "HealthState",
    "KVEventsConfig",
    "NullEventPublisher",
    "PublisherHealth",
    "PublisherSpec",
    "ShutdownReport",
    "Subscriber",
    "ZmqEventPublisher",
    "offset_endpoint",
    "AllBlocksCleared",
    "BatchDecoder",
    "BatchEncoder",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "ConfigError",
    "DecodeError",
    "EndpointError",
    "KVCacheEvent",
    "KVEvent",
    "KVEventBatch",
    "KVEventsError",
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "decode_batch",
    "peek_ts",
    "encode_batch",
]
