"""Block hashes: how token blocks are chained, and how a hash goes on the wire.

A block's hash is a 32-byte BLAKE2b digest over (parent hash, token ids, LoRA name), so a
block's hash names its whole prefix. Engines keep hashes as bytes; on the wire vLLM sends,
by default, the low 64 bits of the hash as an unsigned int (``int.from_bytes(h, "big") &
(2**64 - 1)``, i.e. the last 8 bytes read big-endian). With
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` it sends the bytes themselves; :func:`wire_hash`
offers both, and every producer in this package takes an ``int_hashes`` option.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np

HASH_BYTES = 32
_MASK64 = (1 << 64) - 1


def root_hash(seed: bytes | str = b"kvevents") -> bytes:
    """The parent of every first block (deterministic for a given seed)."""
    if isinstance(seed, str):
        seed = seed.encode()
    return hashlib.blake2b(b"root\x00" + seed, digest_size=HASH_BYTES).digest()


ROOT_HASH = root_hash()


def hash_block(parent: bytes | None, token_ids: Sequence[int], lora_name: str | None = None) -> bytes:
    """The hash of one full block of ``token_ids`` following the block hashed ``parent``."""
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    h.update(parent if parent is not None else ROOT_HASH)
    toks = np.asarray(token_ids, dtype="<i8")
    h.update(len(toks).to_bytes(4, "little"))
    h.update(toks.tobytes())
    if lora_name is not None:
        h.update(b"\x01" + lora_name.encode())
    return h.digest()


def hash_request_blocks(
    token_ids: Sequence[int],
    block_size: int,
    lora_name: str | None = None,
    *,
    start: int = 0,
    parent: bytes | None = None,
) -> list[bytes]:
    """Chained hashes of the full blocks of ``token_ids`` from block index ``start``.

    ``parent`` is the hash of block ``start - 1`` (None when ``start`` is 0), so a caller can
    extend a request's hashes as it grows without rehashing the prefix.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    out: list[bytes] = []
    n_full = len(token_ids) // block_size
    for i in range(start, n_full):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], lora_name)
        out.append(parent)
    return out


def wire_hash(block_hash: bytes, int_hashes: bool = True) -> int | bytes:
    """``block_hash`` as vLLM puts it on the wire: the low 64 bits unsigned (default) or bytes."""
    if int_hashes:
        return int.from_bytes(block_hash, "big") & _MASK64
    return bytes(block_hash)
