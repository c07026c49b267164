"""SimEngine.on_request_finished: the public hook a server (kvdemo's engine HTTP server) uses to
learn a request is done, instead of reading the engine's request table."""

from __future__ import annotations

from manager.cpu import CPUOffloadingManager
from manager.engine_sim import SimEngine

from .test_engine_sim import ListPublisher


def test_each_request_is_reported_once_in_the_step_it_finishes() -> None:
    m = CPUOffloadingManager(16, enable_events=True)
    e = SimEngine(m, ListPublisher(), gpu_blocks=32, block_size=4, offload_block_size=4, use_torch=False)
    seen: list[str] = []
    e.on_request_finished.append(seen.append)
    try:
        e.add_request("short", list(range(9)), max_new_tokens=1)
        e.add_request("long", list(range(100, 109)), max_new_tokens=4)
        per_step: list[tuple[int, list[str]]] = []
        while e.has_work():
            before = len(seen)
            st = e.step()
            per_step.append((st.finished, seen[before:]))
        assert sorted(seen) == ["long", "short"] and len(seen) == 2  # once each
        # reported in the very step whose stats count it, short first
        assert [ids for n, ids in per_step if n] == [["short"], ["long"]]
        assert all(n == len(ids) for n, ids in per_step)
        assert e.requests_finished == 2
        # a finished request's id is free again, and a removed hook is no longer called
        e.on_request_finished.remove(seen.append)
        e.add_request("short", list(range(9)), max_new_tokens=1)
        e.run_until_idle()
        assert seen == ["short", "long"] and e.requests_finished == 3
    finally:
        e.shutdown()
