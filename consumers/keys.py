"""The router's own request keys: chained hashes of canonical token blocks.

A key names a prefix, not a block: ``key[j]`` depends on every token in blocks ``0..j``
and on the model and LoRA the prompt is for. The router computes the same keys from an
engine's ``BlockStored`` token ids and from a prompt, so it can score any prompt without
knowing the engine's own hash function or seed.

The hash is CPython's tuple hash over ints, which is deterministic for int tuples (no
``PYTHONHASHSEED`` randomisation applies to ints) and, measured on this code base, about
ten times faster than a ``hashlib.blake2b`` chain (``benchmarks/router.py`` prints both):

* content hash of a block: ``hash(tuple_of_block_size_token_ids)``, computed at C speed
  with ``map(hash, zip(*[iter(tokens)] * block_size))``;
* chain: ``key[j] = hash((key[j-1], content[j])) & (2**60 - 1)``, with ``key[-1]`` the seed
  of ``(model, lora_name)`` (a blake2b digest of their names, also 60 bits).

Keys are 60-bit non-negative ints: CPython stores those in two 30-bit digits (32 bytes),
where a full 64-bit hash takes three (36 bytes), and the index holds ~1M of them. A
collision between two of 1M distinct prefixes has probability ~1e-6 over the whole index.
Numpy was measured for this and lost: converting 4,096 token ids to an array costs more
(~90-110 us) than the whole tuple-hash chain (~50-70 us), see ``benchmarks/router.py``.
Decoding ``token_ids`` as raw msgpack (``msgspec.Raw``) and hashing bytes was measured too:
splitting the raw int array into 16-token blocks (regex or numpy) costs as much as the int
decode plus the tuple hashes it replaces (1.03-1.33x end to end), and ``hash(bytes)`` is
randomised per process.

Only full canonical blocks get a key; a prompt's trailing partial block is never matched.

Where the optional C extension is built (:mod:`consumers._accel`), ``chain_keys`` runs in C
with the same hashes, bit for bit (checked when it loads): a 4,096-token prompt's keys cost
a few microseconds instead of ~70.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from . import _accel

__all__ = ["DEFAULT_BLOCK_SIZE", "KEY_MASK", "model_seed", "chain_keys", "chain_keys_py", "request_keys",
           "as_token_list", "json_request", "json_tokens"]

DEFAULT_BLOCK_SIZE = 16
KEY_MASK = (1 << 60) - 1

_SEEDS: dict[tuple[str, str | None], int] = {}


def model_seed(model: str, lora_name: str | None = None) -> int:
    """The chain's starting value for ``(model, lora_name)``: stable across processes."""
    key = (model, lora_name)
    seed = _SEEDS.get(key)
    if seed is None:
        if not isinstance(model, str):
            raise TypeError(f"model must be a str, got {type(model).__name__}")
        text = f"{model}\x00{'' if lora_name is None else lora_name}".encode()
        seed = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") & KEY_MASK
        if len(_SEEDS) < 4096:
            _SEEDS[key] = seed
    return seed


def chain_keys_py(tokens: Sequence[int], parent: int, block_size: int) -> list[int]:
    """Keys of every full ``block_size`` block of ``tokens``, chained on from ``parent``
    (pure Python; :func:`chain_keys` is the C version where it is built)."""
    out: list[int] = []
    append = out.append
    k = parent
    mask = KEY_MASK
    for c in map(hash, zip(*[iter(tokens)] * block_size)):
        k = hash((k, c)) & mask
        append(k)
    return out


_FAST = _accel.load(chain_keys_py)
#: Keys of every full ``block_size`` block of ``tokens``, chained on from ``parent``.
chain_keys = chain_keys_py if _FAST is None else _FAST.chain_keys
#: ``json_tokens(raw) -> array('I') | None``: the ints of a JSON array text (msgspec.Raw) without
#: a Python int per token, None for anything but ints in [0, 2**32) (then decode it with msgspec,
#: which names the error). None itself where the C extension is not in use.
json_tokens = getattr(_FAST, "json_tokens", None)
#: ``json_request(body) -> (model, lora_name, memoryview('I')) | None``: a score request body of
#: the common shape read in one pass (consumers/_fp_json_request.h); None: decode it with msgspec
json_request = getattr(_FAST, "json_request", None)


def as_token_list(tokens: object) -> list[int] | tuple[int, ...]:
    """Accept a list/tuple of ints or anything with ``tolist()`` (numpy, torch)."""
    if type(tokens) is list or type(tokens) is tuple:
        return tokens  # type: ignore[return-value]
    tolist = getattr(tokens, "tolist", None)
    if tolist is not None:
        out = tolist()
        if isinstance(out, list):
            return out
    try:
        return list(tokens)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(f"tokens must be a sequence of ints, got {type(tokens).__name__}") from None


def request_keys(
    tokens: Sequence[int],
    model: str,
    lora_name: str | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> list[int]:
    """The router keys of a prompt: one per full canonical block."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, got {block_size}")
    return chain_keys(as_token_list(tokens), model_seed(model, lora_name), block_size)
