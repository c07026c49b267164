"""The kvevents command: tail's output, demo, and exit codes on bad input."""

from __future__ import annotations

import io
import subprocess
import sys

from kvevents import BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher
from kvdemo import inprocess as kvevents_demo
from kvevents.cli import main

from .pubsub_helpers import collect_until, ipc_pair


def test_tail_prints_one_line_per_event_and_health(capsys) -> None:
    ep, rep = ipc_pair()
    pub = ZmqEventPublisher(ep, rep, topic="kv@pod-a@m")
    pub.publish(KVEventBatch(1.0, [
        BlockStored([0xDEADBEEF12345678, 2], None, list(range(32)), 16, None, "GPU", "sql"),
        BlockStored([2], None, [], 0, None, "CPU", None),
        BlockRemoved([0xDEADBEEF12345678], "GPU"),
    ], 0))
    try:
        assert collect_until(lambda: pub.stats()["ring_batches"] == 1)
        rc = main(["tail", ep, "--replay", rep, "--late-join", "--duration", "2", "--health-every", "0.5"])
    finally:
        pub.shutdown()
    out = capsys.readouterr().out.splitlines()
    assert rc == 0
    events = [line for line in out if not line.startswith("#")]
    assert events[0].startswith(f"{ep} seq=0 (replay) STORED  medium=GPU blocks=2 block_size=16 tokens=32")
    assert "deadbeef1234" in events[0] and "lora=sql" in events[0]
    assert "STORED  medium=CPU blocks=1 block_size=0 tokens=0" in events[1]
    assert "REMOVED medium=GPU blocks=1 [deadbeef1234]" in events[2]
    health = [line for line in out if line.startswith("# health:")]
    assert health and "SYNCED" in health[-1] and "recv=0" in health[-1] and "recovered=1" in health[-1]


def test_tail_bad_endpoint_is_one_line_and_exit_2(capsys) -> None:
    assert main(["tail", "localhost:5557"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no supported scheme" in err[0]


def test_tail_unreachable_replay_is_exit_3(capsys) -> None:
    ep, rep = ipc_pair()
    assert main(["tail", ep, "--replay", rep, "--probe-timeout", "0.2", "--duration", "0"]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "did not answer" in err[0] and rep in err[0]


def test_in_process_demo_loses_nothing_silently() -> None:
    """kvdemo.inprocess (was kvevents.demo): the smallest pub -> sub loop."""
    out = io.StringIO()
    assert kvevents_demo.run(duration=1.0, drop_rate=0.05, rate=500, out=out) == 0
    text = out.getvalue()
    assert "silently lost 0" in text and "reported lost 0" in text
    assert "healed by replay 0" not in text  # 5% drops were injected and healed


def test_demo_verb_is_the_cluster_demo() -> None:
    proc = subprocess.run([sys.executable, "-m", "kvevents.cli", "demo", "--duration", "1.5", "--engines", "1",
                           "--no-baseline"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "SILENTLY LOST 0" in proc.stdout and proc.stdout.rstrip().endswith("result: OK")
    assert "Traceback" not in proc.stderr


class _EP:
    """An entry point as importlib.metadata gives it: a name, a value, load()."""

    def __init__(self, name, fn=None, exc=None):
        self.name, self.value, self._fn, self._exc = name, f"tests.fake:{name}", fn, exc

    def load(self):
        if self._exc is not None:
            raise self._exc
        return self._fn


def test_verbs_come_from_the_entry_point_group_and_broken_plugins_say_why(capsys) -> None:
    import argparse

    from kvevents.cli import add_plugin_commands

    def good(subparsers):
        subparsers.add_parser("hello").set_defaults(func=lambda a: 7)

    def raises(subparsers):
        raise RuntimeError("no config")

    parser = argparse.ArgumentParser(prog="kvevents")
    sub = parser.add_subparsers(dest="verb", required=True)
    sub.add_parser("tail")
    names = add_plugin_commands(sub, [_EP("hello", good), _EP("gone", exc=ModuleNotFoundError("No module named 'x'")),
                                      _EP("boom", raises), _EP("quiet", lambda s: None), _EP("tail", good)])
    assert names == ["hello", "gone", "boom", "quiet"]  # "tail" is the package's own verb: kept
    args = parser.parse_args(["hello"])
    assert args.func(args) == 7
    for verb, why in (("gone", "No module named 'x'"), ("boom", "RuntimeError: no config"), ("quiet", "added no")):
        args, _ = parser.parse_known_args([verb, "--whatever"])
        assert args.func(args) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith(f"kvevents {verb}: error:") and why in err


def test_the_installed_group_names_the_demo_and_the_ground_floor_imports_no_demo() -> None:
    from importlib.metadata import entry_points

    eps = {e.name: e.value for e in entry_points(group="kvevents.commands")}
    assert eps["demo"] == "kvdemo.cluster:register"
    code = ("import sys, kvevents.cli; kvevents.cli.build_parser; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('kvdemo', 'manager', 'consumers', 'kvservice')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"  # importing the CLI loads no upper floor (building the parser does)
