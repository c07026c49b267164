"""The replay thread's indexable view of the publisher's ring (see :class:`RingMirror`)."""

from __future__ import annotations

from collections import deque

__all__ = ["RingMirror"]


class RingMirror:
    """The replay thread's indexable view of the ring's deque: a list of the same tuples.

    Copying the whole deque (20k entries: tens of microseconds in one C call that no other
    thread can interrupt) for every chunk held the engine's GIL; the mirror is brought up to date
    from the deque's ends instead (what was appended since, what was evicted since), each step
    one short C call. Evicted entries are dropped at each ``sync``; ``clear`` lets go of all of
    them while no replay runs, so the mirror keeps no payload alive past the ring's own bounds
    for longer than one round of the replay loop.
    """

    __slots__ = ("src", "items", "head")

    #: a tail longer than this is not walked: the whole deque is copied once instead
    MAX_TAIL = 1024

    def __init__(self, src: deque) -> None:
        self.src = src
        self.items: list = []
        self.head = 0  # items[:head] are evicted (None)

    def clear(self) -> None:
        self.items = []
        self.head = 0

    def sync(self) -> None:
        src = self.src
        items = self.items
        try:
            first = src[0]  # read before the tail: then it is in the mirror or in that tail
        except IndexError:
            self.clear()
            return
        if self.head < len(items) and not self._extend(items):
            items = self.items = list(src)
            self.head = 0
            return
        if self.head >= len(items):
            self.items = list(src)
            self.head = 0
            return
        head = self.head
        n = len(items)
        while head < n and items[head] is not first:
            items[head] = None
            head += 1
        if head > 4096 and head * 2 > n:
            del items[:head]
            head = 0
        self.head = head

    def _extend(self, items: list) -> bool:
        """Append what the deque gained since; False if that could not be found cheaply."""
        last = items[-1]
        src = self.src
        k = 16
        while True:
            try:
                if src[-1] is last:
                    return True
                k = min(k, len(src))
                # one C call (a deque index per entry, from its right end): no other thread runs in it
                tail = list(map(src.__getitem__, range(-k, 0)))
            except IndexError:  # the deque shrank in between: look again
                continue
            for j in range(len(tail) - 2, -1, -1):
                if tail[j] is last:
                    items.extend(tail[j + 1:])
                    return True
            if k >= len(src) or k >= self.MAX_TAIL:
                return False
            k *= 4
