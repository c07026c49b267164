"""Encoding and decoding of KVEventBatch payloads.

Decoding tries the current map encoding first (one typed msgspec decode: the fast path),
then the legacy array encoding, then a lenient map decode for releases that lacked fields
which are required today. Anything else is one :class:`~kvevents.errors.DecodeError`.
"""

from __future__ import annotations

import struct

import msgspec

from .errors import DecodeError
from .events import (
    KVEventBatch,
    LegacyKVEventBatch,
    LenientKVEventBatch,
    to_canonical,
    to_legacy,
)

__all__ = ["encode_batch", "decode_batch", "peek_ts", "BatchEncoder", "BatchDecoder"]


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


# What a malformed payload can raise inside msgspec: bad msgpack, bad UTF-8 in a string,
# nesting deep enough to exhaust the stack.
_MALFORMED = (msgspec.DecodeError, UnicodeDecodeError, RecursionError)


def _size(payload) -> str:
    try:
        return f"{len(payload)} bytes"
    except TypeError:
        return f"a {type(payload).__name__}, not bytes"


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
            return self._fallback(payload, exc)
        except _MALFORMED + (TypeError,) as exc:
            raise DecodeError(f"payload is not msgpack ({_size(payload)}): {exc}") from None

    def _fallback(self, payload, first: Exception) -> KVEventBatch:
        """Not the current encoding: try the legacy arrays, then a map lacking required fields."""
        for dec in (self._legacy, self._lenient):
            try:
                other = dec.decode(payload)
            except msgspec.ValidationError:
                continue
            except _MALFORMED as exc:
                raise DecodeError(f"payload is malformed msgpack ({_size(payload)}): {exc}") from None
            return KVEventBatch(
                ts=other.ts,
                events=[to_canonical(e) for e in other.events],
                data_parallel_rank=other.data_parallel_rank,
            )
        raise DecodeError(f"payload is not a KVEventBatch ({_size(payload)}): {first}") from None


_ENCODER = BatchEncoder()
_LEGACY_ENCODER = BatchEncoder(legacy=True)
_DECODER = BatchDecoder()


def encode_batch(batch: KVEventBatch, *, legacy: bool = False) -> bytes:
    """Encode ``batch`` as vLLM does today, or in the <= 0.25 array form with ``legacy=True``."""
    return (_LEGACY_ENCODER if legacy else _ENCODER).encode(batch)


_FAST_DECODE = _DECODER._current.decode


def decode_batch(payload: bytes | bytearray | memoryview) -> KVEventBatch:
    """Decode a payload in either encoding; raises :class:`DecodeError` naming what was wrong."""
    try:
        return _FAST_DECODE(payload)  # the current encoding, one call deep
    except Exception:
        return _DECODER.decode(payload)


_F64 = struct.Struct(">d").unpack_from
_F32 = struct.Struct(">f").unpack_from


def peek_ts(payload: bytes) -> float | None:
    """The ``ts`` of an encoded batch without decoding it (its first array element), or None
    when the payload does not start like a KVEventBatch (for raw-mode consumers' lag metrics)."""
    if len(payload) < 6 or payload[0] not in (0x92, 0x93):
        return None
    kind = payload[1]
    if kind == 0xCB and len(payload) >= 10:
        return _F64(payload, 2)[0]
    if kind == 0xCA:
        return _F32(payload, 2)[0]
    return None
