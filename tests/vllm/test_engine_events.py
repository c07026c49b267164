"""Real vLLM engines publishing with vLLM's own ``zmq`` publisher, our router reading them.

The fleet is the README's "Deploy with vLLM" section, run command by command against two real
engines (pod-a and pod-b): ``vllm serve MODEL --port P --kv-events-config JSON`` becomes
``python -m vllm.entrypoints.openai.api_server`` serving the tiny test model under the README's
model name, with the same events config; hosts become 127.0.0.1 and every port a free one. The
events endpoints stay wildcards (``tcp://*:P``) as in the README: vLLM binds only a wildcard
(any other address it connects to), so that is the one form a real engine accepts here.

Each scenario is checked against vLLM's own counter ``vllm:prefix_cache_hits_total``:

- a prompt of several 128-token blocks sent twice: the router's score (and the proxy's
  ``x-kvevents-matched-tokens``) equals the hits vLLM counts for the second send;
- the same for a chat prompt (tokenized by the engine's ``/tokenize`` through the router);
- ``POST /reset_prefix_cache``: vLLM publishes ``AllBlocksCleared``, the router scores 0, and
  vLLM confirms 0 hits for the prompt it held;
- an idle pod (vLLM publishes nothing while idle) stays routed with its full score past the
  router's ``stale_after``, and vLLM confirms the hits the router promised;
- the README's client commands (curl) answer as the README says.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import time
import urllib.request

import pytest

from ..test_service_deploy import Ports, _blocks, _router_argv
from .engine import BLOCK, Router, hits_of, hits_since, launch_engine, wait_for, words

INDEX_TIMEOUT = 60.0  # s: events of a finished request reach the router's index (polled)


@pytest.fixture(scope="module")
def fleet(tiny_model, engine_log_dir, tmp_path_factory):
    """The README's deploy commands: two engines, router.toml, a token, the router (--proxy)."""
    tmp = tmp_path_factory.mktemp("deploy")
    ports = Ports()
    engines_block, router_block, client_block = _blocks("bash")
    (toml,) = _blocks("toml")
    engines, host, model = {}, None, None
    try:
        for line in engines_block.splitlines():
            m = re.match(r"# (pod-\w+), on ([\d.]+)", line)
            if m:
                pod, host = m.groups()
                continue
            argv = shlex.split(line)
            # the README's engine line: `vllm serve MODEL --port P --kv-events-config JSON`, nothing else
            assert argv[:2] == ["vllm", "serve"] and len(argv) == 7 and host, line
            model = argv[2]
            port = ports(host, int(argv[argv.index("--port") + 1]))
            kv = json.loads(argv[argv.index("--kv-events-config") + 1])
            assert kv["enable_kv_cache_events"] is True and kv["publisher"] == "zmq"
            for k in ("endpoint", "replay_endpoint"):
                wild, p = kv[k].rsplit(":", 1)
                assert wild == "tcp://*", kv[k]
                kv[k] = f"tcp://*:{ports(host, int(p))}"
            engines[pod] = launch_engine(tiny_model, ["--kv-events-config", json.dumps(kv)],
                                         served_model_name=model, port=port, log_dir=engine_log_dir)
        assert set(engines) == {"pod-a", "pod-b"}
        for e in engines.values():
            e.wait_healthy()
        cfg = re.sub(r"(10\.0\.0\.\d+):(\d+)",
                     lambda m: f"127.0.0.1:{ports(m.group(1), int(m.group(2)))}", toml)
        (tmp / "router.toml").write_text(cfg)
        token_line, router_line = router_block.splitlines()
        subprocess.run(["bash", "-c", token_line], cwd=tmp, check=True)
        router = Router(_router_argv(router_line, ports)[2:], cwd=tmp,
                        token=(tmp / "router.token").read_text().strip())
    except BaseException:
        for e in engines.values():
            e.stop()
        raise
    try:
        wait_for(lambda: router.call("GET", "/readyz")[0] == 200, 60, "the router ready")
        yield {"engines": engines, "router": router, "model": model, "tmp": tmp,
               "client": client_block.splitlines(), "rport": ports("router", 9000)}
    finally:
        rc = router.stop()
        for e in engines.values():
            e.stop()
        assert rc == 0, router.proc.stderr.read()


def _proxy(router: Router, path: str, body: dict):
    status, headers, data = router.call("POST", path, body)
    assert status == 200, data[:500]
    return headers["x-kvevents-pod"], int(headers["x-kvevents-matched-tokens"])




def test_router_score_equals_vllm_prefix_cache_hits(fleet) -> None:
    router, model = fleet["router"], fleet["model"]
    a = fleet["engines"]["pod-a"]
    prompt = words(600, seed=11)  # 4 full 128-token blocks and a partial one
    full = len(prompt.split()) // BLOCK * BLOCK
    # straight to pod-a: a new prompt (vLLM finds nothing cached), it publishes BlockStored
    assert hits_of(a, lambda: a.complete(prompt)) == 0
    wait_for(lambda: router.gpu_tokens("pod-a", model, prompt=prompt) == full, INDEX_TIMEOUT,
             "pod-a's blocks indexed")
    assert router.gpu_tokens("pod-b", model, prompt=prompt) == 0
    # the same prompt through the router's proxy: it picks pod-a on what it indexed, and vLLM's
    # own counter says how much of the prompt pod-a really had
    before = a.metrics()
    assert _proxy(router, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 1}) \
        == ("pod-a", full)
    assert hits_since(a, before) == full == 512


def test_chat_prompt_score_equals_vllm_prefix_cache_hits(fleet) -> None:
    router, model = fleet["router"], fleet["model"]
    b = fleet["engines"]["pod-b"]
    messages = [{"role": "user", "content": words(450, seed=12)}]
    assert hits_of(b, lambda: b.chat(messages)) == 0
    n = router.json("POST", "/v1/score", {"model": model, "messages": messages})["prompt_tokens"]
    full = n // BLOCK * BLOCK
    assert full >= 3 * BLOCK
    wait_for(lambda: router.gpu_tokens("pod-b", model, messages=messages) == full, INDEX_TIMEOUT,
             "pod-b's chat blocks indexed")
    before = b.metrics()
    assert _proxy(router, "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": 1}) \
        == ("pod-b", full)
    assert hits_since(b, before) == full


def test_reset_prefix_cache_clears_the_pod_in_the_router(fleet) -> None:
    router, model = fleet["router"], fleet["model"]
    a, b = fleet["engines"]["pod-a"], fleet["engines"]["pod-b"]
    held, fresh = words(300, seed=13), words(300, seed=14)
    a.complete(held)
    b.complete(held)
    for pod in ("pod-a", "pod-b"):
        wait_for(lambda: router.gpu_tokens(pod, model, prompt=held) == 2 * BLOCK, INDEX_TIMEOUT,
                 f"{pod}'s blocks indexed")
    resets_before = router.pod("pod-a")["resets"]
    status, body = a.post("/reset_prefix_cache")
    assert status == 200, body
    # vLLM queues AllBlocksCleared and publishes it with its next step's batch: here, ahead of
    # the BlockStored of another prompt. Once that prompt is indexed the clear has been applied
    a.complete(fresh)
    wait_for(lambda: router.gpu_tokens("pod-a", model, prompt=fresh) == 2 * BLOCK, INDEX_TIMEOUT,
             "pod-a's batch after the reset indexed")
    st = router.pod("pod-a")
    assert st["state"] == "SYNCED" and st["gaps"] == 0 and st["resets"] == resets_before
    assert router.gpu_tokens("pod-a", model, prompt=held) == 0
    assert router.gpu_tokens("pod-b", model, prompt=held) == 2 * BLOCK
    # and vLLM agrees: the prompt pod-a held before the reset is a miss there now
    assert hits_of(a, lambda: a.complete(held)) == 0
    wait_for(lambda: router.gpu_tokens("pod-a", model, prompt=held) == 2 * BLOCK, INDEX_TIMEOUT,
             "pod-a re-indexed after the reset")


def test_an_idle_pod_stays_routed_with_its_full_score(fleet) -> None:
    """vLLM publishes nothing while idle; the router's default stale_after is 10 s. A pod whose
    event connection is up is alive however long it has been quiet: it keeps its state and its
    full score at every look over 12 quiet seconds, and vLLM counts the hits it was routed for."""
    router, model = fleet["router"], fleet["model"]
    a = fleet["engines"]["pod-a"]
    prompt = words(300, seed=16)
    a.complete(prompt)
    wait_for(lambda: router.gpu_tokens("pod-a", model, prompt=prompt) == 2 * BLOCK, INDEX_TIMEOUT,
             "pod-a's blocks indexed")
    # the request's last steps may still publish a batch or two: the quiet time counts from the
    # last batch the router applied for pod-a
    batches, quiet_since, looks = router.pod("pod-a")["batches"], time.monotonic(), 0
    deadline = quiet_since + 90.0
    while time.monotonic() - quiet_since < 12.0:  # the behaviour under test is about elapsed time
        assert time.monotonic() < deadline, "pod-a never went quiet"
        st = router.pod("pod-a")
        assert st["state"] == "SYNCED", st
        assert router.gpu_tokens("pod-a", model, prompt=prompt) == 2 * BLOCK
        if st["batches"] != batches:
            batches, quiet_since, looks = st["batches"], time.monotonic(), 0
        looks += 1
        time.sleep(0.5)
    assert looks >= 5
    before = a.metrics()
    assert _proxy(router, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 1}) \
        == ("pod-a", 2 * BLOCK)
    assert hits_since(a, before) == 2 * BLOCK


@pytest.mark.skipif(shutil.which("curl") is None, reason="the README's client commands use curl")
def test_readme_client_commands_against_real_vllm(fleet) -> None:
    lines, rport, tmp = fleet["client"], fleet["rport"], fleet["tmp"]

    def client(line: str) -> str:
        line = line.replace("127.0.0.1:9000", f"127.0.0.1:{rport}")
        r = subprocess.run(["timeout", "120", "bash", "-c", line], cwd=tmp, capture_output=True, text=True)
        assert r.returncode == 0, (line, r.stdout, r.stderr)
        return r.stdout

    assert client(lines[0]).endswith('{"ready":true}')
    out = client(lines[1]).lower()
    assert "200 ok" in out and '"text_completion"' in out
    assert re.search(r"x-kvevents-pod: pod-[ab]", out)
    out = client(lines[2])
    assert out.rstrip().endswith("data: [DONE]") and "chat.completion.chunk" in out
    prompt = json.loads(re.search(r"-d '(.*?)'", lines[1]).group(1))["prompt"]
    # (pods quiet since the tests above stay routed: test_an_idle_pod_stays_routed_with_its_full_score)
    score = json.loads(client(lines[3]))
    # the engine's tokenizer (through pod /tokenize) is word-level: one token per word
    assert score["prompt_tokens"] == len(prompt.split())
    assert {p["pod"] for p in score["pods"]} == {"pod-a", "pod-b"}
    pods = json.loads(client(lines[4]))
    assert {p["name"] for p in pods["pods"]} == {"pod-a", "pod-b"}
    assert all(p["state"] == "SYNCED" and p["synced_once"] for p in pods["pods"])
    assert pods["unattributed"] == [] and pods["router"]["errors"] == {}
    # the router decoded every batch the real engines sent (vLLM 0.32's newer fields included)
    assert all(p["malformed"] == {} and not p["unrecoverable"] for p in pods["pods"])
    # the Prometheus scrape config: its target and credentials file fetch the router's metrics
    yaml = pytest.importorskip("yaml")
    (yaml_text,) = _blocks("yaml")
    job = yaml.safe_load(yaml_text)["scrape_configs"][0]
    target = job["static_configs"][0]["targets"][0].replace(":9000", f":{rport}")
    token = (tmp / job["authorization"]["credentials_file"]).read_text().strip()
    req = urllib.request.Request(f"http://{target}{job.get('metrics_path', '/metrics')}",
                                 headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200 and b"kvevents_router_" in r.read()
