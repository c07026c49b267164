"""The vLLM integration suite: runs only where vLLM is installed.

- In the project's own venv (no vLLM) every module here is left uncollected, so the main
  ``python -m pytest`` run passes without vLLM.
- The real-engine run sets ``KVEVENTS_REQUIRE_VLLM=1``
  (``bash tests/vllm/setup-venv.sh .vllm-venv && KVEVENTS_REQUIRE_VLLM=1 .vllm-venv/bin/python
  -m pytest -q tests/vllm``): there a missing vLLM, or a vLLM that cannot start an engine, is a
  failure, never a skip.
- A vLLM without its OpenAI server (the components-only 0.33 venv of ``shared/peers``) runs the
  unit tests; the engine tests skip there unless ``KVEVENTS_REQUIRE_VLLM=1``.

Fixtures: ``tiny_model`` (session: the random-weight Llama and its tokenizer, written once, see
``engine.py``), ``engine_log_dir`` (session: where every engine's log goes).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

REQUIRE = os.environ.get("KVEVENTS_REQUIRE_VLLM") == "1"


def _has(module: str) -> bool:
    """``module`` is installed as a real module or package (not a bare directory on the path)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin is not None


HAVE_VLLM = _has("vllm")
HAVE_ENGINE = HAVE_VLLM and _has("vllm.entrypoints.openai.api_server") and _has("torch")

if not HAVE_VLLM:
    if REQUIRE:
        raise pytest.UsageError(
            f"KVEVENTS_REQUIRE_VLLM=1 but vllm is not importable by {sys.executable}: "
            "run bash tests/vllm/setup-venv.sh DIR and use DIR/bin/python")
    collect_ignore_glob = ["test_*.py"]


def pytest_collection_modifyitems(config, items):
    if HAVE_ENGINE or REQUIRE:
        return
    skip = pytest.mark.skip(reason="this vLLM install cannot run an engine (no OpenAI server)")
    for item in items:
        if "tiny_model" in getattr(item, "fixturenames", ()):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def engine_log_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engine-logs")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from .engine import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
