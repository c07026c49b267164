"""A real vLLM engine (the CPU build) with ``"spec_name": "KVEventsOffloadingSpec"``.

One engine serves every scenario (engine starts are slow): 20 device blocks of 128 tokens, our
CPU tier of 48 offloaded blocks and an fs tier behind it, vLLM's own ZeroMQ KV-events publisher
feeding our router. Asserted against vLLM's ``/metrics``:

- a prompt evicted from the device is loaded back from our tiers (vLLM counts external hits) and
  the greedy output equals the cold output;
- the router's per-tier score of that prompt equals vLLM's local (device) + external hits;
- a prompt evicted from the CPU tier too comes back from the fs tier the same way;
- a bad key in ``kv_connector_extra_config`` fails the start-up with one line naming it.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from .engine import BLOCK, EngineFailed, free_port, start_engine, wait_for


DEVICE_BLOCKS = 20
CPU_BLOCKS = 48  # > 2x the device: a prompt the device evicts stays a few fillers in the CPU tier


def ids(n: int, seed: int) -> list[int]:
    """``n`` token ids of the tiny vocabulary, distinct per seed (no prefix shared across seeds)."""
    return [(seed * 7919 + i * 31 + seed * seed) % 1000 for i in range(n)]


def kv_transfer(fs_root, **ours) -> str:
    return json.dumps({
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "KVEventsOffloadingSpec",
            "kvevents": {"cpu_blocks": CPU_BLOCKS, "secondary_tiers": [
                {"type": "fs", "root": str(fs_root), "load_threads": 2, "store_threads": 2}], **ours},
        },
    })


class Harness:
    def __init__(self, engine, sub, router) -> None:
        self.engine, self.sub, self.router = engine, sub, router
        self.marker_seed = 1000

    def drain(self) -> None:
        from consumers import feed

        for d in self.sub.poll(50):
            feed.handle(self.router, d)

    def settle(self) -> None:
        """Every event of the requests so far is in the router: a marker prompt's block is
        published after them on the same socket, so once the router holds it, it holds them."""
        self.marker_seed += 1
        marker = ids(BLOCK + 1, self.marker_seed)
        self.engine.complete(marker, 1)

        def seen() -> bool:
            self.drain()
            s = self.router.score(marker[:BLOCK], model="tiny").get("pod")
            return s is not None and s.matched_tokens == BLOCK

        wait_for(seen, 60, "the marker prompt's block in the router")

    def hits(self) -> tuple[float, float]:
        m = self.engine.metrics()
        return m.get("vllm:prefix_cache_hits_total", 0.0), m.get("vllm:external_prefix_cache_hits_total", 0.0)


@pytest.fixture(scope="module")
def spec_engine(tiny_model, engine_log_dir, tmp_path_factory):
    from consumers import KVRouter, RouterConfig
    from kvevents.subscriber import PublisherSpec, Subscriber

    port = free_port()
    events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                         "endpoint": f"tcp://*:{port}", "topic": ""})
    fs_root = tmp_path_factory.mktemp("fs-tier")
    engine = start_engine(tiny_model, ["--kv-transfer-config", kv_transfer(fs_root),
                                       "--num-gpu-blocks-override", str(DEVICE_BLOCKS),
                                       "--kv-events-config", events], log_dir=engine_log_dir)
    sub = Subscriber([PublisherSpec(f"tcp://127.0.0.1:{port}", name="pod")])
    router = KVRouter(RouterConfig(block_size=BLOCK, model="tiny"))
    try:
        yield Harness(engine, sub, router)
    finally:
        sub.close()
        engine.stop()


def _round_trip(h: Harness, prompt: list[int], first_filler: int, evicted_to: str):
    """Cold output; fillers (8 blocks each) until the router places part of the prompt in tier
    ``evicted_to`` (how many depends on when vLLM's stores land); the router's score; the warm
    output and vLLM's hit counters for it."""
    cold = h.engine.complete(prompt, 8)["choices"][0]["text"]
    for seed in range(first_filler, first_filler + 12):
        h.engine.complete(ids(8 * BLOCK + 1, seed), 1)
        h.settle()
        score = h.router.score(prompt, model="tiny")["pod"]
        if score.tokens_by_tier.get(evicted_to, 0) > 0:
            break
    else:
        raise AssertionError(f"the prompt never reached tier {evicted_to}: {score}")
    local0, ext0 = h.hits()
    warm = h.engine.complete(prompt, 8)["choices"][0]["text"]
    local1, ext1 = h.hits()
    return cold, warm, score, local1 - local0, ext1 - ext0


def _assert_loaded_back(cold, warm, score, local, external) -> None:
    """Greedy output after the load equals the cold one; vLLM loaded from our tiers; the router's
    GPU score is vLLM's local hits and its other tiers together vLLM's external hits."""
    assert warm == cold
    assert external > 0, f"vLLM loaded nothing from our tiers (local {local})"
    assert score.tokens_by_tier.get("GPU", 0) == local, (score, local, external)
    assert sum(v for t, v in score.tokens_by_tier.items() if t != "GPU") == external, (score, local, external)
    assert local + external == 8 * BLOCK


def test_load_from_cpu_tier_matches_cold_output_and_router_score(spec_engine):
    h = spec_engine
    prompt = ids(8 * BLOCK + 10, 1)  # 8 full blocks: vLLM may hit all of them
    _assert_loaded_back(*_round_trip(h, prompt, 2, "CPU"))
    # our manager's get_stats reaches vLLM's Prometheus page (the CPU tier's reservations)
    metrics = h.engine.metrics()
    assert metrics.get("vllm:kv_offload_cpu_allocation_size_count", 0) > 0, sorted(metrics)
    assert "vllm:kv_offload_cpu_cache_usage_perc" in metrics


def test_load_from_fs_tier_after_cpu_eviction(spec_engine):
    h = spec_engine
    prompt = ids(8 * BLOCK + 10, 51)
    # fillers push the prompt out of the device (20 blocks) and then out of the CPU tier (48)
    _assert_loaded_back(*_round_trip(h, prompt, 52, "STORAGE"))


def test_unknown_key_fails_startup_naming_it(tiny_model, engine_log_dir, tmp_path):
    bad = json.loads(kv_transfer(tmp_path, no_such_key=1))
    t0 = time.monotonic()
    with pytest.raises(EngineFailed) as err:
        start_engine(tiny_model, ["--kv-transfer-config", json.dumps(bad)], log_dir=engine_log_dir)
    log = re.search(r"log (\S+\.log)", err.value.args[0]).group(1)
    text = open(log, errors="replace").read()
    assert "ConfigError: kv_connector_extra_config['kvevents']: unknown key 'no_such_key'" in text, text[-3000:]
    assert time.monotonic() - t0 < 400
