"""The service as a process: config file and flags, start-up errors, signals."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from kvevents import ZmqEventPublisher
from kvevents.errors import ConfigError
from kvservice.config import load_config

from .service_helpers import MODEL, Http, start_subprocess, stored, wait_for

TOML = """
[router]
model = "m"
block_size = 16
tier_weights = { CPU = 0.7 }

[api]
port = 0

[subscriber]
late_join = true
replay_timeout = 5.0

[[pods]]
name = "a"
endpoint = "{ep}"
replay_endpoint = "{rep}"
"""


def test_config_file_is_read_and_validated(tmp_path) -> None:
    p = tmp_path / "router.toml"
    p.write_text(TOML.replace("{ep}", "tcp://127.0.0.1:5557").replace("{rep}", "tcp://127.0.0.1:5558"))
    cfg = load_config(p).validate()
    rc = cfg.router_config()
    assert rc.model == "m" and rc.tier_weights["CPU"] == 0.7 and rc.tier_weights["GPU"] == 1.0
    assert rc.publisher_pods == {"a": "a"}
    assert cfg.pods[0].replay_endpoint == "tcp://127.0.0.1:5558"


@pytest.mark.parametrize("text,match", [
    ('[api]\nprot = 1\n', r"api\.prot: unknown key"),
    ('[router]\nmodle = "x"\n', r"router\.modle: unknown key"),
    ('[[pods]]\nname = "a"\nendpoint = "tcp://127.0.0.1:1"\nmodel = "m"\ndp = 2\n', r"pods\[0\]\.dp: unknown key"),
    ('[api]\nport = "80"\n', r"api\.port must be int"),
    ('[[pods]]\nname = "a"\nendpoint = "http://x:1"\nmodel = "m"\n', r"pods\[0\]\.endpoint .*no supported scheme"),
    ('[[pods]]\nendpoint = "tcp://127.0.0.1:1"\n', r"pods\[0\]\.name is required"),
    ('[[pods]]\nname = "a"\nendpoint = "tcp://127.0.0.1:1"\n', r"pods\[0\]\.model"),
    ('[router]\nblock_size = 0\n[[pods]]\nname = "a"\nendpoint = "tcp://127.0.0.1:1"\nmodel = "m"\n',
     r"^router\.block_size must be a positive int, got 0$"),
    ('[[pods]]\nname = "a"\nendpoint = "tcp://127.0.0.1:1"\nmodel = "m"\n[[pods]]\nname = "a"\n'
     'endpoint = "tcp://127.0.0.1:2"\nmodel = "m"\n', r"pods\[1\]\.name 'a' is given twice"),
    ('[api]\nproxy = true\n[[pods]]\nname = "a"\nendpoint = "tcp://127.0.0.1:1"\nmodel = "m"\n', r"pods\[\]\.http"),
    ("pods = 3\n", "pods must be an array"),
    ("x = [\n", "not valid TOML"),
])
def test_bad_config_names_the_key(tmp_path, text, match) -> None:
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_config(p).validate()


def test_yaml_config(tmp_path) -> None:
    pytest.importorskip("yaml")
    p = tmp_path / "router.yaml"
    p.write_text("router: {model: m}\npods:\n  - {name: a, endpoint: 'tcp://127.0.0.1:5557', data_parallel_size: 2}\n")
    cfg = load_config(p).validate()
    assert [ep for _i, ep, _r in cfg.pods[0].publishers()] == ["tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"]
    assert cfg.router_config().publisher_pods == {"a": "a", "a#dp1": "a"}


def test_bad_config_exits_2_with_one_line(tmp_path) -> None:
    p = tmp_path / "bad.toml"
    p.write_text('[api]\nprot = 1\n')
    r = subprocess.run([sys.executable, "-m", "kvservice", "--config", str(p)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"kvevents router: error: {p}: api.prot: unknown key (known: "
                                             "api_token_file, down_for, event_loop, fast_path, gil_switch_ms, "
                                             "host, max_body_bytes, port, proxy, tokenizer, upstream_timeout)"]
    r = subprocess.run([sys.executable, "-m", "kvservice", "--pod", "a=tcp://127.0.0.1:5557"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "pods[0].model" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_signals_stop_the_service(tmp_path, sig, code) -> None:
    ep, rep = f"ipc://{tmp_path}/a.pub", f"ipc://{tmp_path}/a.replay"
    pub = ZmqEventPublisher(ep, rep, topic="")
    cfg = tmp_path / "router.toml"
    cfg.write_text(TOML.replace("{ep}", ep).replace("{rep}", rep))
    proc, url = start_subprocess(["--config", str(cfg)])
    try:
        http = Http(url)
        wait_for(lambda: http.get("/readyz")[0] == 200, what="ready")
        pub.publish(stored(list(range(32)), [1, 2]))
        wait_for(lambda: http.post("/v1/pick", {"model": MODEL, "token_ids": list(range(32))})[1]["pick"] == "a",
                 what="indexed")
        t0 = time.monotonic()
        proc.send_signal(sig)
        assert proc.wait(timeout=10) == code
        assert time.monotonic() - t0 < 2.0
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        pub.shutdown(timeout=0.5)
