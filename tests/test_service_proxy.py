"""The OpenAI-compatible proxy through the router service to simulated engines (real HTTP, real
ZeroMQ, loopback and ipc:// only)."""

from __future__ import annotations

import json

import pytest

from kvdemo.serve import SimEngineFleet
from kvservice.config import from_dict

from .service_helpers import Http, InProcessService, wait_for

MODEL = "demo-model"


@pytest.fixture
def proxied():
    fleet = SimEngineFleet(engines=3, model=MODEL).start()
    cfg = fleet.config(proxy=True)
    cfg["proxy"] = {"breaker_failures": 1}
    svc = InProcessService(from_dict(cfg).validate())
    try:
        wait_for(lambda: svc.http.get("/readyz")[0] == 200, what="ready")
        yield fleet, svc
    finally:
        svc.close()
        fleet.close()


PROMPT = list(range(5000, 5000 + 160))  # 10 blocks


def _complete(http: Http, body: dict, path: str = "/v1/completions"):
    return http.call("POST", path, {"model": MODEL, "max_tokens": 3, **body})


def _lower(headers: dict) -> dict:
    return {k.lower(): v for k, v in headers.items()}  # header names as the pod wrote them


def _sse(data: bytes) -> list:
    events = [line[6:] for line in data.decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_completions_go_where_the_prefix_is_and_say_so(proxied) -> None:
    fleet, svc = proxied
    http = svc.http
    status, headers, data = _complete(http, {"prompt": PROMPT})
    assert status == 200, data
    first = headers["x-kvevents-pod"]
    assert first in {p.name for p in fleet.pods}
    body = json.loads(data)
    assert body["object"] == "text_completion" and body["usage"]["prompt_tokens"] == len(PROMPT)
    # once the engine's KV events reached the router, the same prefix goes back to the same pod
    wait_for(lambda: http.post("/v1/pick", {"token_ids": PROMPT})[1]["pick"] == first, what="prefix indexed")
    status, headers, _ = _complete(http, {"prompt": PROMPT + [7, 8, 9]})
    assert status == 200 and headers["x-kvevents-pod"] == first
    assert int(headers["x-kvevents-matched-tokens"]) >= 144
    # streaming: server-sent events passed through, chunk by chunk, ending in [DONE]
    status, headers, data = _complete(http, {"prompt": PROMPT, "stream": True})
    assert status == 200 and _lower(headers)["content-type"].startswith("text/event-stream")
    assert headers["x-kvevents-pod"] == first
    chunks = _sse(data)
    assert len(chunks) == 3 and chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_with_the_pods_tokenizer(proxied) -> None:
    """No local tokenizer: the router asks a pod's /tokenize, so it scores the ids the engine runs."""
    fleet, svc = proxied
    http = svc.http
    msgs = [{"role": "system", "content": " ".join(f"rule{i}" for i in range(60))},
            {"role": "user", "content": "hello there"}]
    status, headers, data = _complete(http, {"messages": msgs}, "/v1/chat/completions")
    assert status == 200, data
    pod = headers["x-kvevents-pod"]
    assert json.loads(data)["choices"][0]["message"]["role"] == "assistant"
    wait_for(lambda: http.post("/v1/score", {"messages": msgs})[1]["pick"] == pod, what="chat prefix indexed")
    status, score = http.post("/v1/score", {"messages": msgs})
    best = score["pods"][0]
    assert best["pod"] == pod and best["matched_tokens"] >= 48
    status, headers, data = _complete(http, {"messages": msgs, "stream": True}, "/v1/chat/completions")
    assert status == 200 and headers["x-kvevents-pod"] == pod
    chunks = _sse(data)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"


def test_a_killed_pod_is_skipped_counted_and_named(proxied) -> None:
    fleet, svc = proxied
    http = svc.http
    status, headers, _ = _complete(http, {"prompt": PROMPT})
    victim = headers["x-kvevents-pod"]
    wait_for(lambda: http.post("/v1/pick", {"token_ids": PROMPT})[1]["pick"] == victim, what="prefix indexed")
    fleet.kill(victim)  # its HTTP server is gone: connections are refused
    status, headers, data = _complete(http, {"prompt": PROMPT})
    assert status == 200, data
    assert headers["x-kvevents-pod"] != victim and headers["x-kvevents-attempts"] == "2"
    # its breaker is open: the next request does not try it
    status, headers, _ = _complete(http, {"prompt": PROMPT, "stream": True})
    assert status == 200 and headers["x-kvevents-pod"] != victim and headers["x-kvevents-attempts"] == "1"
    text = http.call("GET", "/metrics")[2].decode()
    assert f'kvservice_proxy_requests_total{{pod="{victim}",outcome="refused"}} 1' in text
    assert "kvservice_proxy_retries_total 1" in text
    assert f'kvservice_pod_down{{pod="{victim}"}} 1' in text
    pods = {p["name"]: p for p in http.get("/v1/pods")[1]["pods"]}
    assert pods[victim]["proxy_down"] is True and sum(p["proxy_down"] for p in pods.values()) == 1


def test_proxy_errors_are_json(proxied) -> None:
    _fleet, svc = proxied
    http = svc.http
    status, err = http.post("/v1/completions", {"model": "nope", "prompt": "x"})
    assert status == 404 and err["error"]["field"] == "model"
    status, err = http.post("/v1/completions", {"model": MODEL})
    assert status == 400 and err["error"]["field"] == "prompt"
    status, err = http.post("/v1/chat/completions", {"model": MODEL, "messages": "hi"})
    assert status == 400 and err["error"]["field"] == "messages"
    status, _h, data = http.call("POST", "/v1/completions", raw=b"[")
    assert status == 400 and b"not valid JSON" in data
    # the engine's own 4xx passes through unchanged (not retried elsewhere)
    status, headers, data = _complete(http, {"prompt": PROMPT, "max_tokens": 0})
    assert status == 400 and json.loads(data)["param"] == "max_tokens" and headers["x-kvevents-attempts"] == "1"


def _tiny_tokenizer(d) -> None:
    """A word-level tokenizer.json and a chat template, written here (no download)."""
    vocab = {"[UNK]": 0, "<s>": 1}
    for i in range(200):
        vocab[f"w{i}"] = len(vocab)
    for w in ("<|user|>", "<|assistant|>", "<|system|>", "hello"):
        vocab[w] = len(vocab)
    tok = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
           "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None,
           "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}}
    (d / "tokenizer.json").write_text(json.dumps(tok))
    tmpl = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": tmpl, "bos_token": "<s>"}))


def test_local_tokenizer_matches_the_engine(tmp_path) -> None:
    pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    _tiny_tokenizer(tmp_path)
    fleet = SimEngineFleet(engines=2, model=MODEL, tokenizer=str(tmp_path)).start()
    cfg = fleet.config(proxy=True)
    cfg["api"]["tokenizer"] = str(tmp_path)
    svc = InProcessService(from_dict(cfg).validate())
    try:
        http = svc.http
        text = " ".join(f"w{i % 200}" for i in range(100))
        msgs = [{"role": "user", "content": text}]
        engine = Http(fleet.pods[0].url)
        want = engine.post("/tokenize", {"model": MODEL, "messages": msgs})[1]["tokens"]
        assert want[0] == 202 and 0 not in want  # "<|user|>", no unknown words
        status, headers, _ = _complete(http, {"messages": msgs}, "/v1/chat/completions")
        assert status == 200
        pod = headers["x-kvevents-pod"]
        full = len(want) // 16 * 16  # the pod's events may arrive in several batches: wait for them all

        def indexed() -> bool:
            score = http.post("/v1/score", {"token_ids": want})[1]
            return score["pick"] == pod and score["pods"][0]["matched_tokens"] == full

        wait_for(indexed, what="every block of the chat indexed")
        status, score = http.post("/v1/score", {"messages": msgs})
        assert score["prompt_tokens"] == len(want) and score["pods"][0]["matched_tokens"] == len(want) // 16 * 16
        status, score = http.post("/v1/score", {"prompt": text})
        assert score["prompt_tokens"] == 100
    finally:
        svc.close()
        fleet.close()


def test_missing_tokenizers_package_is_a_clear_error(tmp_path, monkeypatch) -> None:
    import builtins

    from kvevents.errors import ConfigError
    from kvservice.tokens import LocalTokenizer

    real = builtins.__import__

    def no_tokenizers(name, *a, **kw):
        if name == "tokenizers":
            raise ImportError("no tokenizers")
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_tokenizers)
    with pytest.raises(ConfigError, match=r"pip install 'kvevents\[service\]'"):
        LocalTokenizer(tmp_path)
