"""``kvevents bridge``: engines' ZeroMQ streams into a JetStream stream.

Registered in the ``kvevents.commands`` entry-point group (``register``); until the CLI reads
that group, ``python -m kvevents.transport.nats.cli bridge ...`` runs the same verb.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

from ...errors import KVEventsError


def register(subparsers) -> None:
    p = subparsers.add_parser("bridge", help="publish engines' KV events into a NATS JetStream stream",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--nats", default="nats://127.0.0.1:4222", help="NATS server URL (default %(default)s)")
    p.add_argument("--engine", action="append", default=[], metavar="NAME=PUB[,REPLAY][,model=M][,rank=R]",
                   help="an engine to follow (repeat for several)")
    p.add_argument("--stream", default="KVEVENTS", help="stream name (default %(default)s)")
    p.add_argument("--prefix", default="kvevents", help="subject prefix (default %(default)s)")
    p.add_argument("--max-bytes", type=int, default=1 << 30, help="stream bound in bytes (default 1 GiB)")
    p.add_argument("--duplicate-window", type=float, default=120.0, help="seconds (default %(default)s)")
    p.add_argument("--storage", choices=("file", "memory"), default="file")
    p.add_argument("--window", type=int, default=512, help="unacknowledged publishes in flight (default %(default)s)")
    p.add_argument("--pack", type=int, default=1,
                   help="consecutive batches of a pod per stream message (default 1: the raw payload is the body)")
    p.add_argument("--duration", type=float, default=None, help="stop after S seconds (default: until signalled)")
    p.add_argument("--status-file", default=None, help="write the bridge's health as JSON here, about once a second")
    p.set_defaults(func=run_bridge)


def _write_status(path: str, bridge) -> None:
    h = bridge.health()
    h["engines"] = {k: {"state": v.state.value, "last_seq": v.last_seq, "received": v.received}
                    for k, v in h["engines"].items()}
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(h, f)
    os.replace(tmp, path)


def run_bridge(args) -> int:
    from .bridge import Bridge, EngineSpec
    from .wire import StreamSpec

    try:
        if not args.engine:
            raise KVEventsError("bridge: give at least one --engine NAME=PUB_ENDPOINT[,REPLAY_ENDPOINT]")
        engines = [EngineSpec.parse(e) for e in args.engine]
        spec = StreamSpec(args.stream, args.prefix, max_bytes=args.max_bytes, duplicate_window=args.duplicate_window,
                          storage=args.storage)
        bridge = Bridge(args.nats, engines, stream=spec, window=args.window, pack=args.pack)
    except (KVEventsError, OSError, TimeoutError) as exc:
        print(f"kvevents bridge: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    end = None if args.duration is None else time.monotonic() + args.duration
    next_status = 0.0
    try:
        while not stop.is_set() and (end is None or time.monotonic() < end):
            bridge.poll(50)
            if args.status_file and time.monotonic() >= next_status:
                _write_status(args.status_file, bridge)
                next_status = time.monotonic() + 1.0
    finally:
        clean = bridge.close()
        if args.status_file:
            _write_status(args.status_file, bridge)
    print(json.dumps({"bridge": bridge.stats, "sender": bridge.sender.stats}), file=sys.stderr)
    return 0 if clean else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvevents")
    sub = parser.add_subparsers(dest="verb", required=True)
    register(sub)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
