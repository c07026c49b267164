"""The ingest thread's loop (the feed's, ``consumers.feed.run``, given the fleet's step and health
round): a trickle of batches is paced (one poll per ``poll_interval``), a backlog drains without
pause, each health round takes one ``health()`` snapshot, outside the lock, for both the router
and the pod table, and an exception is counted and gone past."""

from __future__ import annotations

import types

import pytest

from consumers import feed
from kvevents import Delivery, DeliveryKind
from kvevents.errors import ConfigError
from kvservice import ingest
from kvservice.config import from_dict

from .service_helpers import MODEL


def _fleet(tmp_path, **sub):
    cfg = from_dict({"router": {"model": MODEL}, "subscriber": {"late_join": False, **sub},
                     "pods": [{"name": "a", "endpoint": f"ipc://{tmp_path}/a.pub"}]}).validate()
    return ingest.Fleet(cfg)


class _ScriptedSub:
    """A subscriber whose polls return the given numbers of deliveries, then stop the fleet."""

    def __init__(self, fleet, script: list[int], health=None) -> None:
        self.fleet = fleet
        self.script = list(script)
        self.polls = 0
        self.health_calls = 0
        self._health = health if health is not None else {}

    def poll(self, timeout_ms: int):
        self.polls += 1
        if not self.script:
            self.fleet._stop.set()
            return []
        return [Delivery(DeliveryKind.BATCH, "a", "", i) for i in range(self.script.pop(0))]

    def health(self):
        self.health_calls += 1
        assert not self.fleet.lock.locked(), "health() is taken outside the lock"
        return self._health

    def close(self) -> None:
        pass


def _run(monkeypatch, fleet, sub):
    """Run the ingest loop on this thread with a clock that does not move (no machine speed in it)."""
    sleeps: list[float] = []
    fake_time = types.SimpleNamespace(monotonic=lambda: 100.0, time=lambda: 1000.0, sleep=sleeps.append)
    monkeypatch.setattr(ingest, "time", fake_time)
    monkeypatch.setattr(feed, "time", fake_time)
    taken: list[int] = []
    monkeypatch.setattr(fleet, "take", lambda d: taken.append(d.seq))
    real = fleet.sub
    fleet.sub = sub
    try:
        fleet.run()
    finally:
        fleet.sub = real
    return sleeps, taken


def test_a_trickle_is_paced_and_a_backlog_is_not(tmp_path, monkeypatch) -> None:
    fleet = _fleet(tmp_path, poll_interval=0.004)
    try:
        # 1st poll: the health round (not paced); then a backlog, a trickle, an empty poll
        sub = _ScriptedSub(fleet, [1, feed.PACE_BELOW + 4, 2, 0])
        sleeps, taken = _run(monkeypatch, fleet, sub)
        assert len(taken) == 1 + feed.PACE_BELOW + 4 + 2  # everything polled was taken
        assert sleeps == [pytest.approx(0.004)], "one pause, after the trickle; none after the backlog or an empty poll"
    finally:
        fleet.stop()


def test_poll_interval_zero_never_pauses(tmp_path, monkeypatch) -> None:
    fleet = _fleet(tmp_path, poll_interval=0)
    try:
        sleeps, taken = _run(monkeypatch, fleet, _ScriptedSub(fleet, [1, 1, 2, 1]))
        assert sleeps == [] and len(taken) == 5
    finally:
        fleet.stop()


def test_a_health_round_takes_one_snapshot_outside_the_lock(tmp_path, monkeypatch) -> None:
    fleet = _fleet(tmp_path)
    try:
        real_health = fleet.sub.health()
        seen = []
        router_refresh = fleet.router.refresh_health

        def spy(source):
            assert fleet.lock.locked(), "the router is fed under the lock"
            seen.append(source.health())
            router_refresh(source)

        monkeypatch.setattr(fleet.router, "refresh_health", spy)
        sub = _ScriptedSub(fleet, [], health=real_health)
        _run(monkeypatch, fleet, sub)
        # a round after the first poll, one as the loop ends: one health() each, for both
        assert sub.health_calls == len(seen) == 2, "one health() per round, for the router and the pod table"
        assert all(s is real_health for s in seen)
        assert fleet.pods["a"].state == "CONNECTING"  # the pod table was rebuilt from the same snapshot
    finally:
        fleet.stop()


@pytest.mark.parametrize("bad", [-0.001, 2, "1", True])
def test_poll_interval_is_validated(tmp_path, bad) -> None:
    with pytest.raises(ConfigError, match="subscriber.poll_interval"):
        _fleet(tmp_path, poll_interval=bad)


def test_an_exception_in_a_round_is_counted_and_the_loop_goes_on(tmp_path, monkeypatch) -> None:
    fleet = _fleet(tmp_path, poll_interval=0)
    try:
        sub = _ScriptedSub(fleet, [2, 1])
        taken: list[int] = []

        def take(d) -> None:
            if not taken:
                taken.append(-1)
                raise RuntimeError("a bug in one delivery")
            taken.append(d.seq)

        monkeypatch.setattr(fleet, "take", take)
        real, fleet.sub = fleet.sub, sub
        try:
            fleet.run()
        finally:
            fleet.sub = real
        # the 1st poll's round ended at the exception (its 2nd delivery not taken); the next poll went on
        assert fleet.ingest_errors == 1 and taken == [-1, 0]
        assert sub.polls == 3 and fleet.pods_view()["ingest_errors"] == 1
    finally:
        fleet.stop()
