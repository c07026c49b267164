"""``"publisher": "kvevents"`` through vLLM's own config and command line (vLLM 0.32 and 0.33).

vLLM types ``KVEventsConfig.publisher`` as ``Literal["null", "zmq"]`` and validates
``--kv-events-config`` against it while reading the command line; ``register_publisher()``
widens that literal (``kvevents_vllm._config_compat``) and registers our constructor with
vLLM's ``EventPublisherFactory``. These run wherever vLLM's config, argument and kv_events
modules import (the CPU build and the components-only 0.33 venv alike); no engine.
"""

# no ``from __future__ import annotations``: vLLM's get_kwargs reads _Args's field types as objects
import dataclasses
import json
import os
import subprocess
import sys
import typing

import pytest
import vllm
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_events import EventPublisherFactory

from kvevents.errors import ConfigError, EndpointError
import kvevents_vllm
from kvevents_vllm import _config_compat
from kvevents_vllm.publisher import PUBLISHER_NAME, KVEventsPublisher, register_publisher
from kvevents_vllm.versions import SUPPORTED

from .engine import free_port


@dataclasses.dataclass
class _Args:
    kv_events_config: KVEventsConfig | None = None


def _parser():
    """``--kv-events-config`` exactly as vLLM's engine arguments add it (its argparse kwargs from
    vLLM's ``get_kwargs``, on vLLM's ``FlexibleArgumentParser``), without the rest of the engine's
    flags, whose defaults need a device platform (the components-only 0.33 venv has none)."""
    from vllm.engine.arg_utils import get_kwargs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    p = FlexibleArgumentParser()
    p.add_argument("--kv-events-config", **get_kwargs(_Args)["kv_events_config"])
    return p


@pytest.fixture(scope="module", autouse=True)
def registered():
    register_publisher()


def test_one_name() -> None:
    assert PUBLISHER_NAME == kvevents_vllm.PUBLISHER_NAME == "kvevents"


def test_tested_release() -> None:
    assert ".".join(vllm.__version__.split(".")[:2]) in SUPPORTED


def test_without_the_plugin_vllm_refuses_the_name() -> None:
    """What the workaround is for: vLLM alone rejects "kvevents" while reading its arguments."""
    code = ("from pydantic import TypeAdapter; from vllm.config.kv_events import KVEventsConfig;"
            "TypeAdapter(KVEventsConfig).validate_json('{\"publisher\": \"kvevents\"}')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "VLLM_PLUGINS": "none-of-them"})
    assert r.returncode != 0
    assert "literal_error" in r.stderr and "'null' or 'zmq'" in r.stderr, r.stderr[-2000:]


def _needs_platform(build):
    """``build()``, or a skip where this vLLM has no device platform (the components-only venv)."""
    try:
        return build()
    except RuntimeError as exc:  # "Failed to infer device type"
        if os.environ.get("KVEVENTS_REQUIRE_VLLM") == "1":
            raise
        pytest.skip(f"this vLLM cannot build its engine configuration here: {exc}")


def test_the_engines_own_parser_accepts_kvevents() -> None:
    """The whole ``vllm serve`` argument parser (as the API server builds it), plugin loaded."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = _needs_platform(lambda: AsyncEngineArgs.add_cli_args(FlexibleArgumentParser()))
    args = parser.parse_args(["--kv-events-config", json.dumps(
        {"enable_kv_cache_events": True, "publisher": "kvevents", "endpoint": "tcp://*:5557"})])
    assert args.kv_events_config.publisher == "kvevents"


def test_command_line_accepts_kvevents_and_the_factory_builds_ours() -> None:
    ep, rep = free_port(), free_port()
    args = _parser().parse_args(["--kv-events-config", json.dumps({
        "enable_kv_cache_events": True, "publisher": "kvevents", "endpoint": f"tcp://127.0.0.1:{ep}",
        "replay_endpoint": f"tcp://127.0.0.1:{rep}", "topic": "kv", "buffer_steps": 64})])
    cfg = args.kv_events_config
    assert isinstance(cfg, KVEventsConfig) and cfg.publisher == PUBLISHER_NAME
    pub = EventPublisherFactory.create(cfg, data_parallel_rank=0)
    try:
        assert isinstance(pub, KVEventsPublisher)
        resolved = pub.get_publisher_config()
        assert (resolved.publisher, resolved.endpoint, resolved.replay_endpoint, resolved.topic,
                resolved.buffer_steps) == ("kvevents", f"tcp://127.0.0.1:{ep}", f"tcp://127.0.0.1:{rep}", "kv", 64)
    finally:
        pub.shutdown()


def test_from_python_pass_a_config_object() -> None:
    """docs/vllm.md: VllmConfig keeps its own copy of the old schema for a dict; an object passes."""
    from pydantic import ValidationError
    from vllm.config import VllmConfig

    cfg = _needs_platform(lambda: VllmConfig(
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="kvevents")))
    assert cfg.kv_events_config.publisher == "kvevents"
    with pytest.raises(ValidationError, match="literal_error"):
        VllmConfig(kv_events_config={"enable_kv_cache_events": True, "publisher": "kvevents"})


def test_dotted_flags_work_too() -> None:
    args = _parser().parse_args(["--kv-events-config.publisher", "kvevents",
                                 "--kv-events-config.enable_kv_cache_events", "true"])
    assert args.kv_events_config.publisher == "kvevents"


@pytest.mark.parametrize("name", ["null", "zmq"])
def test_vllms_own_names_still_valid(name: str) -> None:
    assert _parser().parse_args(["--kv-events-config", json.dumps({"publisher": name})]).kv_events_config.publisher == name


def test_other_names_and_unknown_keys_still_refused(capsys) -> None:
    p = _parser()
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-events-config", json.dumps({"publisher": "kvevent"})])
    assert "'null', 'zmq' or 'kvevents'" in capsys.readouterr().err
    # vLLM's config forbids keys it does not know: the error names the key
    with pytest.raises(SystemExit):
        p.parse_args(["--kv-events-config", json.dumps({"publisher": "kvevents", "overflw": "x"})])
    err = capsys.readouterr().err
    assert "overflw" in err and "unexpected_keyword_argument" in err


def test_widening_is_idempotent() -> None:
    before = typing.get_args(KVEventsConfig.__dataclass_fields__["publisher"].type)
    register_publisher()
    assert _config_compat.accept_publisher_name(KVEventsConfig, PUBLISHER_NAME) is False
    after = typing.get_args(KVEventsConfig.__dataclass_fields__["publisher"].type)
    assert before == after and after.count("kvevents") == 1 and after[:2] == ("null", "zmq")
    assert KVEventsConfig().publisher == "null"  # the default is untouched
    assert KVEventsConfig(enable_kv_cache_events=True).publisher == "zmq"


def test_a_field_not_a_literal_is_refused_with_one_line() -> None:
    from pydantic.dataclasses import dataclass

    @dataclass
    class Other:
        publisher: str = "zmq"

    with pytest.raises(ConfigError) as exc:
        _config_compat.accept_publisher_name(Other, "kvevents")
    assert "\n" not in str(exc.value) and "not a Literal" in str(exc.value)


def test_unsupported_vllm_release_fails_with_one_line(monkeypatch) -> None:
    monkeypatch.setattr(vllm, "__version__", "0.31.2")
    with pytest.raises(ConfigError) as exc:
        register_publisher()
    msg = str(exc.value)
    assert "\n" not in msg and "0.31.2" in msg and "not supported" in msg


def test_unknown_config_key_fails_with_one_line() -> None:
    """A field a later vLLM adds reaches our constructor through the factory: refused by name."""
    with pytest.raises(ConfigError) as exc:
        KVEventsPublisher(data_parallel_rank=0, endpoint=f"tcp://127.0.0.1:{free_port()}", compression="zstd")
    msg = str(exc.value)
    assert "\n" not in msg and "'compression'" in msg


def test_unusable_endpoint_fails_with_one_line() -> None:
    with pytest.raises(EndpointError) as exc:
        KVEventsPublisher(data_parallel_rank=0, endpoint="tcp://*:0")
    assert "\n" not in str(exc.value) and "tcp://*:0" in str(exc.value)


def test_name_taken_by_another_plugin(monkeypatch) -> None:
    import kvevents_vllm.publisher as mod

    monkeypatch.setattr(mod, "_registered", False)  # as if this process had not registered it
    with pytest.raises(ConfigError) as exc:
        register_publisher()
    assert "already has a KV-events publisher named 'kvevents'" in str(exc.value)
