"""Our publisher inside a real vLLM: ``--kv-events-config '{"publisher": "kvevents", ...}'``.

One engine (then its restart) publishing through ``kvevents_vllm.publisher.KVEventsPublisher``
(vLLM loads our general plugin, which makes the name valid and registers it), with a replay
socket; ``kvevents router --proxy`` follows it. Asserted against vLLM's own counters:

- the router, started only after the engine served a prompt, learns it by replay from our
  replay server inside vLLM, and its score equals the hits vLLM counts for the prompt's second
  send (through the router's proxy);
- the engine restarts (same ports): the router sees the new run (a reset), drops what the old
  run held -- its score for the old prompt is 0, which vLLM's counter confirms -- and scores
  the new run's blocks as vLLM hits them;
- a setting our publisher cannot use stops vLLM's start-up with one line naming it.
"""

from __future__ import annotations

import json

import pytest

from .engine import (BLOCK, EngineFailed, Router, free_port, hits_of, hits_since, launch_engine, start_engine,
                     wait_for, words)
from .test_publisher_wire import replay_all

MODEL = "tiny-kv"
INDEX_TIMEOUT = 60.0


def _kv_config(ev: int, rep: int) -> str:
    # wildcards: what vLLM's users write (its own publisher binds nothing else); ours binds them too
    return json.dumps({"enable_kv_cache_events": True, "publisher": "kvevents",
                       "endpoint": f"tcp://*:{ev}", "replay_endpoint": f"tcp://*:{rep}"})


@pytest.fixture(scope="module")
def ports() -> dict:
    return {"ev": free_port(), "rep": free_port(), "http": free_port()}


@pytest.fixture(scope="module")
def engine(tiny_model, engine_log_dir, ports):
    e = start_engine(tiny_model, ["--kv-events-config", _kv_config(ports["ev"], ports["rep"])],
                     served_model_name=MODEL, port=ports["http"], log_dir=engine_log_dir)
    box = {"engine": e}
    yield box
    box["engine"].stop()


def _router(tmp, ports) -> Router:
    (tmp / "router.toml").write_text(f"""
[router]
model = "{MODEL}"

[[pods]]
name = "pod"
endpoint = "tcp://127.0.0.1:{ports['ev']}"
replay_endpoint = "tcp://127.0.0.1:{ports['rep']}"
http = "http://127.0.0.1:{ports['http']}"
""")
    # the router's defaults: an idle engine stays SYNCED; while it restarts it is unreachable
    # (STALE, on that evidence) and comes back with its new run
    return Router(["--config", "router.toml", "--port", "0", "--proxy"], cwd=tmp)


def _proxy(router: Router, prompt: str):
    status, headers, data = router.call("POST", "/v1/completions",
                                        {"model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert status == 200, data[:500]
    return headers["x-kvevents-pod"], int(headers["x-kvevents-matched-tokens"])


@pytest.fixture(scope="module")
def router(engine, ports, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router-kvevents")
    # before the router exists, the engine caches a prompt: the router can only learn it by replay
    prompt = words(600, seed=21)
    assert hits_of(engine["engine"], lambda: engine["engine"].complete(prompt)) == 0
    r = _router(tmp, ports)
    try:
        wait_for(lambda: r.call("GET", "/readyz")[0] == 200, 60, "the router's late join")
        yield {"router": r, "prompt": prompt}
    finally:
        assert r.stop() == 0, r.proc.stderr.read()


def test_vllm_runs_our_publisher(engine, ports) -> None:
    log = engine["engine"].log_path.read_text(errors="replace")
    assert f"kvevents publisher: events on tcp://*:{ports['ev']}, replay on tcp://*:{ports['rep']}" in log
    assert "ZMQ publisher thread" not in log  # vLLM's own publisher did not start


def test_our_replay_server_inside_vllm_answers(engine, router, ports) -> None:
    frames = replay_all(f"tcp://127.0.0.1:{ports['rep']}")
    assert frames and [int.from_bytes(f[2], "big") for f in frames] == list(range(len(frames)))
    pod = router["router"].pod("pod")
    assert pod["state"] == "SYNCED" and pod["gaps"] == 0


def test_score_learned_by_replay_equals_vllm_prefix_cache_hits(engine, router) -> None:
    r, prompt, e = router["router"], router["prompt"], engine["engine"]
    full = 600 // BLOCK * BLOCK
    wait_for(lambda: r.gpu_tokens("pod", MODEL, prompt=prompt) == full, INDEX_TIMEOUT, "the replayed blocks")
    before = e.metrics()
    assert _proxy(r, prompt) == ("pod", full)
    assert hits_since(e, before) == full == 512


def test_engine_restart(engine, router, tiny_model, engine_log_dir, ports) -> None:
    r, old_prompt = router["router"], router["prompt"]
    wait_for(lambda: r.gpu_tokens("pod", MODEL, prompt=old_prompt) == 512, INDEX_TIMEOUT, "the old run indexed")
    resets = r.pod("pod")["resets"]
    engine["engine"].stop()
    e = engine["engine"] = start_engine(
        tiny_model, ["--kv-events-config", _kv_config(ports["ev"], ports["rep"])],
        served_model_name=MODEL, port=ports["http"], log_dir=engine_log_dir)
    # the new run's first batch (seq 0 again) tells the router the publisher restarted
    new_prompt = words(300, seed=22)
    assert hits_of(e, lambda: e.complete(new_prompt)) == 0
    wait_for(lambda: r.gpu_tokens("pod", MODEL, prompt=new_prompt) == 2 * BLOCK, INDEX_TIMEOUT,
             "the new run indexed")
    pod = r.pod("pod")
    assert pod["resets"] == resets + 1 and pod["state"] == "SYNCED"
    # what the old run held is gone from the router, and from vLLM
    assert r.gpu_tokens("pod", MODEL, prompt=old_prompt) == 0
    assert hits_of(e, lambda: e.complete(old_prompt)) == 0
    # the new run: the router scores what vLLM hits
    wait_for(lambda: r.gpu_tokens("pod", MODEL, prompt=old_prompt) == 512, INDEX_TIMEOUT,
             "the old prompt indexed in the new run")
    before = e.metrics()
    assert _proxy(r, old_prompt) == ("pod", 512)
    assert hits_since(e, before) == 512


def test_a_bad_setting_stops_vllm_with_one_line_naming_it(tiny_model, engine_log_dir) -> None:
    e = launch_engine(tiny_model, ["--kv-events-config", json.dumps(
        {"enable_kv_cache_events": True, "publisher": "kvevents", "endpoint": "tcp://*:0"})],
        log_dir=engine_log_dir)
    try:
        with pytest.raises(EngineFailed):
            e.wait_healthy()
    finally:
        e.stop()
    assert e.proc.returncode != 0
    log = e.log_path.read_text(errors="replace")
    assert "kvevents.errors.EndpointError: endpoint 'tcp://*:0' has an invalid port '0'" in log
