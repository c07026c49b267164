"""Scoring: how much of a prompt's prefix each pod holds, tier by tier.

The walk follows the prompt's keys once for every endpoint at the same time, using the
index's bitmasks: each endpoint is in one *stage* (a tier, heaviest first). At each key an
endpoint stays in its stage while that tier holds the key, otherwise it moves down to the
first lighter tier that does (a lower tier continues where a higher one stops, as an engine
loads a prefix from GPU, then CPU, then storage); when no remaining tier holds the key its
match ends. Consecutive keys with the same mask are one step (found at C level).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import compress, islice, repeat
from operator import ne

import msgspec

__all__ = ["Score", "TierMatch", "Explanation", "best", "better", "walk"]


class Score(msgspec.Struct):
    """One pod's score. A msgspec Struct (not a dataclass): the API builds and encodes 64 of these
    per request, and a Struct is built and JSON-encoded several times faster."""

    pod: str
    total: float  #: factor * sum(weight[tier] * tokens) / prompt tokens - load_weight * load
    tokens_by_tier: dict[str, int]  #: tier -> prefix tokens served from it (only tiers with > 0)
    matched_tokens: int = 0
    rank: int | None = None  #: the data-parallel rank the score comes from
    state: str = "SYNCED"  #: SYNCED, RECOVERING, STALE or UNRELIABLE
    factor: float = 1.0
    load: float = 0.0


@dataclass(slots=True)
class TierMatch:
    tier: str
    first_block: int  #: index of the first canonical block served from this tier
    blocks: int
    tokens: int


@dataclass(slots=True)
class Explanation:
    pod: str
    rank: int
    state: str
    factor: float
    matched_tokens: int
    segments: list[TierMatch]  #: the match, tier by tier, in prompt order
    alone: dict[str, int]  #: tier -> prefix tokens that tier holds by itself
    ended_at_block: int | None  #: first canonical block not matched (None: the whole prompt)
    reason: str
    blocks_in_prompt: int = 0
    extra: dict[str, object] = field(default_factory=dict)


def better(s: Score, than: Score | None) -> bool:
    """THE pick tie-break: a higher total wins, then a lower load, then the pod name."""
    return than is None or s.total > than.total or (
        s.total == than.total and (s.load < than.load or (s.load == than.load and s.pod < than.pod)))


def best(scores) -> Score | None:
    """The score ``pick()`` chooses among ``scores`` (a mapping or an iterable of Score)."""
    top = None
    for s in (scores.values() if hasattr(scores, "values") else scores):
        if better(s, top):
            top = s
    return top


def _bits(x: int):
    while x:
        low = x & -x
        yield low.bit_length() - 1
        x ^= low


def walk(get, keys: list[int], lanes: list[tuple[int, int]], start: int):
    """Run the staged walk over the masks ``get(key, 0)`` returns. ``lanes``: per stage ``(shift, full)``; ``start``: slot mask of
    the endpoints taking part. Returns ``(segments, ends)``: slot -> [(stage, first_block)],
    slot -> number of blocks matched (endpoints matching nothing are absent).

    The masks of all keys are fetched in one C-level pass, and so are the positions where
    the mask changes; the Python loop only visits those (a few per prompt)."""
    n = len(keys)
    segments: dict[int, list[tuple[int, int]]] = {}
    ends: dict[int, int] = {}
    if not n or not start:
        return segments, ends
    ms = list(map(get, keys, repeat(0)))
    change = [0]
    change.extend(compress(range(1, n), map(ne, ms, islice(ms, 1, None))))
    T = len(lanes)
    S = [0] * T
    incoming = start  # every taking part enters at the first key
    for j in change:
        m = ms[j]
        carry = incoming
        incoming = 0
        for t in range(T):
            shift, full = lanes[t]
            mt = (m >> shift) & full
            old = S[t]
            cur = old | carry
            new = cur & mt
            carry = cur & ~mt
            if new != old:
                S[t] = new
                entered = new & ~old
                for slot in _bits(entered):
                    seg = segments.get(slot)
                    if seg is None:
                        segments[slot] = [(t, j)]
                    else:
                        seg.append((t, j))
        if carry:
            for slot in _bits(carry):
                if slot in segments:
                    ends[slot] = j
            if not any(S):
                break
    for t in range(T):
        for slot in _bits(S[t]):
            ends[slot] = n
    return segments, ends
