"""KVRouter.entries_by_pod(): entries per pod and tier from one pass over the index, on both
index backends; it must agree with the fleet-wide entries_by_tier() and follow removals."""

from __future__ import annotations

import pytest

from consumers import KVRouter, RouterConfig

from .router_helpers import batch, gpu, off, rm, toks


def hashes(n: int, first: int = 0) -> list[bytes]:
    return [f"h{i}".encode() for i in range(first, first + n)]


@pytest.mark.parametrize("backend", ["native", "python"])
def test_entries_by_pod_counts_each_pods_own_holdings(backend) -> None:
    r = KVRouter(RouterConfig(model="m", index=backend))
    h = hashes(4)
    r.apply("a", batch(gpu(h, None, toks(0, 4))))  # a: 4 GPU blocks
    r.apply("b", batch(gpu(h[:2], None, toks(0, 2))))  # b: the first 2 (shared keys)
    r.apply("a", batch(off([h[0]], "CPU")))  # a also offloaded block 0
    got = r.entries_by_pod()
    assert got["a"]["GPU"] == 4 and got["a"]["CPU"] == 1
    assert got["b"]["GPU"] == 2 and got["b"]["CPU"] == 0
    fleet = r.entries_by_tier()
    for tier, n in fleet.items():  # the per-pod counts add up to the fleet-wide ones
        assert sum(p[tier] for p in got.values()) == n
    r.apply("a", batch(rm(h[2:], "GPU")))
    assert r.entries_by_pod()["a"]["GPU"] == 2
    r.remove_pod("b")
    assert set(r.entries_by_pod()) == {"a"}
