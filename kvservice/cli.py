"""``kvevents router`` / ``python -m kvservice``: the router as a long-running service.

Exit codes: 0 after SIGTERM (clean stop), 130 after SIGINT, 2 for a bad configuration (one
line on stderr naming the bad key), 3 when the API port cannot be bound.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

import msgspec

from kvevents.errors import ConfigError, KVEventsError

from .config import ServiceConfig, from_dict, load_config

__all__ = ["build_config", "main", "new_event_loop", "register", "run_service"]

log = logging.getLogger("kvservice")


def _pod_flag(text: str) -> dict:
    """``NAME=ENDPOINT[,replay=EP][,model=M][,http=URL][,dp=N][,topic=T]``: a ``[[pods]]`` table."""
    head, *opts = text.split(",")
    name, sep, endpoint = head.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--pod wants NAME=ENDPOINT[,replay=EP,model=M,http=URL,dp=N,topic=T], "
                                         f"got {text!r}")
    pod: dict = {"name": name, "endpoint": endpoint or None}
    keys = {"replay": "replay_endpoint", "model": "model", "http": "http", "dp": "data_parallel_size",
            "topic": "topic"}
    for o in opts:
        k, sep, v = o.partition("=")
        if not sep or k not in keys:
            raise argparse.ArgumentTypeError(f"--pod {name}: unknown option {o!r} (known: {', '.join(keys)})")
        if k == "dp":
            if not v.isdigit() or int(v) < 1:
                raise argparse.ArgumentTypeError(f"--pod {name}: dp must be a positive integer, got {v!r}")
            pod[keys[k]] = int(v)
        else:
            pod[keys[k]] = v
    return pod


def register(subparsers) -> None:
    """Entry point of the ``kvevents.commands`` group: adds the ``router`` verb."""
    p = subparsers.add_parser(
        "router", help="serve the KV-aware router: scoring API, pod status, metrics, OpenAI-compatible proxy",
        description="Subscribe to a fleet's KV events and serve a JSON API (/v1/score, /v1/pick, /v1/explain, "
                    "/v1/pods, /healthz, /readyz, /metrics, /openapi.json); with --proxy also forward "
                    "/v1/completions and /v1/chat/completions to the pod with the best KV score. The fleet comes "
                    "from --config (TOML, or YAML with PyYAML) and/or --pod flags; flags win.")
    add_arguments(p)
    p.set_defaults(func=run_from_args)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="service config (TOML; .yaml/.yml with PyYAML)")
    p.add_argument("--pod", action="append", type=_pod_flag, default=[], metavar="NAME=ENDPOINT[,...]",
                   help="a pod: NAME=PUB_ENDPOINT[,replay=EP][,model=M][,http=URL][,dp=N][,topic=T] (repeatable)")
    p.add_argument("--model", help="model of pods that name none (router.model)")
    p.add_argument("--block-size", type=int, metavar="N", help="the router's block size (router.block_size)")
    p.add_argument("--bind", metavar="ENDPOINT", help="bind mode: engines connect to this endpoint")
    p.add_argument("--event-plane", metavar="nats://HOST:PORT",
                   help="read the fleet's KV events from the NATS JetStream event plane (see kvevents bridge)")
    p.add_argument("--replica-name", default=None, metavar="NAME",
                   help="with --event-plane: this replica's durable consumer name (default kvrouter-<pid>)")
    p.add_argument("--host", help="API address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="API port (default 8000; 0 picks a free one)")
    p.add_argument("--api-token-file", metavar="FILE", help="require 'Authorization: Bearer <token in FILE>'")
    p.add_argument("--proxy", action="store_true", default=None, help="serve the OpenAI-compatible proxy")
    p.add_argument("--tokenizer", metavar="PATH", help="a local Hugging Face tokenizer (dir with tokenizer.json)")
    p.add_argument("--no-late-join", action="store_true", help="do not replay what publishers buffered at start")
    p.add_argument("--stale-after", type=float, metavar="S", help="a silent pod is STALE after S seconds")
    p.add_argument("--replay-timeout", type=float, metavar="S", help="seconds a replay socket has to answer")
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")


def build_config(args: argparse.Namespace) -> ServiceConfig:
    """The config file (checked alone first, so that its errors name the file), the flags laid
    over its tables, then the whole decoded again: a flag's value meets the same rules as the
    file's."""
    data = msgspec.to_builtins(load_config(args.config)) if args.config else {}
    sections = {k: data.setdefault(k, {}) for k in ("router", "api", "subscriber")}
    pods = data.setdefault("pods", [])
    by_name = {p["name"]: i for i, p in enumerate(pods)}
    for pod in args.pod:
        if pod["name"] in by_name:
            pods[by_name[pod["name"]]] = pod
        else:
            pods.append(pod)
    flags = {"router": {"model": args.model, "block_size": args.block_size},
             "api": {k: getattr(args, k) for k in ("host", "port", "api_token_file", "proxy", "tokenizer")},
             "subscriber": {"bind": args.bind, "stale_after": args.stale_after, "replay_timeout": args.replay_timeout,
                            "late_join": False if args.no_late_join else None}}
    if getattr(args, "event_plane", None) is not None:
        flags["subscriber"].update(event_plane=args.event_plane, replica_name=args.replica_name)
    for section, values in flags.items():
        sections[section].update({k: v for k, v in values.items() if v is not None})
    return from_dict(data).validate()


async def serve(cfg: ServiceConfig, stop: asyncio.Event, *, announce=print, fleet=None) -> None:
    """Run the service until ``stop`` is set (``fleet``: a :class:`kvservice.ingest.Fleet` built
    from ``cfg`` beforehand, e.g. pre-filled by a benchmark; else one is built here)."""
    from .api import read_token

    token = read_token(cfg.api.api_token_file) if cfg.api.api_token_file else None
    # one process, two threads (ingest, API loop) and one GIL: how long either may keep it while
    # the other waits (README "Threads"); put back when the service stops (it may run in a
    # process of someone else's: a test, a benchmark)
    switch_before = sys.getswitchinterval()
    sys.setswitchinterval(cfg.api.gil_switch_ms / 1000)
    try:
        await _serve(cfg, stop, announce, fleet, token)
    finally:
        sys.setswitchinterval(switch_before)


async def _serve(cfg: ServiceConfig, stop: asyncio.Event, announce, fleet, token) -> None:
    from aiohttp import web

    from .api import API_KEY, build_app, make_tokenizer
    from .ingest import Fleet
    from .metrics import Telemetry

    fleet = fleet if fleet is not None else Fleet(cfg)
    try:
        tokenizer = make_tokenizer(fleet, cfg.api.tokenizer, cfg.api.upstream_timeout)
        proxy = None
        if cfg.api.proxy:
            from .proxy import Proxy

            proxy = Proxy(fleet, cfg.api, cfg.proxy)
        app = build_app(fleet, token=token, tokenizer=tokenizer, proxy=proxy)
        api = app[API_KEY]
        api.telemetry = Telemetry(fleet)
        from .fasthttp import FastSite
        from .http_limits import runner_kwargs

        # every connection starts on kvservice.fasthttp (the [http] bounds); api.fast_path: it
        # answers the hot routes itself. A client hanging up cancels its proxied request (and so
        # the pod's work on it).
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5, handler_cancellation=proxy is not None,
                               **runner_kwargs(cfg.http, api.metrics))
        await runner.setup()
        try:
            site = api.fast_site = FastSite(runner, api, cfg.api.host, cfg.api.port, fast=cfg.api.fast_path)
            try:
                await site.start()
            except OSError as exc:
                raise BindError(f"cannot serve on {cfg.api.host}:{cfg.api.port}: {exc.strerror}") from None
            port = runner.addresses[0][1]
            fleet.start()
            announce(f"kvevents router: listening on http://{cfg.api.host}:{port} "
                     f"({len(cfg.pods)} pod(s){', proxy' if proxy else ''})")
            await stop.wait()
        finally:
            await runner.cleanup()
            api.telemetry.close()
    finally:
        fleet.stop()


class BindError(KVEventsError):
    pass


def run_service(cfg: ServiceConfig) -> int:
    """Run until SIGTERM (exit 0) or SIGINT (exit 130)."""
    got: list[int] = []

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda s=sig: (got.append(s), stop.set()))
        await serve(cfg, stop, announce=lambda line: print(line, flush=True))

    with asyncio.Runner(loop_factory=lambda: new_event_loop(cfg)) as runner:
        runner.run(main())
    return 130 if got and got[0] == signal.SIGINT else 0


def new_event_loop(cfg: ServiceConfig) -> asyncio.AbstractEventLoop:
    """The service's event loop (``api.event_loop``): uvloop's where installed unless the config
    says ``asyncio`` (measured: ~15% less CPU per answered request, README "HTTP stack")."""
    if cfg.api.event_loop != "asyncio":
        try:
            import uvloop
        except ImportError:
            if cfg.api.event_loop == "uvloop":
                raise
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def run_from_args(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    cfg = build_config(args)
    try:
        return run_service(cfg)
    except BindError as exc:
        print(f"kvevents router: error: {exc}", file=sys.stderr)
        return 3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvservice", description="the kvevents router service")
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_from_args(args)
    except (ConfigError, KVEventsError) as exc:
        print(f"kvevents router: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
