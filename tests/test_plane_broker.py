"""The environment we start nats-server with (the demo, benchmarks/fleet.py): GODEBUG carries
madvdontneed=0 unless the operator chose a madvdontneed of their own; and the demo's server
really runs with it."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kvevents.transport.nats.broker import RECOMMENDED_GODEBUG, broker_env, find_nats_server


def test_the_recommended_setting_is_added_to_what_godebug_holds() -> None:
    assert broker_env({})["GODEBUG"] == RECOMMENDED_GODEBUG == "madvdontneed=0"
    env = broker_env({"PATH": "/bin", "GODEBUG": "gctrace=1"})
    assert env == {"PATH": "/bin", "GODEBUG": "gctrace=1,madvdontneed=0"}


def test_an_operators_own_madvdontneed_is_kept() -> None:
    assert broker_env({"GODEBUG": "madvdontneed=1,gctrace=1"})["GODEBUG"] == "madvdontneed=1,gctrace=1"


def test_the_process_environment_is_the_default_and_is_not_changed(monkeypatch) -> None:
    monkeypatch.setenv("KVEVENTS_BROKER_PROBE", "x")
    monkeypatch.delenv("GODEBUG", raising=False)
    env = broker_env()
    assert env["KVEVENTS_BROKER_PROBE"] == "x" and env["GODEBUG"] == "madvdontneed=0"
    assert "GODEBUG" not in os.environ


def test_find_nats_server_honours_the_override(tmp_path: Path, monkeypatch) -> None:
    fake = tmp_path / "nats-server"
    fake.write_text("#!/bin/sh\n")
    monkeypatch.setenv("KVEVENTS_NATS_SERVER", str(fake))
    assert find_nats_server() is None  # not executable
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    assert find_nats_server() == str(fake)
