"""The ``kvevents`` command.

The ground floor's own verbs: ``tail`` (follow publishers, or any event source, one line per
event, a periodic health line) and ``record`` / ``replay`` / ``inspect`` / ``convert-capture``
(:mod:`kvevents.cli_record`). Every other verb comes from the ``kvevents.commands`` entry-point
group: each entry point names a function ``register(subparsers) -> None`` that adds one
sub-parser and sets ``func=callable(args) -> int`` with ``set_defaults`` (``demo`` from
``kvdemo``, ``router`` from the service, ...); this package never imports them by name. A
plug-in that cannot be loaded still appears as its verb, which then says why it cannot run.
Bad input is one line on stderr and exit code 2; an unreachable replay socket is exit code 3;
no tracebacks for either.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time

from . import cli_record
from .delivery import Delivery, DeliveryKind
from .errors import KVEventsError
from .events import AllBlocksCleared, BlockRemoved, BlockStored

#: the entry-point group other packages register their verbs in
COMMANDS_GROUP = "kvevents.commands"


def _short(h) -> str:
    if h is None:
        return "-"
    if isinstance(h, bytes):
        return h[:6].hex()
    return f"{h & 0xFFFFFFFFFFFFFFFF:016x}"[:12]


def format_event(d: Delivery, ev) -> str:
    head = f"{d.publisher} seq={d.seq}{' (replay)' if d.replayed else ''}"
    if isinstance(ev, BlockStored):
        hashes = ",".join(_short(h) for h in ev.block_hashes[:4]) + ("…" if len(ev.block_hashes) > 4 else "")
        lora = f" lora={ev.lora_name}" if ev.lora_name else ""
        group = f" group={ev.group_idx}" if ev.group_idx is not None else ""
        return (f"{head} STORED  medium={ev.medium or '-'} blocks={len(ev.block_hashes)} block_size={ev.block_size} "
                f"tokens={len(ev.token_ids)} parent={_short(ev.parent_block_hash)} [{hashes}]{lora}{group}")
    if isinstance(ev, BlockRemoved):
        hashes = ",".join(_short(h) for h in ev.block_hashes[:4]) + ("…" if len(ev.block_hashes) > 4 else "")
        return f"{head} REMOVED medium={ev.medium or '-'} blocks={len(ev.block_hashes)} [{hashes}]"
    if isinstance(ev, AllBlocksCleared):
        return f"{head} CLEARED all blocks"
    return f"{head} {type(ev).__name__}"


def format_delivery(d: Delivery) -> list[str]:
    if d.kind is DeliveryKind.BATCH:
        return [format_event(d, ev) for ev in d.batch.events]
    if d.kind is DeliveryKind.RESET:
        return [f"{d.publisher} RESET: sequence went back to {d.seq} (publisher restarted)"]
    return [f"{d.publisher} GAP: {d.missed} batch(es) from seq {d.seq} lost ({d.reason})"]


def health_line(sub) -> str:
    parts = []
    for name, h in sub.health().items():
        bad = sum(h.malformed.values())
        parts.append(f"{name} {h.state.value} last_seq={h.last_seq} recv={h.received} gaps={h.gaps} "
                     f"recovered={h.recovered} lost={h.unrecoverable} resets={h.resets} malformed={bad}")
    return "# health: " + ("; ".join(parts) if parts else "no publisher heard yet")


def _open_tail_source(args: argparse.Namespace):
    """A ZeroMQ subscriber (with replay endpoints and options) for tcp/ipc/inproc endpoints, else
    whatever event source the URLs' scheme names (``file:run.kvrec``, ``nats://...``)."""
    from .source import SOURCES, open_source
    from .transport.zmq import PublisherSpec, Subscriber

    replays = args.replay or []
    if len(replays) > len(args.endpoints):
        raise KVEventsError(f"{len(replays)} --replay endpoints for {len(args.endpoints)} publisher endpoint(s)")
    zmq_schemes = ("tcp", "ipc", "inproc")
    schemes = {ep.partition(":")[0].lower() for ep in args.endpoints}
    if all(s in SOURCES.entries and s not in zmq_schemes for s in schemes):
        if replays:
            raise KVEventsError("--replay applies to ZeroMQ endpoints (tcp://, ipc://, inproc://) only")
        return open_source(*args.endpoints), []
    specs = [PublisherSpec(ep, replays[i] if i < len(replays) else None) for i, ep in enumerate(args.endpoints)]
    return Subscriber(specs, topic=args.topic, late_join=args.late_join, stale_after=args.stale_after), specs


def cmd_tail(args: argparse.Namespace) -> int:
    sub, specs = _open_tail_source(args)
    replays = [s.replay_endpoint for s in specs if s.replay_endpoint]
    try:
        if replays:
            dead = [n for n, ok in sub.probe_replay(args.probe_timeout).items() if not ok]
            if dead:
                eps = [s.replay_endpoint for s in specs if s.endpoint in dead]
                print(f"kvevents tail: error: replay endpoint {', '.join(eps)} did not answer within "
                      f"{args.probe_timeout}s (is the publisher running with a replay socket there?)",
                      file=sys.stderr)
                return 3
        stop = threading.Event()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda *_: stop.set())
        start = last_health = time.monotonic()
        out = sys.stdout
        while not stop.is_set() and not sub.ended:
            for d in sub.poll(100):
                for line in format_delivery(d):
                    out.write(line + "\n")
            now = time.monotonic()
            if now - last_health >= args.health_every:
                out.write(health_line(sub) + "\n")
                last_health = now
            out.flush()
            if args.duration is not None and now - start >= args.duration:
                break
        out.write(health_line(sub) + "\n")
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        sub.close()


def _broken_verb(subparsers, name: str, why: str) -> None:
    """A verb whose plug-in could not be loaded: it says so (exit 2) instead of vanishing."""
    def fail(args: argparse.Namespace) -> int:
        print(f"kvevents {name}: error: {why}", file=sys.stderr)
        return 2

    p = subparsers.add_parser(name, help=f"(unavailable: {why})", add_help=False)
    p.set_defaults(func=fail, any_arguments=True)  # whatever follows the verb: it cannot run anyway


def add_plugin_commands(subparsers, entry_points=None) -> list[str]:
    """Add the verbs of the ``kvevents.commands`` entry points; returns their names in order.

    ``entry_points`` (for tests): an iterable of objects with ``name`` and ``load()``, else the
    installed distributions' group. A plug-in that fails to import, raises in ``register`` or
    adds no verb (or one named differently from its entry point) gets a verb that reports it.
    """
    if entry_points is None:
        from importlib.metadata import entry_points as installed

        entry_points = sorted(installed(group=COMMANDS_GROUP), key=lambda e: e.name)
    names = []
    for ep in entry_points:
        if ep.name in subparsers.choices:
            continue  # a verb of this package, or a second distribution naming the same verb: first wins
        try:
            register = ep.load()
            register(subparsers)
        except Exception as exc:  # noqa: BLE001 - any plug-in failure becomes a verb that says it
            subparsers.choices.pop(ep.name, None)
            _broken_verb(subparsers, ep.name, f"its plug-in {getattr(ep, 'value', ep.name)!r} cannot be loaded: "
                                              f"{type(exc).__name__}: {exc}")
        else:
            if ep.name not in subparsers.choices:
                _broken_verb(subparsers, ep.name, f"its plug-in {getattr(ep, 'value', ep.name)!r} added no "
                                                  f"{ep.name!r} verb")
        names.append(ep.name)
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvevents", description="KV-cache event streaming: vLLM-compatible "
                                     "publisher, self-healing subscriber, recording tools, and the verbs "
                                     "installed packages add (demo, router, ...).")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    p = sub.add_parser("tail", help="follow publishers and print their events",
                       description="One line per event (hashes shortened, medium, block size, token count) and "
                                   "a periodic health line.")
    p.add_argument("endpoints", nargs="+", metavar="ENDPOINT",
                   help="PUB endpoint(s) to connect to, or another event source's URL (file:run.kvrec, nats://...)")
    p.add_argument("--replay", action="append", metavar="ENDPOINT",
                   help="replay endpoint of each publisher, in ENDPOINT order")
    p.add_argument("--topic", default="", help="topic prefix to subscribe to (default: all)")
    p.add_argument("--late-join", action="store_true", help="first replay what the publisher still buffers")
    p.add_argument("--duration", type=float, metavar="S", help="stop after S seconds (default: until Ctrl-C)")
    p.add_argument("--health-every", type=float, default=5.0, metavar="S", help="health line period (default 5)")
    p.add_argument("--stale-after", type=float, default=10.0, metavar="S",
                   help="a publisher silent this long is STALE (default 10)")
    p.add_argument("--probe-timeout", type=float, default=2.0, metavar="S",
                   help="how long a replay endpoint has to answer the start-up probe (default 2)")
    p.set_defaults(func=cmd_tail)

    cli_record.add_subcommands(sub)
    add_plugin_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "any_arguments", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args)
    except KVEventsError as exc:
        print(f"kvevents {args.verb}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
