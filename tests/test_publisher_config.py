"""KVEventsConfig (the publisher's settings) read through kvevents.settings: one line naming the key."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import pytest

from kvdemo.engine_http import main as engine_main
from kvevents import ConfigError, EventPublisherFactory, KVEventsConfig, NullEventPublisher, ZmqEventPublisher
from kvevents.transport.zmq.publisher import OVERFLOW_POLICIES

from .pubsub_helpers import ipc_pair

KNOWN = ("buffer_bytes, buffer_steps, enable_kv_cache_events, endpoint, hwm, legacy, max_queue_size, mode, "
         "overflow, publisher, replay_burst, replay_endpoint, replay_rate, topic")


@pytest.mark.parametrize("data, line", [
    ({"endpoint": "tcp://*:1", "bogus": 1}, f"bogus: unknown key (known: {KNOWN})"),
    ({"hwm": "lots"}, "hwm must be int, got 'lots'"),
    ({"enable_kv_cache_events": "yes"}, "enable_kv_cache_events must be bool, got 'yes'"),
    ({"topic": None}, "topic must be str, got None"),
    ({"buffer_steps": 2.5}, "buffer_steps must be int, got 2.5"),
    ({"buffer_bytes": -1}, "buffer_bytes must be int >= 1, got -1"),
    ({"max_queue_size": 0}, "max_queue_size must be int >= 1, got 0"),
    ({"hwm": -1}, "hwm must be int >= 0, got -1"),
    ({"replay_rate": 0}, "replay_rate must be float > 0.0, got 0"),
    ({"replay_burst": 0}, "replay_burst must be int >= 1, got 0"),
    ({"overflow": "sometimes"}, "overflow must be one of drop_oldest, replay_only, got 'sometimes'"),
    ({"mode": "both"}, "mode must be one of auto, bind, connect, got 'both'"),
    (["endpoint"], "KVEventsConfig must be a mapping, got ['endpoint']"),
])
def test_a_bad_setting_is_one_line_naming_the_key(data: Any, line: str) -> None:
    with pytest.raises(ConfigError) as err:
        KVEventsConfig.from_dict(data)
    assert str(err.value) == line


@pytest.mark.parametrize("data", [
    {},
    # what docs/deploy-vllm.md hands vLLM (and kvdemo.engine_http reads the same way)
    {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
     "replay_endpoint": "tcp://*:5558", "topic": ""},
    {"enable_kv_cache_events": True, "publisher": "nats", "endpoint": "nats://127.0.0.1:4222", "topic": "kv@p@m"},
    {"enable_kv_cache_events": False, "publisher": "null", "endpoint": "ipc:///tmp/x", "replay_endpoint": None,
     "buffer_steps": 1, "hwm": 0, "max_queue_size": 1, "topic": "t", "buffer_bytes": 1, "overflow": "drop_oldest",
     "replay_rate": 1, "replay_burst": 1, "mode": "connect", "legacy": True},
])
def test_the_configs_accepted_before_still_build(data: dict[str, Any]) -> None:
    cfg = KVEventsConfig.from_dict(data)
    assert cfg == KVEventsConfig(**data)
    kw = cfg.publisher_kwargs()
    assert set(kw) == set(KNOWN.split(", ")) - {"enable_kv_cache_events", "publisher"}
    assert all(kw[k] == v for k, v in data.items() if k in kw)


def test_every_publisher_setting_is_an_argument_of_the_zmq_publisher_and_the_literals_agree() -> None:
    params = inspect.signature(ZmqEventPublisher).parameters
    assert set(KVEventsConfig().publisher_kwargs()) <= set(params)
    assert OVERFLOW_POLICIES == ("replay_only", "drop_oldest")


def test_the_factory_checks_a_config_built_by_keywords() -> None:
    """Keyword construction skips msgspec's checks; the factory makes them, whichever publisher is
    named (the null and NATS publishers read few of these settings themselves)."""
    with pytest.raises(ConfigError) as err:
        EventPublisherFactory.create(KVEventsConfig(enable_kv_cache_events=True, publisher="null",
                                                    overflow="sometimes"))  # type: ignore[arg-type]
    assert str(err.value) == "overflow must be one of drop_oldest, replay_only, got 'sometimes'"
    with pytest.raises(ConfigError) as err:
        EventPublisherFactory.create(KVEventsConfig(enable_kv_cache_events=True, publisher="nats",
                                                    endpoint="nats://127.0.0.1:1",
                                                    hwm="lots"))  # type: ignore[arg-type]
    assert str(err.value) == "hwm must be int, got 'lots'"
    with pytest.raises(ConfigError) as err:  # before any socket is opened
        EventPublisherFactory.create(KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                    endpoint=ipc_pair()[0], buffer_bytes=-1))
    assert str(err.value) == "buffer_bytes must be int >= 1, got -1"
    assert isinstance(EventPublisherFactory.create(KVEventsConfig(enable_kv_cache_events=True)), NullEventPublisher)


def test_the_simulated_engine_refuses_a_bad_kv_events_config_in_one_line(capsys) -> None:
    bad = '{"enable_kv_cache_events": true, "replay_rate": -1}'
    assert engine_main(["m", "--port", "0", "--kv-events-config", bad]) == 2
    assert capsys.readouterr().err == ("engine_http: error: --kv-events-config: "
                                       "replay_rate must be float > 0.0, got -1\n")


def test_the_docs_name_every_publisher_setting_and_no_other() -> None:
    text = (Path(__file__).parent.parent / "docs" / "wire-and-transport.md").read_text()
    listing = text[text.index("`KVEventsConfig` mirrors"):text.index("`EventPublisherFactory.create(config")]
    assert set(re.findall(r"`(\w+)`", listing)) - {"KVEventsConfig"} == set(KNOWN.split(", "))
