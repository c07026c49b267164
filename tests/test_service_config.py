"""The router service's config file read into msgspec Structs (issue 25): an unknown key, a wrong
type or a value out of range is refused with one line naming the key by msgspec's path, in every
section, in a list of tables, and for a command-line flag as for the file."""

from __future__ import annotations

import argparse

import msgspec
import msgspec.inspect as mi
import pytest

from kvevents.errors import ConfigError
from kvservice.cli import add_arguments, build_config
from kvservice.config import ServiceConfig, load_config

POD = '[[pods]]\nname = "a"\nendpoint = "tcp://127.0.0.1:5557"\nmodel = "m"\n'


def _load(tmp_path, text: str) -> str:
    """The one line of the ConfigError that loading (and validating) ``text`` raises, less the file."""
    p = tmp_path / "router.toml"
    p.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_config(p).validate()
    line = str(exc.value)
    assert "\n" not in line
    return line.removeprefix(f"{p}: ")


def _known(*path: str) -> str:
    t = mi.type_info(ServiceConfig)
    for name in path:
        t = next(f.type for f in t.fields if f.name == name)
        t = getattr(t, "item_type", t)
    return ", ".join(sorted(f.name for f in t.fields))


@pytest.mark.parametrize("section", ["router", "api", "subscriber", "http", "proxy"])
def test_an_unknown_key_in_each_section_is_named_with_its_path_and_the_known_keys(tmp_path, section) -> None:
    line = _load(tmp_path, f"[{section}]\nstale_afterr = 1\n{POD}")
    assert line == f"{section}.stale_afterr: unknown key (known: {_known(section)})"


def test_an_unknown_key_at_the_top_and_in_a_list_of_tables_is_named_with_its_path(tmp_path) -> None:
    assert _load(tmp_path, f"plane = 1\n{POD}") == (
        "plane: unknown key (known: api, http, pods, proxy, router, subscriber)")
    line = _load(tmp_path, POD + POD.replace('"a"', '"b"') + POD.replace('"a"', '"c"') + "dp = 2\n")
    assert line == f"pods[2].dp: unknown key (known: {_known('pods')})"
    assert _load(tmp_path, POD + '[[pods]]\nendpoint = "tcp://127.0.0.1:1"\n') == "pods[1].name is required"
    assert _load(tmp_path, '[api]\n"po\\nrt" = 1\n' + POD).startswith("api.po\\nrt: unknown key")  # still one line


@pytest.mark.parametrize("text, line", [
    ('[api]\nport = "80"\n', "api.port must be int, got '80'"),
    ("[api]\nport = true\n", "api.port must be int, got True"),
    ("[api]\ntokenizer = 3\n", "api.tokenizer must be str, got 3"),
    ('[subscriber]\nlate_join = "yes"\n', "subscriber.late_join must be bool, got 'yes'"),
    ('[http]\nmax_connections = "many"\n', "http.max_connections must be int, got 'many'"),
    ('[proxy]\nconnect_timeout = "3"\n', "proxy.connect_timeout must be float, got '3'"),
    ('[proxy]\nretry_statuses = 503\n', "proxy.retry_statuses must be an array, got 503"),
    # the hand parser let these two through (a str weight, used at the first score) and raised a
    # TypeError traceback for the third
    ('[router]\nload_weight = "heavy"\n', "router.load_weight must be float, got 'heavy'"),
    ('[router]\ndefault_tier_weight = "x"\n', "router.default_tier_weight must be float, got 'x'"),
    ('[router]\nmax_learned = "lots"\n', "router.max_learned must be int, got 'lots'"),
    ("router = 3\n", "router must be a table, got 3"),
    ("pods = [3]\n", "pods[0] must be a table, got 3"),
])
def test_a_wrong_type_is_named_with_its_path_and_the_value(tmp_path, text, line) -> None:
    assert _load(tmp_path, text + (POD if "pods" not in text else "")) == line


@pytest.mark.parametrize("text, line", [
    ("[api]\nport = 70000\n", "api.port must be int <= 65535, got 70000"),
    ("[api]\nmax_body_bytes = 10\n", "api.max_body_bytes must be int >= 1024, got 10"),
    ('[api]\nevent_loop = "trio"\n', "api.event_loop must be one of asyncio, auto, uvloop, got 'trio'"),
    ("[subscriber]\npoll_interval = 2\n", "subscriber.poll_interval must be float <= 1.0, got 2"),
    ("[subscriber]\nstale_after = 0\n", "subscriber.stale_after must be float > 0.0, got 0"),
    ('[subscriber]\nevent_plane = "tcp://127.0.0.1:4222"\n',
     "subscriber.event_plane must be a nats://HOST:PORT URL, got 'tcp://127.0.0.1:4222'"),
    ("[http]\nmax_head_bytes = 2097152\n", "http.max_head_bytes must be int <= 1048576, got 2097152"),
    ("[proxy]\nkv_weight = inf\n", "proxy.kv_weight must be a finite number, got inf"),
    ("[proxy]\nretry_statuses = [503, 200]\n", "proxy.retry_statuses[1] must be int >= 400, got 200"),
    ("[proxy]\noverload_status = 500\n", "proxy.overload_status must be one of 429, 503, got 500"),
    ("[router]\nblock_size = 0\n", "router.block_size must be a positive int, got 0"),
])
def test_a_value_out_of_range_is_named_with_its_path(tmp_path, text, line) -> None:
    assert _load(tmp_path, text + POD) == line


def test_a_bad_value_in_a_list_of_tables_is_named_with_its_index(tmp_path) -> None:
    second = POD.replace('"a"', '"b"')
    assert _load(tmp_path, POD + second + "data_parallel_size = 0\n") == (
        "pods[1].data_parallel_size must be int >= 1, got 0")
    assert _load(tmp_path, POD + second.replace('name = "b"', 'name = "b#1"')) == (
        "pods[1].name must be a non-empty string without '#', got 'b#1'")
    assert _load(tmp_path, POD + second + 'http = "ftp://x"\n') == (
        "pods[1].http must be an http:// or https:// URL, got 'ftp://x'")


def test_yaml_is_decoded_by_the_same_rules(tmp_path) -> None:
    pytest.importorskip("yaml")
    p = tmp_path / "router.yaml"
    p.write_text("router: {model: m}\npods:\n  - {name: a, endpoint: 'tcp://127.0.0.1:5557', data_parallel_size: x}\n")
    with pytest.raises(ConfigError, match=r"^\S+router\.yaml: pods\[0\]\.data_parallel_size must be int, got 'x'$"):
        load_config(p)


def _flags(*argv: str):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return build_config(parser.parse_args(list(argv)))


def test_command_line_flags_meet_the_file_s_rules_and_win(tmp_path) -> None:
    p = tmp_path / "router.toml"
    p.write_text('[api]\nport = 9000\n[subscriber]\nstale_after = 3.0\n' + POD)
    cfg = _flags("--config", str(p), "--port", "9100", "--pod", "b=tcp://127.0.0.1:5600,dp=2", "--model", "m")
    assert (cfg.api.port, cfg.subscriber.stale_after, cfg.router.model) == (9100, 3.0, "m")
    assert [(q.name, q.data_parallel_size) for q in cfg.pods] == [("a", 1), ("b", 2)]
    cfg = _flags("--config", str(p), "--pod", "a=tcp://127.0.0.1:5700,model=x", "--no-late-join")
    assert [(q.name, q.endpoint, q.model) for q in cfg.pods] == [("a", "tcp://127.0.0.1:5700", "x")]
    assert cfg.subscriber.late_join is False and cfg.api.port == 9000
    for argv, line in ((["--port", "70000"], "api.port must be int <= 65535, got 70000"),
                       (["--stale-after", "0"], "subscriber.stale_after must be float > 0.0, got 0.0"),
                       (["--block-size", "0"], "router.block_size must be a positive int, got 0"),
                       (["--model", ""], "router.model must be str of length >= 1, got ''")):
        with pytest.raises(ConfigError) as exc:
            _flags("--config", str(p), *argv)
        assert str(exc.value) == line
    with pytest.raises(ConfigError, match=r"^pods\[1\]\.name must be a non-empty string without '#', got 'b#1'$"):
        _flags("--config", str(p), "--pod", "b#1=tcp://127.0.0.1:5600")


def test_every_section_is_a_struct_that_refuses_unknown_keys() -> None:
    """One decoding path: a section added as a plain class would skip msgspec's checks."""
    seen = []

    def walk(t):
        if isinstance(t, mi.StructType):
            assert t.forbid_unknown_fields, t.cls
            seen.append(t.cls.__name__)
            for f in t.fields:
                walk(f.type)
        elif isinstance(t, (mi.ListType, mi.DictType)):
            walk(getattr(t, "item_type", None) or t.value_type)
        elif isinstance(t, mi.UnionType):
            for u in t.types:
                walk(u)

    walk(mi.type_info(ServiceConfig))
    assert sorted(seen) == ["ApiConfig", "HttpConfig", "PodConfig", "ProxyConfig", "RouterSection", "ServiceConfig",
                            "SubscriberConfig"]
    assert msgspec.to_builtins(ServiceConfig()) == msgspec.to_builtins(msgspec.convert({}, ServiceConfig))
