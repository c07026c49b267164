"""kvevents: KV-cache event streaming, wire-compatible with vLLM."""

from .codec import BatchDecoder, BatchEncoder, decode_batch, encode_batch, peek_ts
from .config import EventPublisherFactory, KVEventsConfig
from .delivery import Delivery, DeliveryKind, HealthState, PublisherHealth
from .publisher_base import EventPublisher, NullEventPublisher, ShutdownReport
from .source import SOURCES, EventSource, open_source
from .topic import make_topic, parse_topic
from .transport.zmq import PublisherSpec, Subscriber, ZmqEventPublisher, offset_endpoint
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
    "EventSource",
    "SOURCES",
    "open_source",
    "HealthState",
    "KVEventsConfig",
    "NullEventPublisher",
    "PublisherHealth",
    "PublisherSpec",
    "ShutdownReport",
    "Subscriber",
    "ZmqEventPublisher",
    "offset_endpoint",
    "make_topic",
    "parse_topic",
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
