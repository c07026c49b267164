"""kvevents: KV-cache event streaming, wire-compatible with vLLM."""

from .codec import BatchDecoder, BatchEncoder, decode_batch, encode_batch
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
    "encode_batch",
]
