"""The README documents what the code does: its metric table is the catalogue's, its commands exist."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from kvevents.telemetry import render_markdown_table

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def test_metric_table_is_the_catalogue() -> None:
    m = re.search(r"<!-- metrics-table:start -->\n(.*?)\n<!-- metrics-table:end -->", README, re.S)
    assert m, "README lost its metrics-table markers"
    assert m.group(1).strip() == render_markdown_table().strip(), (
        "README metric table is stale: paste render_markdown_table() between the markers")


def test_top_has_exactly_two_setup_commands_and_ci_runs_the_second() -> None:
    block = re.search(r"```bash\n(.*?)\n```", README, re.S).group(1).splitlines()
    assert len(block) == 2
    assert block[0].endswith("kvevents demo")
    ci = (ROOT / ".ci" / "run").read_text()
    assert block[1] in ci


def test_documented_verbs_exist() -> None:
    out = subprocess.run(["kvevents", "--help"], capture_output=True, text=True, check=True).stdout
    for verb in re.findall(r"^\| `kvevents (\w[\w-]*)", README, re.M):
        assert verb in out, verb
