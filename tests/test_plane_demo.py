"""``kvevents demo --event-plane nats``: the whole fleet topology, end to end, and its clear
error when nats-server is missing. (The default ``kvevents demo`` stays broker-free: its own
tests run it without this flag.)"""

from __future__ import annotations

import os
import subprocess
import sys

from kvevents.transport.nats.broker import find_nats_server

ARGS = [sys.executable, "-m", "kvevents.cli", "demo", "--event-plane", "nats"]


def test_demo_event_plane_nats_replicas_end_identical_nothing_lost(tmp_path) -> None:
    # the real nats-server behind a wrapper that notes the environment it was started with
    real = find_nats_server()
    assert real is not None, "the README's test command installs nats-server"
    seen = tmp_path / "godebug"
    wrapper = tmp_path / "nats-server"
    wrapper.write_text(f'#!/bin/sh\nprintf "%s" "$GODEBUG" > {seen}\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    env = {**os.environ, "KVEVENTS_NATS_SERVER": str(wrapper)}
    env.pop("GODEBUG", None)
    r = subprocess.run([*ARGS, "--duration", "3", "--engines", "2"], capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "replica b killed (SIGKILL)" in out and "replica b restarted" in out
    assert "replicas identical: YES" in out
    assert "silently lost: 0" in out and "lost inside the plane: none" in out
    assert seen.read_text() == "madvdontneed=0"  # the recommended broker environment (kvevents.transport.nats.broker)


def test_demo_event_plane_without_nats_server_is_a_clear_error() -> None:
    env = {**os.environ, "KVEVENTS_NATS_SERVER": "/nonexistent/nats-server"}
    r = subprocess.run([*ARGS, "--duration", "3"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2
    assert "needs nats-server" in r.stderr and "Traceback" not in r.stderr
