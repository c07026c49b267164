"""CLI verbs ``record``, ``replay``, ``inspect`` and ``convert-capture`` for the ``kvevents`` command.

``kvevents.cli`` adds them with :func:`add_subcommands`; ``python -m kvevents.cli_record`` runs
them alone. Each verb returns an exit code: 0 done, 2 bad input (a bad endpoint, a file that is
not a recording, ...), reported as one line on stderr without a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Sequence

from .errors import KVEventsError

__all__ = ["add_subcommands", "main"]


def _fail(verb: str, msg: str) -> int:
    print(f"kvevents {verb}: error: {msg}", file=sys.stderr)
    return 2


#: exit code when the reader of our stdout went away (``| head``): what a shell shows for SIGPIPE
EXIT_BROKEN_PIPE = 128 + 13


def broken_pipe() -> int:
    """The reader of stdout is gone: no error message, no flush error at exit; :data:`EXIT_BROKEN_PIPE`."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's final flush now goes nowhere
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return EXIT_BROKEN_PIPE


def _guarded(verb: str) -> Callable:
    def deco(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
        @functools.wraps(fn)
        def run(args: argparse.Namespace) -> int:
            try:
                return fn(args)
            except BrokenPipeError:
                return broken_pipe()
            except (KVEventsError, OSError, ValueError) as exc:
                return _fail(verb, str(exc) or type(exc).__name__)
        return run
    return deco


@contextlib.contextmanager
def _stop_on_signals(stop: threading.Event):
    """SIGTERM (and SIGINT, when not already a KeyboardInterrupt) set ``stop``; restored after."""
    old = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            old[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n}"


def _table(rows: list[list[Any]], header: list[str]) -> str:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells)


def _when(ts: float | None) -> str:
    if ts is None:
        return "-"
    try:
        return datetime.datetime.fromtimestamp(ts, datetime.timezone.utc).isoformat(timespec="milliseconds")
    except (ValueError, OverflowError, OSError, TypeError):  # NaN, out of range, not a number (header meta)
        return f"invalid ({ts!r:.40})"


# ---- inspect ---------------------------------------------------------------------------------


@_guarded("inspect")
def cmd_inspect(args: argparse.Namespace) -> int:
    from .recordstream import summarize

    s = summarize(args.file)
    if args.json:
        print(json.dumps(s, indent=2, default=str))
        return 0
    f, t = s["file"], s["time"]
    meta = f["meta"]
    print(f"recording   {f['path']}  ({f['bytes']:,} bytes, format v{f['version']}, "
          f"writer {meta.get('writer', '?')}, created {_when(meta.get('created'))})")
    print(f"messages    {f['records']:,} (pub {s['messages']['pub']:,}, replay {s['messages']['replay']:,})")
    print(f"damage      truncated tail {f['truncated_bytes']:,} bytes, bad records {f['bad_records']:,} "
          f"({f['skipped_bytes']:,} bytes skipped), undecodable records {f['undecodable_records']:,}"
          + (f", infinite receive times {f['infinite_times']:,}" if f["infinite_times"] else ""))
    print(f"time span   {_when(t['first'])} .. {_when(t['last'])}  ({t['span_s']:.3f} s)")
    print()
    rows = []
    for p in s["publishers"].values():
        seqs = "-" if p["first_seq"] is None else f"{p['first_seq']}..{p['last_seq']}"
        rows.append([p["publisher"], ",".join(p["topics"]) or "-", p["pub_messages"], p["replay_messages"], seqs,
                     len(p["live_gaps"]), p["batches"], p["recovered"], p["unrecovered"], p["resets"],
                     p["malformed_frames"] + p["undecodable"]])
    print(_table(rows, ["publisher", "topic", "live", "replay", "live seqs", "gaps", "batches", "recovered",
                        "unrecovered", "resets", "malformed"]))
    print()
    ev_rows = [[e["type"], e["medium"], e["events"], e["blocks"]] for e in s["events"]]
    print(_table(ev_rows, ["event", "medium", "events", "blocks"]) if ev_rows else "no events")
    gapped = [(p["publisher"], p["live_gaps"]) for p in s["publishers"].values() if p["live_gaps"]]
    if gapped:
        print()
        print("live gaps (first..last missing seq):")
        for name, gaps in gapped:
            shown = ", ".join(f"{a}..{b}" if a != b else f"{a}" for a, b in gaps[:20])
            more = f" (+{len(gaps) - 20} more)" if len(gaps) > 20 else ""
            print(f"  {name}: {shown}{more}")
    return 0


# ---- record ----------------------------------------------------------------------------------


def _check_connectable(endpoint: str) -> None:
    """A tcp:// host that does not resolve is an error now (ZeroMQ would retry it silently forever)."""
    import socket

    from .errors import EndpointError

    if endpoint.startswith("tcp://"):
        host, _, port = endpoint[6:].rpartition(":")
        host = host.strip("[]")
        try:
            socket.getaddrinfo(host, int(port))
        except (OSError, UnicodeError) as exc:
            raise EndpointError(f"endpoint {endpoint!r}: host {host!r} does not resolve ({exc})") from None


#: exit code when a replay endpoint does not answer the start-up probe (as ``kvevents tail``)
EXIT_NO_REPLAY = 3


def _replay_answers(endpoint: str, timeout: float) -> bool:
    """Whether the replay socket at ``endpoint`` answers an empty replay request within ``timeout`` s."""
    import zmq

    from .transport.zmq.frames import PROBE_SEQ, is_end_marker

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart((b"", PROBE_SEQ), zmq.NOBLOCK)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0 and sock.poll(max(1, int(left * 1000))):
            if is_end_marker(sock.recv_multipart()):
                return True
        return False
    except zmq.ZMQError:
        return False
    finally:
        sock.close(0)


def _progress_line(rec) -> str:
    elapsed = max(0.0, __import__("time").time() - rec.started)
    parts = [f"recording {elapsed:6.1f}s  {rec.frames:,} frames  {_human(rec.bytes)}"]
    for src in rec.sources.values():
        seq = "-" if src.last_seq is None else src.last_seq
        extra = f" gaps {src.gaps}" if src.gaps else ""
        extra += f" replayed {src.answered}" if src.answered else ""
        parts.append(f"{src.endpoint} seq {seq}{extra}")
    return " | ".join(parts)


@_guarded("record")
def cmd_record(args: argparse.Namespace) -> int:
    from .recorder import Recorder
    from .recording import RecordingWriter

    endpoints = args.endpoints
    replays = args.replay or []
    if replays and len(replays) != len(endpoints):
        return _fail("record", f"{len(replays)} --replay endpoint(s) for {len(endpoints)} endpoint(s): "
                               "give one --replay per endpoint, in the same order")
    if args.duration is not None and args.duration <= 0:
        return _fail("record", f"--duration must be > 0, got {args.duration}")
    meta = {"source": "kvevents record", "endpoints": endpoints, "replay_endpoints": replays,
            "topic": args.topic, "backfill": bool(args.backfill)}
    # Validate the endpoints before creating the output file.
    from .transport.zmq.endpoints import validate_endpoint
    for ep in endpoints:
        _check_connectable(validate_endpoint(ep))
    for ep in replays:
        _check_connectable(validate_endpoint(ep, what="--replay endpoint"))
    dead = [ep for ep in replays if not _replay_answers(ep, args.probe_timeout)]
    if dead:  # as `kvevents tail` does: a replay socket nobody answers on would leave every gap unhealed
        print(f"kvevents record: error: replay endpoint {', '.join(dead)} did not answer within "
              f"{args.probe_timeout}s (is the publisher running with a replay socket there?)", file=sys.stderr)
        return EXIT_NO_REPLAY
    stop = threading.Event()
    with RecordingWriter(args.output, mode="a" if args.append else "w", meta=meta) as writer:
        recorder = Recorder(writer, endpoints, replay_endpoints=replays or None, topic=args.topic,
                            backfill=args.backfill)
        progress = None if args.quiet else (lambda r: print(_progress_line(r), file=sys.stderr, flush=True))
        try:
            with _stop_on_signals(stop):
                recorder.run(stop, duration=args.duration, progress=progress)
        except KeyboardInterrupt:
            pass
        finally:
            recorder.close()
        if not args.quiet:
            print(_progress_line(recorder), file=sys.stderr)
            print(f"wrote {writer.records:,} messages to {args.output}", file=sys.stderr)
    return 0


# ---- replay ----------------------------------------------------------------------------------


def _listener(endpoint: str, wait: float) -> bool:
    """Whether something accepts TCP connections at a tcp:// ``endpoint`` within ``wait`` seconds.

    Other schemes: True (an ipc:// or inproc:// peer cannot be probed this way). A PUB socket that
    connects where nobody listens sends into the void without an error: say so up front.
    """
    import socket

    if not endpoint.startswith("tcp://"):
        return True
    host, _, port = endpoint[6:].rpartition(":")
    deadline = time.monotonic() + wait
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=min(1.0, wait)):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.05)  # polling a port: no event to wait on


@_guarded("replay")
def cmd_replay(args: argparse.Namespace) -> int:
    from .transport.zmq.endpoints import should_bind, validate_endpoint
    from .recorder import recording_publishers, replay_recording

    if args.speed < 0:
        return _fail("replay", f"--speed must be >= 0 (0: as fast as possible), got {args.speed}")
    for ep in args.to:
        validate_endpoint(ep, what="--to endpoint")
    reps = args.replay_endpoint or []
    for ep in reps:
        validate_endpoint(ep, what="--replay-endpoint")
    if reps and len(reps) != len(args.to):
        return _fail("replay", f"{len(reps)} --replay-endpoint(s) for {len(args.to)} --to endpoint(s): give one each")
    names = recording_publishers(args.file)
    if args.publisher:
        unknown = [p for p in args.publisher if p not in names]
        if unknown:
            return _fail("replay", f"publisher(s) {unknown} not in the recording; it holds {names}")
        names = list(args.publisher)
    if len(names) != len(args.to):
        return _fail("replay", f"the recording holds {len(names)} publisher(s) {names} but {len(args.to)} --to "
                               "endpoint(s) were given: give one --to per publisher, or choose with --publisher")
    targets = {name: (to, reps[i] if reps else None) for i, (name, to) in enumerate(zip(names, args.to))}
    for to in args.to:
        if not should_bind(to, args.mode) and not _listener(to, max(args.start_delay, 0.2)):
            return _fail("replay", f"nothing listens on {to}: this replay connects there (--mode {args.mode}), and "
                                   "nobody bound it — `kvevents tail` connects too, so the batches would go nowhere. "
                                   "Let replay bind: --mode bind, or a tcp://*:PORT endpoint")
    stop = threading.Event()
    options = {"mode": args.mode}
    last_progress = [time.monotonic(), 0]

    def on_publish(publisher: str, seq: int) -> None:
        last_progress[1] += 1
        now = time.monotonic()
        if not args.quiet and now - last_progress[0] >= args.progress_every:
            last_progress[0] = now
            print(f"replaying: {last_progress[1]:,} batches published (last: {publisher} seq {seq})",
                  file=sys.stderr, flush=True)

    def on_published(report) -> None:
        if not args.quiet:
            print(f"published {sum(report.published.values()):,} batches"
                  + (f"; answering replay requests for {args.linger:g} s" if args.linger > 0 else ""),
                  file=sys.stderr, flush=True)

    if not args.quiet:
        for name, (to, rep) in targets.items():
            print(f"replaying {name} -> {to}" + (f" (replay socket {rep})" if rep else ""), file=sys.stderr)
    try:
        with _stop_on_signals(stop):
            report = replay_recording(args.file, targets, speed=args.speed, topic=args.topic, stop=stop,
                                      start_delay=args.start_delay, linger=args.linger,
                                      publisher_options=options, on_published=on_published,
                                      on_publish=on_publish)
    except KeyboardInterrupt:
        return 0
    if not args.quiet:
        total = sum(report.published.values())
        print(f"done: {total:,} batches published ({report.gaps} missing from the recording, {report.resets} resets"
              f"{', stopped early' if report.stopped else ''}; unsent {report.unsent})", file=sys.stderr)
    return 0


# ---- convert-capture -------------------------------------------------------------------------


@_guarded("convert-capture")
def cmd_convert_capture(args: argparse.Namespace) -> int:
    from .recording import convert_capture

    n = convert_capture(args.jsonl, args.output, publisher=args.publisher)
    print(f"wrote {n} messages to {args.output}", file=sys.stderr)
    return 0


# ---- wiring ----------------------------------------------------------------------------------


def add_subcommands(subparsers) -> None:
    """Add ``inspect``, ``record``, ``replay`` and ``convert-capture`` to an argparse subparsers object."""
    p = subparsers.add_parser("inspect", help="summarize a recording file",
                              description="Publishers, batches, events by type and medium, seq gaps, time span.")
    p.add_argument("file", help="a recording (.kvrec)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_inspect)

    p = subparsers.add_parser("record", help="record live publishers to a file",
                              description="Record every frame from PUB endpoints (with receive time and publisher "
                                          "identity) into an append-only recording; stops on Ctrl-C, SIGTERM or "
                                          "after --duration. The file stays readable if the recorder is killed.")
    p.add_argument("endpoints", nargs="+", metavar="ENDPOINT", help="PUB endpoints to connect to")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="recording to write")
    p.add_argument("--replay", action="append", metavar="ENDPOINT",
                   help="replay (ROUTER) endpoint of each publisher, in ENDPOINT order: gaps are asked for and "
                        "the answers recorded")
    p.add_argument("--duration", type=float, metavar="S", help="stop after S seconds")
    p.add_argument("--topic", default="", metavar="T", help="topic prefix to subscribe to (default: all)")
    p.add_argument("--backfill", action="store_true",
                   help="also record what each publisher's replay ring still holds from seq 0")
    p.add_argument("--append", action="store_true", help="append to FILE instead of replacing it")
    p.add_argument("--probe-timeout", type=float, default=2.0, metavar="S",
                   help="how long each --replay endpoint has to answer the start-up probe (default 2; "
                        "exit code 3 if one does not)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(func=cmd_record)

    p = subparsers.add_parser("replay", help="publish a recording again",
                              description="Publish a recording with its original sequence numbers and timing, "
                                          "and answer replay requests.")
    p.add_argument("file", help="a recording (.kvrec)")
    p.add_argument("--to", action="append", required=True, metavar="ENDPOINT",
                   help="PUB endpoint, one per recorded publisher (in order of first appearance)")
    p.add_argument("--replay-endpoint", action="append", metavar="ENDPOINT",
                   help="replay (ROUTER) endpoint to bind, one per --to")
    p.add_argument("--speed", type=float, default=1.0, metavar="X",
                   help="timing factor: 2 = twice as fast, 0 = as fast as possible (default 1)")
    p.add_argument("--topic", default=None, metavar="T", help="publish under this topic instead of the recorded one")
    p.add_argument("--publisher", action="append", metavar="ID", help="replay only this recorded publisher")
    p.add_argument("--start-delay", type=float, default=0.5, metavar="S",
                   help="wait S seconds after binding so subscribers can connect (default 0.5)")
    p.add_argument("--linger", type=float, default=0.0, metavar="S",
                   help="keep answering replay requests S seconds after the last batch")
    p.add_argument("--mode", choices=("auto", "bind", "connect"), default="auto",
                   help="bind or connect the PUB socket (auto: bind ipc:// and wildcard hosts); connecting "
                        "needs a peer that binds (kvevents tail connects)")
    p.add_argument("--progress-every", type=float, default=2.0, metavar="S",
                   help="a progress line on stderr every S seconds while publishing (default 2)")
    p.add_argument("-q", "--quiet", action="store_true")
    p.set_defaults(func=cmd_replay)

    p = subparsers.add_parser("convert-capture", help="turn a conformance capture (.jsonl) into a recording")
    p.add_argument("jsonl", help="capture: one {\"socket\", \"frames\": [hex...]} object a line")
    p.add_argument("-o", "--output", required=True, metavar="FILE")
    p.add_argument("--publisher", default=None, metavar="ID", help="publisher identity (default capture:<name>)")
    p.set_defaults(func=cmd_convert_capture)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvevents")
    add_subcommands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
