"""The "Deploy with vLLM" page (docs/deploy-vllm.md), run command by command.

`vllm serve` is replaced by `python -m kvdemo.engine_http` (a simulated engine taking the same
arguments); hosts are mapped to 127.0.0.1 and every (host, port) to a free local port. vLLM
binds ``tcp://*:P`` on all interfaces; the tests bind loopback only, so the engine gets
``tcp://127.0.0.1:P'`` with ``"mode": "bind"`` (our KVEventsConfig's field for what the
wildcard means). The router's ``--host 0.0.0.0`` becomes 127.0.0.1 for the same reason.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvdemo.serve import free_tcp_ports

from .service_helpers import Http

ROOT = Path(__file__).resolve().parent.parent
SECTION = (ROOT / "docs" / "deploy-vllm.md").read_text()
BLOCKS = re.findall(r"```(\w+)\n(.*?)\n```", SECTION, re.S)


def _blocks(lang: str) -> list[str]:
    return [b for lg, b in BLOCKS if lg == lang]


class Ports:
    def __init__(self) -> None:
        self.map: dict[tuple[str, int], int] = {}

    def __call__(self, host: str, port: int) -> int:
        key = (host, int(port))
        if key not in self.map:
            self.map[key] = free_tcp_ports(1)[0]
            while list(self.map.values()).count(self.map[key]) > 1:
                self.map[key] = free_tcp_ports(1)[0]
        return self.map[key]


def _router_argv(line: str, ports: Ports) -> list[str]:
    argv = shlex.split(line)
    assert argv[:2] == ["kvevents", "router"], line
    argv = [a.replace("0.0.0.0", "127.0.0.1") for a in argv]
    i = argv.index("--port")
    argv[i + 1] = str(ports("router", int(argv[i + 1])))
    # the verb as the page runs it: the `kvevents` script of this environment, `router` from the
    # `kvevents.commands` entry-point group (kvservice.cli:register)
    script = Path(sys.executable).with_name("kvevents")
    return [str(script) if script.exists() else shutil.which("kvevents") or "kvevents", *argv[1:]]


@pytest.mark.skipif(shutil.which("curl") is None, reason="the page's client commands use curl")
def test_every_command_of_the_deploy_section_runs(tmp_path) -> None:
    ports = Ports()
    engines_block, router_block, client_block = _blocks("bash")
    (toml,) = _blocks("toml")
    (yaml_text,) = _blocks("yaml")
    procs: list[subprocess.Popen] = []
    try:
        # 1. the engines: `vllm serve ...` per pod, host from the comment above it
        host = None
        for line in engines_block.splitlines():
            m = re.match(r"# (pod-\w+), on ([\d.]+)", line)
            if m:
                host = m.group(2)
                continue
            argv = shlex.split(line)
            assert argv[:2] == ["vllm", "serve"] and host
            kv = json.loads(argv[argv.index("--kv-events-config") + 1])
            assert kv["enable_kv_cache_events"] is True and kv["publisher"] == "zmq" and kv["topic"] == ""
            for k in ("endpoint", "replay_endpoint"):
                p = int(kv[k].rsplit(":", 1)[1])
                assert kv[k] == f"tcp://*:{p}"
                kv[k] = f"tcp://127.0.0.1:{ports(host, p)}"
            kv["mode"] = "bind"
            argv[argv.index("--kv-events-config") + 1] = json.dumps(kv)
            i = argv.index("--port")
            argv[i + 1] = str(ports(host, int(argv[i + 1])))
            proc = subprocess.Popen([sys.executable, "-m", "kvdemo.engine_http", *argv[2:], "--host", "127.0.0.1"],
                                    stdout=subprocess.PIPE, text=True, cwd=tmp_path)
            procs.append(proc)
            assert proc.stdout.readline().startswith("simulated engine")
        assert len(procs) == 2
        # 2. router.toml, hosts and ports mapped
        cfg = re.sub(r"(10\.0\.0\.\d+):(\d+)", lambda m: f"127.0.0.1:{ports(m.group(1), int(m.group(2)))}", toml)
        (tmp_path / "router.toml").write_text(cfg)
        # 3. the token, then the router
        token_line, router_line = router_block.splitlines()
        subprocess.run(["bash", "-c", token_line], cwd=tmp_path, check=True)
        router = subprocess.Popen(_router_argv(router_line, ports), cwd=tmp_path, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        procs.append(router)
        assert router.stdout.readline().startswith("kvevents router: listening on http://127.0.0.1:")
        rport = ports("router", 9000)

        def client(line: str) -> str:
            line = line.replace("127.0.0.1:9000", f"127.0.0.1:{rport}")
            r = subprocess.run(["timeout", "60", "bash", "-c", line], cwd=tmp_path, capture_output=True, text=True)
            assert r.returncode == 0, (line, r.stdout, r.stderr)
            return r.stdout

        lines = client_block.splitlines()
        assert client(lines[0]).endswith('{"ready":true}')
        out = client(lines[1]).lower()
        assert "200 ok" in out and "x-kvevents-pod: pod-" in out and '"text_completion"' in out
        pod = re.search(r"x-kvevents-pod: (pod-\w)", out).group(1)
        out = client(lines[2])
        assert out.rstrip().endswith("data: [DONE]") and "chat.completion.chunk" in out
        prompt = json.loads(re.search(r"-d '(.*?)'", lines[1]).group(1))["prompt"]
        token = (tmp_path / "router.token").read_text().strip()
        http = Http(f"http://127.0.0.1:{rport}", token)

        def indexed():
            s = http.post("/v1/score", {"model": "Qwen/Qwen3-8B", "prompt": prompt})[1]
            return s["pods"] and s["pick"] == pod and s["pods"][0]["matched_tokens"] >= 32

        from .service_helpers import wait_for
        wait_for(indexed, what="the completion's prefix indexed")
        score = json.loads(client(lines[3]))
        assert score["pick"] == pod and score["prompt_tokens"] == len(prompt.split())
        assert score["pods"][0]["tokens_by_tier"] == {"GPU": 32}
        pods = json.loads(client(lines[4]))
        assert {p["name"] for p in pods["pods"]} == {"pod-a", "pod-b"}
        assert all(p["state"] == "SYNCED" and p["synced_once"] for p in pods["pods"])
        assert pods["unattributed"] == [] and pods["router"]["errors"] == {}
        # 4. the Prometheus scrape config: its target and credentials fetch the metrics the dashboards use
        yaml = pytest.importorskip("yaml")
        job = yaml.safe_load(yaml_text)["scrape_configs"][0]
        target = job["static_configs"][0]["targets"][0].replace(":9000", f":{rport}")
        cred = (tmp_path / job["authorization"]["credentials_file"]).read_text().strip()
        status, _h, text = Http(f"http://{target}", cred).call("GET", job.get("metrics_path", "/metrics"))
        assert status == 200
        served = set(re.findall(r"^([a-z_]+?)(?:_bucket|_count|_sum)?[{ ]", text.decode(), re.M))
        for dash in ("kvevents-routing.json", "kvevents-pipeline.json"):
            names = set(re.findall(r"kvevents_(?:router|subscriber)_[a-z_]+", (ROOT / "dashboards" / dash).read_text()))
            names = {re.sub(r"_(bucket|count|sum)$", "", n) for n in names}
            # series with no point yet (nothing evicted, no error, no gap...) are absent until they have one
            missing = {n for n in names - served if not re.search(r"errors|evicted|gaps|resets|unjoined|removals|"
                                                                   r"malformed|replay|recovered|lost|pending", n)}
            assert not missing, (dash, sorted(missing))
    finally:
        for p in reversed(procs):
            p.terminate()
        for p in procs:
            try:
                assert p.wait(10) == 0
            except subprocess.TimeoutExpired:
                p.kill()
