"""The offload join without configuration (issue 13): an offloaded chunk's extent is inferred
from the chain depth of the hashes it joins, re-derived when evidence contradicts it, and taken
exactly from vLLM 0.33's self-describing offload stores."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvevents import BlockStored, encode_batch
from kvevents.codec import decode_batch

from consumers import KVRouter, RouterConfig

from .router_helpers import BS, batch, gpu, off, rm, toks

M = "m"
SHARED = Path(os.environ.get("KVEVENTS_SHARED", Path(__file__).resolve().parents[2] / "shared"))


def router(**kw) -> KVRouter:
    kw.setdefault("model", M)
    return KVRouter(RouterConfig(**kw))


def hashes(n: int, first: int = 0) -> list[bytes]:
    return [f"h{i}".encode() for i in range(first, first + n)]


def tiers(r: KVRouter, n_blocks: int, pod: str = "a"):
    s = r.score(toks(0, n_blocks))
    return s[pod].tokens_by_tier if pod in s else None


def cpu_extents(r: KVRouter, pod: str = "a") -> dict:
    return r.chunk_extents()[pod]


def test_offloads_held_before_their_gpu_events_join_whole_chunks():
    # case (a) of the issue: chunks of 2 GPU blocks announced before the GPU blocks themselves
    r = router()
    h = hashes(8)
    r.apply("a", batch(off([h[1], h[3], h[5], h[7]], "CPU")))
    assert r.stats.pending_held == 4
    r.apply("a", batch(gpu(h, None, toks(0, 8))))
    r.apply("a", batch(rm(h, "GPU")))
    assert tiers(r, 8) == {"CPU": 128}
    assert r.stats.pending_resolved == 4
    assert cpu_extents(r) == {"CPU": 2}
    # and removing one chunk takes both of its blocks
    r.apply("a", batch(rm([h[5]], "CPU")))
    assert tiers(r, 8) == {"CPU": 64}


def test_first_offload_with_a_single_hash_joins_the_whole_chunk():
    # case (b): the first offload event names one chunk
    r = router()
    h = hashes(2)
    r.apply("a", batch(gpu(h, None, toks(0, 2))))
    r.apply("a", batch(off([h[1]], "CPU"), rm(h, "GPU")))
    assert tiers(r, 2) == {"CPU": 32}
    assert r.counters()["chunk_inferred"] == 1


def test_extent_one_settles_and_keeps_the_c_path():
    r = router()
    h = hashes(4)
    r.apply("a", batch(gpu(h, None, toks(0, 4))))
    r.apply("a", batch(off([h[0]], "CPU")))  # depth 1: extent 1 for good
    r.apply("a", batch(off(h[1:], "CPU"), rm(h, "GPU")))
    assert tiers(r, 4) == {"CPU": 64}
    assert cpu_extents(r) == {"CPU": 1} and r.stats.chunk_rederived == 0


def test_contradicting_evidence_rederives_and_never_over_reports():
    # a lone chunk at depth 2 suggests 2 blocks per chunk; a chunk at depth 3 contradicts it
    r = router()
    h = hashes(4)
    r.apply("a", batch(gpu(h, None, toks(0, 4))))
    r.apply("a", batch(off([h[1]], "CPU")))
    assert cpu_extents(r) == {"CPU": 2}
    r.apply("a", batch(off([h[2]], "CPU"), rm(h, "GPU")))
    assert cpu_extents(r) == {"CPU": 1}
    assert r.stats.chunk_rederived == 1
    # block 0 was only ever claimed by the wrong estimate: it is gone, so nothing matches from the start
    assert tiers(r, 4) in (None, {})
    assert r.entries_by_tier()["CPU"] == 2  # blocks 1 and 2


def test_configuration_overrides_inference():
    r = router(offload_chunk_blocks={"CPU": 1})
    h = hashes(2)
    r.apply("a", batch(gpu(h, None, toks(0, 2))))
    r.apply("a", batch(off([h[1]], "CPU"), rm(h, "GPU")))
    assert tiers(r, 2) in (None, {})  # configured: one block per hash, whatever the depth says
    assert r.stats.chunk_inferred == 0


def test_native_and_python_paths_agree_on_inference():
    from consumers import fastpath_status
    if not fastpath_status().startswith("C"):
        pytest.skip("C extension not built")
    h = hashes(8)
    payloads = [encode_batch(batch(off([h[1], h[3]], "CPU"))),
                encode_batch(batch(gpu(h, None, toks(0, 8)))),
                encode_batch(batch(off([h[5]], "CPU"), off([h[7]], "CPU"), rm(h, "GPU")))]
    a, b = router(), router()
    for p in payloads:
        a.apply_payload("a", p)
        b.apply("a", decode_batch(p))
    assert a.state_digest() == b.state_digest()
    assert tiers(a, 8) == tiers(b, 8) == {"CPU": 128}


def _chunk(hs, parent, first_block, medium="CPU", **fields):
    """A vLLM 0.33 self-describing offload store: the chunk's tokens and its block size."""
    return BlockStored(block_hashes=list(hs), parent_block_hash=parent, token_ids=toks(first_block, 2 * len(hs)),
                       block_size=2 * BS, lora_id=None, medium=medium, lora_name=None, **fields)


@pytest.mark.parametrize("via_payload", [False, True])
def test_self_describing_offload_stores_give_the_extent_exactly(via_payload):
    r = router()
    g = hashes(4)
    c = [b"c1", b"c3"]  # chunk hashes of their own (vLLM 0.33 hashes the offloaded chunk)
    events = [gpu(g, None, toks(0, 4)),
              _chunk([c[0]], None, 0, locality="LOCAL", ownership="cpu-tier"),
              _chunk([c[1]], c[0], 2, locality="REMOTE", ownership="fs-tier", session_id="s1")]
    b = batch(*events)
    if via_payload:
        r.apply_payload("a", encode_batch(b))
    else:
        r.apply("a", b)
    r.apply("a", batch(rm(g[3:], "GPU")))  # one GPU block goes: the GPU keeps 3 blocks (16 tokens each)
    assert tiers(r, 4) == {"GPU": 48, "CPU": 16}
    r.apply("a", batch(rm(g, "GPU")))
    assert tiers(r, 4) == {"CPU": 64}
    r.apply("a", batch(rm([c[1]], "CPU")))  # a chunk leaves: both of its blocks
    assert tiers(r, 4) == {"CPU": 32}
    assert r.stats.errors == {}


def test_vllm_033_sliding_window_group_is_not_indexed():
    path = SHARED / "conformance" / "vllm-0.33.0" / "sliding_window_group.msgpack"
    if not path.exists():
        pytest.skip("../shared/conformance not present")
    ev = json.loads(path.with_suffix(".json").read_text())["events"][0]
    r = router()
    r.apply_payload("a", path.read_bytes())
    assert r.stats.ignored_group_events == 2 and r.entries() == 0
    assert ev["kv_cache_spec_kind"] == "sliding_window"


def test_reset_forgets_what_was_inferred():
    r = router()
    h = hashes(2)
    r.apply("a", batch(gpu(h, None, toks(0, 2))))
    r.apply("a", batch(off([h[1]], "CPU")))
    assert cpu_extents(r) == {"CPU": 2}
    r.reset_pod("a")
    assert cpu_extents(r) == {}


def test_snapshot_carries_what_the_join_inferred():
    r = router()
    h = hashes(4)
    r.apply("a", batch(gpu(h, None, toks(0, 4))))
    r.apply("a", batch(off([h[1]], "CPU")))
    r2 = router()
    r2.restore(r.snapshot())
    assert r2.state_digest() == r.state_digest()
    assert r2.chunk_extents() == {"a": {"CPU": 2}}
    for x in (r, r2):  # the same contradiction re-derives the same way on both
        x.apply("a", batch(off([h[2]], "CPU"), rm(h, "GPU")))
    assert r2.state_digest() == r.state_digest()
    assert r2.entries_by_tier()["CPU"] == 2


def test_inferred_extents_are_metrics():
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from consumers.telemetry import observe_router

    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("t")
    r = router()
    obs = observe_router(r, meter, refresh_interval=0)
    h = hashes(4)
    r.apply("a", batch(gpu(h, None, toks(0, 4))))
    r.apply("a", batch(off([h[1]], "CPU")))
    r.apply("a", batch(off([h[2]], "CPU")))  # contradicts: 2 -> 1
    got = {}
    for rm_ in reader.get_metrics_data().resource_metrics:
        for sm in rm_.scope_metrics:
            for m in sm.metrics:
                if m.name.startswith("kvevents.router.offload.chunk"):
                    for p in m.data.data_points:
                        got[(m.name, tuple(sorted(p.attributes.items())))] = p.value
    obs.close()
    assert got[("kvevents.router.offload.chunk.inferences", (("outcome", "inferred"),))] == 1
    assert got[("kvevents.router.offload.chunk.inferences", (("outcome", "rederived"),))] == 1
    assert got[("kvevents.router.offload.chunk.extent", (("pod", "a"), ("tier", "CPU")))] == 1
