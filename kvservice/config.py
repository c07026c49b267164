"""The service's configuration: one schema, read from TOML (or YAML when PyYAML is importable)
and/or command-line flags, validated with an error that names the bad key.

Schema (every section and key optional unless marked; unknown keys are errors)::

    [router]                     # consumers.RouterConfig fields
    model = "meta-llama/Llama-3.1-8B-Instruct"   # model of pods that do not name one
    block_size = 16
    max_entries = 4194304
    load_weight = 0.0
    tier_weights = { GPU = 1.0, CPU = 0.8, STORAGE = 0.5 }
    offload_chunk_blocks = { CPU = 2 }

    [api]
    host = "127.0.0.1"
    port = 8000
    api_token_file = "/etc/kvevents/token"   # bearer auth; none: no auth
    max_body_bytes = 1048576
    proxy = false                # serve /v1/completions and /v1/chat/completions
    tokenizer = "/models/llama"  # a directory with tokenizer.json (+ tokenizer_config.json)
    upstream_timeout = 60.0      # seconds a pod has to answer a proxied request
    down_for = 10.0              # seconds a failed pod is skipped by the proxy
    fast_path = true             # POST /v1/score and /v1/pick on the lean HTTP front (kvservice.fasthttp)
    gil_switch_ms = 1.0          # sys.setswitchinterval for the service's process (CPython's default: 5 ms)
    event_loop = "auto"          # "auto" (uvloop where installed), "uvloop" or "asyncio"

    [proxy]                      # the OpenAI-compatible proxy: kvservice.proxy_config (docs/proxy.md)
    max_retries = 2

    [subscriber]
    late_join = true             # replay what each publisher still buffers at start
    stale_after = 10.0
    replay_timeout = 2.0
    bind = "tcp://*:5557"        # bind mode: engines connect here (pods then need a topic)
    poll_interval = 0.005        # s: ingest polls at most this often while batches trickle in

    [[pods]]
    name = "pod-a"               # required
    endpoint = "tcp://10.0.0.5:5557"          # PUB endpoint (connect mode; required there)
    replay_endpoint = "tcp://10.0.0.5:5558"
    model = "..."                # else router.model
    data_parallel_size = 1       # ranks r > 0 publish on endpoint + r (vLLM's rule)
    http = "http://10.0.0.5:8000"   # its OpenAI-compatible server (proxy, /tokenize)
    topic = "kv-a"               # bind mode: the topic this pod publishes on
"""

from __future__ import annotations

import importlib.util
import os

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = None  # type: ignore[assignment]
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from consumers import RouterConfig
from kvevents.endpoints import offset_endpoint, validate_endpoint
from kvevents.errors import ConfigError, EndpointError

from .http_limits import HttpConfig
from .proxy_config import ProxyConfig, proxy_section

__all__ = ["ApiConfig", "PodConfig", "ServiceConfig", "SubscriberConfig", "load_config"]

#: RouterConfig fields a config file may set (the rest are the router's internals)
ROUTER_KEYS = ("model", "block_size", "max_entries", "max_learned", "load_weight", "tier_weights",
               "default_tier_weight", "offload_chunk_blocks", "state_factors", "pending_capacity",
               "pending_max_batches", "max_tiers", "relearn_batches")


@dataclass(slots=True)
class PodConfig:
    name: str
    endpoint: str | None = None
    replay_endpoint: str | None = None
    model: str | None = None
    data_parallel_size: int = 1
    http: str | None = None
    topic: str | None = None

    def publishers(self) -> list[tuple[str, str | None, str | None]]:
        """``(identity, endpoint, replay)`` per data-parallel rank (rank 0 is the pod's name)."""
        out = []
        for r in range(self.data_parallel_size):
            ident = self.name if r == 0 else f"{self.name}#dp{r}"
            out.append((ident, offset_endpoint(self.endpoint, r), offset_endpoint(self.replay_endpoint, r)))
        return out


@dataclass(slots=True)
class ApiConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_token_file: str | None = None
    max_body_bytes: int = 1 << 20
    proxy: bool = False
    tokenizer: str | None = None
    upstream_timeout: float = 60.0
    down_for: float = 10.0
    #: answer POST /v1/score and /v1/pick with the lean HTTP/1.1 front (kvservice.fasthttp);
    #: false: every request goes through aiohttp
    fast_path: bool = True
    #: the process's GIL switch interval (sys.setswitchinterval), in ms: the longest the ingest
    #: thread keeps the GIL while the API's loop waits for it, and back (CPython's default: 5)
    gil_switch_ms: float = 1.0
    #: the service's event loop: "auto" (uvloop where installed, else asyncio's), "uvloop", "asyncio"
    event_loop: str = "auto"


@dataclass(slots=True)
class SubscriberConfig:
    late_join: bool = True
    stale_after: float = 10.0
    replay_timeout: float = 2.0
    bind: str | None = None
    #: nats://HOST:PORT: read the fleet's events from the JetStream event plane instead of ZeroMQ
    event_plane: str | None = None
    replica_name: str | None = None  #: with event_plane: the durable consumer's name (default kvrouter-<pid>)
    #: seconds: while batches trickle in, the ingest thread polls at most this often (each poll of
    #: many pods' sockets costs CPU, each wake-up a GIL hand-over); a backlog drains without pause;
    #: 0: poll again at once
    poll_interval: float = 0.005


@dataclass(slots=True)
class ServiceConfig:
    router: dict[str, Any] = field(default_factory=dict)
    api: ApiConfig = field(default_factory=ApiConfig)
    subscriber: SubscriberConfig = field(default_factory=SubscriberConfig)
    pods: list[PodConfig] = field(default_factory=list)
    http: HttpConfig = field(default_factory=HttpConfig)  #: [http]: every connection's bounds (http_limits.py)
    proxy: ProxyConfig = field(default_factory=ProxyConfig)

    def router_config(self) -> RouterConfig:
        """The RouterConfig: the [router] keys, plus publisher identity -> pod for every rank."""
        kw = dict(self.router)
        if kw.get("model") is None:
            models = {p.model for p in self.pods}
            if len(models) == 1 and None not in models:
                kw["model"] = models.pop()
        pub_pods = {}
        for p in self.pods:
            if self.subscriber.bind is not None:
                pub_pods[p.topic or ""] = p.name
            else:
                for ident, _ep, _rep in p.publishers():
                    pub_pods[ident] = p.name
        kw["publisher_pods"] = pub_pods
        for k in ("tier_weights", "state_factors"):
            if k in kw:  # a partial table overrides the defaults key by key
                kw[k] = {**getattr(RouterConfig(), k), **kw[k]}
        try:
            return RouterConfig(**kw)
        except ConfigError as exc:
            raise ConfigError(f"[router]: {exc}") from None

    def event_source(self) -> tuple[list[str], dict[str, Any]]:
        """``(urls, options)`` for :func:`kvevents.open_source`: the JetStream event plane (a
        durable consumer), else the bind endpoint (pods told apart by topic), else every rank's
        PUB endpoint, named by its identity (``pod``, ``pod#dp1``...) with its replay endpoint."""
        sc = self.subscriber
        if sc.event_plane is not None:  # (kind named: a tls:// URL is the plane too)
            return [sc.event_plane], {"kind": "nats", "durable": sc.replica_name or f"kvrouter-{os.getpid()}",
                                      "stale_after": sc.stale_after}
        # kind named: one subscriber reads tcp:// and ipc:// pods alike
        opts = {"kind": "zmq", "late_join": sc.late_join, "stale_after": sc.stale_after,
                "replay_timeout": sc.replay_timeout, "raw": True}
        if sc.bind is not None:
            replays = {p.topic or "": p.replay_endpoint for p in self.pods if p.replay_endpoint}
            return [sc.bind], {**opts, "bind": True, "replay_endpoints": replays}
        ranks = [r for p in self.pods for r in p.publishers()]
        return [ep for _, ep, _ in ranks], {**opts, "names": {ep: ident for ident, ep, _ in ranks},
                                            "replays": {ep: rep for _, ep, rep in ranks if rep}}

    def pod_model(self, pod: PodConfig) -> str | None:
        return pod.model or self.router.get("model")

    def models(self) -> set[str]:
        out = {m for p in self.pods if (m := self.pod_model(p))}
        if self.router.get("model"):
            out.add(self.router["model"])
        return out

    def validate(self) -> "ServiceConfig":
        bind = self.subscriber.bind
        plane = self.subscriber.event_plane
        if plane is not None:
            if not isinstance(plane, str) or not plane.startswith(("nats://", "tls://")):
                raise ConfigError(f"subscriber.event_plane must be a nats://HOST:PORT URL, got {plane!r}")
            if bind is not None:
                raise ConfigError("subscriber.event_plane and subscriber.bind are alternatives: give one")
            bind = plane  # pods are learned from the plane's kv@<pod>@<model> topics, as in bind mode
        elif bind is not None:
            _endpoint(bind, "subscriber.bind")
        elif not self.pods:
            raise ConfigError("no pods: give [[pods]] (or --pod NAME=ENDPOINT) or subscriber.bind for engines to "
                              "connect to")
        seen: set[str] = set()
        topics: dict[str, str] = {}
        for i, p in enumerate(self.pods):
            where = f"pods[{i}]"
            if not isinstance(p.name, str) or not p.name or "#" in p.name:
                raise ConfigError(f"{where}.name must be a non-empty string without '#', got {p.name!r}")
            if p.name in seen:
                raise ConfigError(f"{where}.name {p.name!r} is given twice")
            seen.add(p.name)
            if bind is None:
                if p.endpoint is None:
                    raise ConfigError(f"{where}.endpoint is required (the pod's PUB endpoint) unless "
                                      "subscriber.bind is set")
                _endpoint(p.endpoint, f"{where}.endpoint")
            else:
                t = p.topic or ""
                if t in topics:
                    raise ConfigError(f"{where}.topic {t!r} is also pod {topics[t]!r}'s: in bind mode pods are told "
                                      "apart by topic, give each pod its own")
                topics[t] = p.name
            if p.replay_endpoint is not None:
                _endpoint(p.replay_endpoint, f"{where}.replay_endpoint")
            if not isinstance(p.data_parallel_size, int) or p.data_parallel_size < 1:
                raise ConfigError(f"{where}.data_parallel_size must be a positive int, got {p.data_parallel_size!r}")
            try:
                p.publishers()
            except EndpointError as exc:
                raise ConfigError(f"{where}: {exc}") from None
            if p.http is not None and not (isinstance(p.http, str) and p.http.startswith(("http://", "https://"))):
                raise ConfigError(f"{where}.http must be an http:// or https:// URL, got {p.http!r}")
            if self.pod_model(p) is None:
                # vLLM's default topic "" names no model: a batch from this pod could not be attributed
                raise ConfigError(f"{where}.model: pod {p.name!r} names no model and router.model is not set; "
                                  "vLLM's default topic \"\" does not carry one, so its events could not be indexed")
        a = self.api
        if not isinstance(a.port, int) or not 0 <= a.port <= 65535:
            raise ConfigError(f"api.port must be an int in [0, 65535], got {a.port!r}")
        if not isinstance(a.max_body_bytes, int) or a.max_body_bytes < 1024:
            raise ConfigError(f"api.max_body_bytes must be an int >= 1024, got {a.max_body_bytes!r}")
        for k in ("upstream_timeout", "down_for", "gil_switch_ms"):
            v = getattr(a, k)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"api.{k} must be a positive number, got {v!r}")
        if a.event_loop not in ("auto", "uvloop", "asyncio"):
            raise ConfigError(f"api.event_loop must be one of auto, uvloop, asyncio, got {a.event_loop!r}")
        if a.event_loop == "uvloop" and importlib.util.find_spec("uvloop") is None:
            raise ConfigError("api.event_loop = \"uvloop\" but uvloop is not installed (pip install uvloop)")
        if a.proxy and not any(p.http for p in self.pods):
            raise ConfigError("api.proxy needs pods with an http URL (pods[].http) to forward to")
        for k in ("stale_after", "replay_timeout"):
            v = getattr(self.subscriber, k)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v <= 0:
                raise ConfigError(f"subscriber.{k} must be a positive number, got {v!r}")
        v = self.subscriber.poll_interval
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v <= 1:
            raise ConfigError(f"subscriber.poll_interval must be seconds in [0, 1], got {v!r}")
        self.http.validate()
        self.router_config()
        return self


def _endpoint(ep: object, key: str) -> None:
    try:
        validate_endpoint(ep, what=key)  # type: ignore[arg-type]
    except EndpointError as exc:
        raise ConfigError(str(exc)) from None


def _section(cls, data: object, where: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a table, got {type(data).__name__}")
    names = {f.name: f for f in fields(cls)}
    for k in data:
        if k not in names:
            raise ConfigError(f"{where}.{k}: unknown key (known: {', '.join(sorted(names))})")
    kw = {}
    for k, v in data.items():
        want = names[k].type
        _check_type(v, want, f"{where}.{k}")
        kw[k] = v
    if cls is PodConfig and "name" not in kw:
        raise ConfigError(f"{where}.name is required")
    return cls(**kw)


_TYPES = {"str": str, "int": int, "float": (int, float), "bool": bool}


def _check_type(v: object, want: str, key: str) -> None:
    optional = want.endswith(" | None")
    base = want.removesuffix(" | None")
    if v is None and optional:
        return
    t = _TYPES.get(base)
    if t is None:
        return
    ok = isinstance(v, t) and (base == "bool" or not isinstance(v, bool))
    if not ok:
        raise ConfigError(f"{key} must be {base}, got {v!r}")


def from_dict(data: dict) -> ServiceConfig:
    """A ServiceConfig from parsed TOML/YAML (not yet validated: :meth:`ServiceConfig.validate`)."""
    if not isinstance(data, dict):
        raise ConfigError("the config must be a table at the top level")
    known = ("router", "api", "subscriber", "pods", "http", "proxy")
    for k in data:
        if k not in known:
            raise ConfigError(f"{k}: unknown key (known: {', '.join(known)})")
    router = data.get("router", {})
    if not isinstance(router, dict):
        raise ConfigError("router must be a table")
    for k in router:
        if k not in ROUTER_KEYS:
            raise ConfigError(f"router.{k}: unknown key (known: {', '.join(ROUTER_KEYS)})")
    if "model" in router and not (router["model"] is None or isinstance(router["model"], str) and router["model"]):
        raise ConfigError(f"router.model must be a non-empty string, got {router['model']!r}")
    pods = data.get("pods", [])
    if not isinstance(pods, list):
        raise ConfigError("pods must be an array of tables ([[pods]])")
    return ServiceConfig(
        router=dict(router),
        api=_section(ApiConfig, data.get("api", {}), "api"),
        subscriber=_section(SubscriberConfig, data.get("subscriber", {}), "subscriber"),
        pods=[_section(PodConfig, p, f"pods[{i}]") for i, p in enumerate(pods)],
        http=_section(HttpConfig, data.get("http", {}), "http"),
        proxy=proxy_section(data.get("proxy", {})),
    )


def load_config(path: str | Path) -> ServiceConfig:
    """Read a TOML file (``.yaml``/``.yml``: YAML, when PyYAML is importable)."""
    p = Path(path)
    try:
        text = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config {str(p)!r}: {exc.strerror}") from None
    if p.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ConfigError(f"{p}: YAML needs PyYAML (pip install pyyaml), or write the config as TOML") from None
        try:
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    else:
        if tomllib is None:
            raise ConfigError(f"{p}: reading TOML needs Python 3.11+ (tomllib); use YAML with PyYAML instead")
        try:
            data = tomllib.loads(text.decode("utf-8"))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{p}: not valid TOML: {exc}") from None
    try:
        return from_dict(data)
    except ConfigError as exc:
        raise ConfigError(f"{p}: {exc}") from None
