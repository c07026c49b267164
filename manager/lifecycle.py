"""Request lifecycle guard: ``on_request_finished`` goes through once per request that
``on_new_request`` announced.

A scheduler that finishes a request twice, or finishes one it never announced, must not make
the tiers behind a manager hear it twice (or at all): :class:`RequestLifecycle` remembers the
live requests and a bounded window of recently finished ones, counts a repeat
(``finish_repeats``) or an unknown id (``finish_unknown``) and tells the caller to ignore it,
or raises :class:`~manager.base.RequestLifecycleError` in strict mode.
"""

from __future__ import annotations

from collections import OrderedDict

from .base import RequestLifecycleError

__all__ = ["RECENT_FINISHED", "RequestLifecycle"]

#: how many finished request ids are remembered to tell a repeat from an unknown id
RECENT_FINISHED = 65536


class RequestLifecycle:
    """Live and recently finished request ids of one component, with the two counters."""

    __slots__ = ("owner", "live", "recent", "recent_limit", "finish_repeats", "finish_unknown", "recent_dropped")

    def __init__(self, owner: str, recent_limit: int = RECENT_FINISHED) -> None:
        self.owner = owner
        self.live: set[str] = set()
        self.recent: OrderedDict[str, None] = OrderedDict()
        self.recent_limit = recent_limit
        self.finish_repeats = 0
        self.finish_unknown = 0
        self.recent_dropped = 0  # finished ids forgotten (the window is full): a later repeat reads as unknown

    def started(self, req_id: str) -> None:
        self.live.add(req_id)
        self.recent.pop(req_id, None)  # an id reused after it finished is a new request

    def seen(self, req_id: str) -> None:
        """A per-request call for ``req_id`` without ``on_new_request`` first (a driver that
        skips it): the request is live unless it already finished."""
        if req_id not in self.live and req_id not in self.recent:
            self.live.add(req_id)

    def finished(self, req_id: str, strict: bool = False) -> bool:
        """True the first time ``req_id`` finishes; False (counted) for a repeat or an unknown id."""
        if req_id in self.live:
            self.live.discard(req_id)
            recent = self.recent
            recent[req_id] = None
            if len(recent) > self.recent_limit:
                recent.popitem(last=False)
                self.recent_dropped += 1
            return True
        if req_id in self.recent:
            self.finish_repeats += 1
            what = "finished twice"
        else:
            self.finish_unknown += 1
            what = "finished but never announced by on_new_request"
        if strict:
            raise RequestLifecycleError(f"{self.owner}: request {req_id!r} {what}")
        return False

    def stats(self) -> dict[str, int]:
        return {
            "requests_live": len(self.live),
            "finish_repeats": self.finish_repeats,
            "finish_unknown": self.finish_unknown,
        }
