"""The README and the docs pages document what the code does: the metric table is the catalogue's,
the commands they name exist, the README's quick start runs, the config reference names real keys."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from kvevents.telemetry import render_markdown_table

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = {p.name: p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))}


def test_metric_table_is_the_catalogue() -> None:
    m = re.search(r"<!-- metrics-table:start -->\n(.*?)\n<!-- metrics-table:end -->", DOCS["metrics.md"], re.S)
    assert m, "docs/metrics.md lost its metrics-table markers"
    assert m.group(1).strip() == render_markdown_table().strip(), (
        "docs/metrics.md's metric table is stale: paste render_markdown_table() between the markers")


def test_top_has_exactly_two_setup_commands_and_ci_runs_the_second() -> None:
    block = re.search(r"```bash\n(.*?)\n```", README, re.S).group(1).splitlines()
    assert len(block) == 2
    assert block[0].endswith("kvevents demo")
    ci = (ROOT / ".ci" / "run").read_text()
    assert block[1] in ci


def test_documented_verbs_exist() -> None:
    out = subprocess.run(["kvevents", "--help"], capture_output=True, text=True, check=True).stdout
    verbs = {}
    for name, text in {"README.md": README, **{f"docs/{n}": t for n, t in DOCS.items()}}.items():
        for row in re.findall(r"^\| `kvevents [^|]*\|", text, re.M):  # a command table's first cell
            for verb in re.findall(r"`kvevents (\w[\w-]*)", row):
                verbs.setdefault(verb, name)
    assert {"demo", "router", "bridge", "tail", "record", "replay", "inspect", "convert-capture"} <= set(verbs)
    for verb, where in verbs.items():
        assert verb in out, f"{where} documents `kvevents {verb}`, which `kvevents --help` does not list"


def test_the_engine_developers_quick_start_runs(tmp_path) -> None:
    """The README's first Python block, as written, with its ipc:// paths moved into tmp_path."""
    section = README.split("## Quick start: engine developer", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)\n```", section, re.S).group(1)
    assert "ipc:///tmp/" in code
    code = code.replace("ipc:///tmp/", f"ipc://{tmp_path}/")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    engine, manager, report = done.stdout.strip().splitlines()[-3:]
    assert "'requests_finished': 8" in engine and "'gpu_hit_tokens': 0" not in engine
    assert "'cascade_jobs': " in manager and "'cascade_jobs': 0" not in manager  # the CPU tier fed the file tier
    assert report.startswith("ShutdownReport(") and "unsent=0" in report


def _keys(page: str, heading: str) -> list[str]:
    """The first column of the table under ``heading`` (backquoted names, several per cell)."""
    part = page.split(heading, 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| ([^|]+) \|", part, re.M)
    return [k for row in rows if not set(row.strip()) <= {"-", " "} for k in re.findall(r"`([a-z_]+)`", row)]


def test_the_router_service_config_reference_names_real_keys() -> None:
    from kvservice.config import ROUTER_KEYS, ApiConfig, PodConfig, SubscriberConfig

    page = DOCS["router-service.md"]
    assert set(_keys(page, "### `[router]`")) == set(ROUTER_KEYS)
    for heading, cls in (("### `[api]`", ApiConfig), ("### `[subscriber]`", SubscriberConfig),
                         ("### `[[pods]]`", PodConfig)):
        documented = set(_keys(page, heading))
        real = set(cls.__struct_fields__)
        assert documented and documented <= real, f"{heading}: {sorted(documented - real)} are not config keys"


def _router_commands() -> list[tuple[str, str]]:
    """``(where, command)`` for each ``kvevents router ...`` line of a bash block in the README and
    docs (continuation lines joined); those reading a ``--config`` file are run by
    tests/test_service_deploy.py instead."""
    out = []
    for name, text in {"README.md": README, **{f"docs/{n}": t for n, t in DOCS.items()}}.items():
        for block in re.findall(r"```bash\n(.*?)\n```", text, re.S):
            for line in block.replace("\\\n", " ").splitlines():
                if line.startswith("kvevents router") and "--config" not in line:
                    out.append((name, line))
    return out


def test_documented_router_commands_parse_and_validate() -> None:
    import argparse
    import shlex

    from kvservice.cli import add_arguments, build_config

    commands = _router_commands()
    assert {"README.md", "docs/router-service.md", "docs/event-plane.md"} <= {w for w, _ in commands}
    for where, line in commands:
        parser = argparse.ArgumentParser(prog="kvevents router")
        add_arguments(parser)
        try:
            cfg = build_config(parser.parse_args(shlex.split(line)[2:]))
        except SystemExit:
            raise AssertionError(f"{where}: {line!r} does not parse") from None
        assert cfg.pods or cfg.subscriber.event_plane, (where, line)
