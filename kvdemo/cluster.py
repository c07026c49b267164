"""``kvevents demo``: a whole simulated cluster on one machine, no services to install.

N simulated engines (each a :class:`manager.engine_sim.SimEngine` over a real tiered manager:
CPU primary plus the ``fs`` tier in a temporary directory) publish their KV events over
ZeroMQ (ipc:// endpoints with replay sockets; a little live loss is injected so gap healing
shows). A :class:`consumers.KVRouter` follows all of them through a :class:`kvevents.Subscriber`
and routes a synthetic shared-prefix, multi-turn workload back to the engines, while a
shadow cluster of N identical engines gets the same requests round-robin, for comparison.
A :class:`kvevents.recorder.Recorder` records the stream. Live lines every second, a summary
with the accounting at the end (exit code 1 if anything was lost without being reported).

The ``kvevents`` command finds this module's :func:`register` through the ``kvevents.commands``
entry-point group and imports it to build its parser, so it imports nothing heavy: the cluster
itself lives in :mod:`kvdemo.run`.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["register", "add_subcommand", "main"]


def _checked(convert, ok, bad: str, out_of_range: str):
    """An argparse type: ``convert(text)``, then ``ok(value)``; each failure names what was expected."""

    def parse(text: str):
        try:
            v = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {bad}, got {text!r}") from None
        if not ok(v):
            raise argparse.ArgumentTypeError(f"expected {out_of_range}, got {text!r}")
        return v

    return parse


_positive_int = _checked(int, lambda v: v > 0, "a positive integer", "a positive integer")
_port = _checked(int, lambda v: 0 <= v <= 65535, "a TCP port number", "a TCP port number (0-65535)")
_fraction = _checked(float, lambda v: 0.0 <= v < 1.0, "a fraction between 0 and 1", "a fraction in [0, 1)")
_duration = _checked(float, lambda v: v > 0, "seconds", "a positive number of seconds")


def register(subparsers) -> None:
    """Entry point of the ``kvevents.commands`` group: adds the ``demo`` verb."""
    p = subparsers.add_parser(
        "demo", help="run a simulated cluster: engines, tiered offload, router, recording",
        description="N simulated engines with CPU + fs offload tiers publish KV events over ZeroMQ; a "
                    "KV-aware router follows them and routes a shared-prefix multi-turn workload, "
                    "compared with round-robin on a shadow cluster. Exits by itself after --duration "
                    "seconds (SIGTERM or Ctrl-C end it early, with the summary).")
    p.add_argument("--duration", type=_duration, default=5.0, metavar="S", help="seconds to run (default 5)")
    p.add_argument("--engines", type=_positive_int, default=3, metavar="N", help="simulated engines (default 3)")
    p.add_argument("--prometheus-port", type=_port, default=None, metavar="PORT",
                   help="serve Prometheus metrics on this port (127.0.0.1; 0 picks a free one)")
    p.add_argument("--prometheus-host", default="127.0.0.1", metavar="HOST",
                   help="address the Prometheus endpoint binds (default 127.0.0.1)")
    p.add_argument("--trace-sample-every", type=_positive_int, default=16, metavar="N",
                   help="with --otlp: trace the batches whose seq is a multiple of N, end to end (default 16)")
    p.add_argument("--otlp", nargs="?", const="", default=None, metavar="ENDPOINT",
                   help="export traces and metrics over OTLP (to ENDPOINT, else OTEL_EXPORTER_OTLP_ENDPOINT)")
    p.add_argument("--record", default=None, metavar="FILE",
                   help="write the recording here (default: a temporary file, printed at the end)")
    p.add_argument("--drop-rate", type=_fraction, default=0.01, metavar="P",
                   help="fraction of live batches kept off the socket to show replay healing (default 0.01)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--no-baseline", action="store_true",
                   help="skip the round-robin shadow cluster (halves the CPU the demo needs)")
    p.add_argument("--serve", action="store_true",
                   help="instead: the router service (kvevents router --proxy) in front of simulated engines with "
                        "OpenAI-compatible HTTP servers, and a load generator sending real HTTP through it")
    p.add_argument("--event-plane", choices=("nats",), default=None,
                   help="instead: the fleet topology on a local nats-server (JetStream): engines, a bridge, two "
                        "router replicas, one killed and restarted mid-run (needs nats-server on PATH)")
    p.set_defaults(func=main)


add_subcommand = register  # the name kvevents.cli used before verbs came from entry points


def main(args: argparse.Namespace) -> int:
    if getattr(args, "event_plane", None) == "nats":
        from .plane import run_plane_demo

        return run_plane_demo(duration=max(args.duration, 3.0), engines=args.engines, seed=args.seed, out=sys.stdout)
    if getattr(args, "serve", False):
        from .serve import run_serve

        return run_serve(args.duration, args.engines, args.seed, sys.stdout)
    from .run import DemoOptions, run_demo

    opts = DemoOptions(duration=args.duration, engines=args.engines, prometheus_port=args.prometheus_port,
                       prometheus_host=args.prometheus_host, otlp=args.otlp, record=args.record,
                       drop_rate=args.drop_rate, seed=args.seed, baseline=not args.no_baseline,
                       trace_sample_every=args.trace_sample_every)
    return run_demo(opts, out=sys.stdout)
