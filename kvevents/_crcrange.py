"""CRC-32 of arbitrary ranges of one buffer in time independent of the range's length.

A recording reader that lost its place checks every ``MARK`` it finds after the damage as a
possible record start: the record's CRC covers its LEN field and its body. Checked one by one
with ``zlib.crc32`` each candidate costs its claimed length, so a crafted file holding a
candidate every few bytes, each claiming a long record, costs the square of its size (a
1.5 MB file took 68 s). :class:`RangeCRC` makes each check cost a constant instead:

* prefix values ``G(x) = crc32(buf[base:x])`` are kept at checkpoints every ``STEP`` bytes,
  extended lazily (each byte is hashed once however many candidates look at it);
* CRC-32 is affine: ``crc32(Y, c) = M_n(c) ^ crc32(Y)`` with ``M_n`` the linear map "append n
  zero bytes"; so ``crc32(body, c) = G(b) ^ M_n(c ^ G(a))`` for ``body = buf[a:b]``, ``n = b - a``;
* ``M_n`` is applied with byte tables for each power of two ``n = 2**k`` (built once, from
  ``zlib.crc32`` of one zero byte and repeated squaring).
"""

from __future__ import annotations

import zlib
from typing import Any

__all__ = ["RangeCRC"]

STEP = 1024
_MAX_POW = 31  # ranges up to 2**31 bytes


def _apply(basis: list[int], v: int) -> int:
    out, i = 0, 0
    while v:
        if v & 1:
            out ^= basis[i]
        v >>= 1
        i += 1
    return out


def _build_tables() -> list[list[list[int]]]:
    zero0 = zlib.crc32(b"\0")
    basis = [zlib.crc32(b"\0", 1 << i) ^ zero0 for i in range(32)]  # M_1 on each bit
    tables = []
    for _ in range(_MAX_POW):
        byte_tables = []
        for j in range(4):
            t = [0] * 256
            for b in range(1, 256):
                low = b & -b
                t[b] = t[b ^ low] ^ basis[8 * j + low.bit_length() - 1]
            byte_tables.append(t)
        tables.append(byte_tables)
        basis = [_apply(basis, x) for x in basis]  # M_{2n} = M_n after M_n
    return tables


_TABLES: list[list[list[int]]] | None = None


def shift(v: int, n: int) -> int:
    """``M_n(v)``: the CRC state ``v`` after ``n`` zero bytes (without zlib's constant part)."""
    global _TABLES
    if _TABLES is None:
        _TABLES = _build_tables()
    k = 0
    while n:
        if n & 1:
            t0, t1, t2, t3 = _TABLES[k]
            v = t0[v & 255] ^ t1[(v >> 8) & 255] ^ t2[(v >> 16) & 255] ^ t3[v >> 24]
        n >>= 1
        k += 1
    return v


class RangeCRC:
    """``crc32(buf[a:b], start)`` for ``base <= a <= b <= len(buf)``, each in O(STEP) + O(log n).

    ``hashed`` counts the bytes given to zlib (each byte past ``base`` once for the checkpoints,
    plus at most ``2 * STEP`` per query).
    """

    def __init__(self, buf: Any, base: int) -> None:
        self._view = memoryview(buf)
        self.base = base
        self._ck = [0]  # _ck[i] = crc32(buf[base : base + i * STEP])
        self.hashed = 0

    def _prefix(self, x: int) -> int:
        i = (x - self.base) // STEP
        ck, view, base = self._ck, self._view, self.base
        while len(ck) <= i:
            start = base + (len(ck) - 1) * STEP
            ck.append(zlib.crc32(view[start:start + STEP], ck[-1]))
            self.hashed += STEP
        start = base + i * STEP
        self.hashed += x - start
        return zlib.crc32(view[start:x], ck[i])

    def crc(self, a: int, b: int, start: int = 0) -> int:
        if b - a <= 2 * STEP:
            self.hashed += b - a
            return zlib.crc32(self._view[a:b], start)
        return self._prefix(b) ^ shift(start ^ self._prefix(a), b - a)

    def close(self) -> None:
        self._view.release()
