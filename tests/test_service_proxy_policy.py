"""The proxy's pick (kvservice.proxy_policy.order_pods): KV score combined with live load, load
alone without a KV signal (never by name), the breaker's states, and the retry budget."""

from __future__ import annotations

import random
from collections import Counter

from kvservice.proxy_config import ProxyConfig
from kvservice.proxy_policy import PodState, RetryBudget, order_pods


def _pods(*loads) -> list[PodState]:
    out = []
    for i, (in_flight, prefill) in enumerate(loads):
        p = PodState(f"p{i}", f"http://h{i}", "m")
        p.in_flight, p.prefill = in_flight, prefill
        out.append(p)
    return out


def test_a_cached_prefix_wins_at_equal_load_and_loses_to_a_much_busier_pod() -> None:
    cfg = ProxyConfig()
    rnd = random.Random(1)
    a, b = _pods((0, 0), (0, 0))
    assert order_pods([a, b], 4000, {"p0": 3200}, cfg, rnd, 0.0)[0] is a
    a.in_flight, a.prefill = 4, 8000  # 8,000 prefill tokens queued + 4 * 256 > the 3,200 saved
    assert order_pods([a, b], 4000, {"p0": 3200}, cfg, rnd, 0.0)[0] is b
    assert order_pods([a, b], 4000, {"p0": 3200}, ProxyConfig(kv_weight=5.0), rnd, 0.0)[0] is a


def test_without_a_kv_signal_the_least_loaded_pod_wins_and_ties_are_random() -> None:
    cfg = ProxyConfig()
    rnd = random.Random(2)
    pods = _pods((1, 0), (0, 0), (0, 0))
    firsts = Counter(order_pods(pods, 100, {}, cfg, rnd, 0.0)[0].name for _ in range(200))
    assert set(firsts) == {"p1", "p2"} and min(firsts.values()) > 50  # never p0, never by name


def test_power_of_two_never_picks_the_busiest_first() -> None:
    cfg = ProxyConfig(balance="power_of_two")
    rnd = random.Random(3)
    pods = _pods((9, 900), (1, 0), (2, 0))
    firsts = Counter(order_pods(pods, 100, {}, cfg, rnd, 0.0)[0].name for _ in range(300))
    assert "p0" not in firsts and set(firsts) == {"p1", "p2"}
    assert all(len(order_pods(pods, 100, {}, cfg, rnd, 0.0)) == 3 for _ in range(20))


def test_an_open_breaker_skips_the_pod_until_half_open_then_one_probe() -> None:
    cfg = ProxyConfig()
    rnd = random.Random(4)
    a, b = _pods((0, 0), (0, 0))
    assert not a.failure(2, 10.0, now=100.0)  # one failure: still closed
    assert a.failure(2, 10.0, now=100.0)  # two: open until 110
    assert order_pods([a, b], 10, {"p0": 10}, cfg, rnd, 105.0) == [b]
    assert order_pods([a, b], 10, {"p0": 10}, cfg, rnd, 111.0)[0] is a  # half-open
    a.probing = True
    assert order_pods([a, b], 10, {"p0": 10}, cfg, rnd, 111.0) == [b]  # one probe at a time
    a.success()
    assert a.available(111.0) and not a.is_open(111.0) and a.opened == 1


def test_the_retry_budget_refills_by_ratio_up_to_its_burst() -> None:
    budget = RetryBudget(0.5, 2)
    assert budget.take() and budget.take() and not budget.take()
    budget.deposit()
    assert not budget.take()
    budget.deposit()
    assert budget.take()
    for _ in range(100):
        budget.deposit()
    assert budget.tokens == 2.0 and budget.exhausted == 2
