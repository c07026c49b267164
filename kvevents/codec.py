"""Encoding and decoding of KVEventBatch payloads.

Decoding tries the current map encoding first (one typed msgspec decode: the fast path),
then the legacy array encoding, then a lenient map decode for releases that lacked fields
which are required today. Anything else is one :class:`~kvevents.errors.DecodeError`.
"""

from __future__ import annotations

import msgspec

from .errors import DecodeError
from .events import (
    KVEventBatch,
    LegacyKVEventBatch,
    LenientKVEventBatch,
    to_canonical,
    to_legacy,
)

__all__ = ["encode_batch", "decode_batch", "BatchEncoder", "BatchDecoder"]


class BatchEncoder:
    """Encodes batches; reuse one per thread (msgspec encoders keep an internal buffer)."""

    __slots__ = ("_enc", "legacy")

    def __init__(self, *, legacy: bool = False) -> None:
        self._enc = msgspec.msgpack.Encoder()
        self.legacy = legacy

    def encode(self, batch: KVEventBatch) -> bytes:
        if not isinstance(batch, KVEventBatch):
            raise TypeError(f"encode_batch expects a KVEventBatch, got {type(batch).__name__}")
        if self.legacy:
            return self._enc.encode(
                LegacyKVEventBatch(
                    ts=batch.ts,
                    events=[to_legacy(e) for e in batch.events],
                    data_parallel_rank=batch.data_parallel_rank,
                )
            )
        return self._enc.encode(batch)


class BatchDecoder:
    """Decodes either encoding into canonical :class:`KVEventBatch` structs."""

    __slots__ = ("_current", "_legacy", "_lenient")

    def __init__(self) -> None:
        self._current = msgspec.msgpack.Decoder(KVEventBatch)
        self._legacy = msgspec.msgpack.Decoder(LegacyKVEventBatch)
        self._lenient = msgspec.msgpack.Decoder(LenientKVEventBatch)

    def decode(self, payload: bytes | bytearray | memoryview) -> KVEventBatch:
        try:
            return self._current.decode(payload)
        except msgspec.ValidationError as exc:
            first = exc
        except (msgspec.DecodeError, TypeError) as exc:
            raise DecodeError(f"payload is not msgpack ({len(payload)} bytes): {exc}") from None
        for dec in (self._legacy, self._lenient):
            try:
                other = dec.decode(payload)
            except msgspec.ValidationError:
                continue
            return KVEventBatch(
                ts=other.ts,
                events=[to_canonical(e) for e in other.events],
                data_parallel_rank=other.data_parallel_rank,
            )
        raise DecodeError(f"payload is not a KVEventBatch ({len(payload)} bytes): {first}") from None


_ENCODER = BatchEncoder()
_LEGACY_ENCODER = BatchEncoder(legacy=True)
_DECODER = BatchDecoder()


def encode_batch(batch: KVEventBatch, *, legacy: bool = False) -> bytes:
    """Encode ``batch`` as vLLM does today, or in the <= 0.25 array form with ``legacy=True``."""
    return (_LEGACY_ENCODER if legacy else _ENCODER).encode(batch)


def decode_batch(payload: bytes | bytearray | memoryview) -> KVEventBatch:
    """Decode a payload in either encoding; raises :class:`DecodeError` naming what was wrong."""
    return _DECODER.decode(payload)
