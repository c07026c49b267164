"""The service's configuration: one schema, read from TOML (or YAML when PyYAML is importable)
and/or command-line flags, validated with an error that names the bad key.

Each section is a ``msgspec.Struct`` and the whole file one (:class:`ServiceConfig`):
:func:`from_dict` decodes the parsed file with msgspec (:func:`kvevents.settings.decode`), so an
unknown key, a wrong type or a value out of its range (``Meta``, ``Literal``, ``__post_init__``)
is refused with one line naming the key by msgspec's path (``pods[0].dp: unknown key (known:
...)``, ``api.port must be int <= 65535, got 70000``); :meth:`ServiceConfig.validate` then checks
the rules between keys (endpoints, bind mode, models, the proxy's pods).

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
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from consumers import RouterConfig
from kvevents.endpoints import offset_endpoint, validate_endpoint
from kvevents.errors import ConfigError, EndpointError
from kvevents.settings import KeyCheck, decode

from .http_limits import HttpConfig
from .proxy_config import ProxyConfig

__all__ = ["ApiConfig", "PodConfig", "RouterSection", "ServiceConfig", "SubscriberConfig", "from_dict", "load_config"]

#: seconds, > 0
Seconds = Annotated[float, Meta(gt=0)]


class RouterSection(Struct, forbid_unknown_fields=True, kw_only=True):
    """``[router]``: the consumers.RouterConfig fields a config file may set (the rest are the
    router's internals). A key left out keeps RouterConfig's default, which also checks the
    ranges (:meth:`ServiceConfig.router_config`)."""

    model: Annotated[str, Meta(min_length=1)] | None = None
    block_size: int | UnsetType = UNSET
    max_entries: int | UnsetType = UNSET
    max_learned: int | None | UnsetType = UNSET
    load_weight: float | UnsetType = UNSET
    #: a partial table overrides RouterConfig's defaults key by key
    tier_weights: dict[str, float] | UnsetType = UNSET
    default_tier_weight: float | UnsetType = UNSET
    offload_chunk_blocks: dict[str, int] | UnsetType = UNSET
    state_factors: dict[str, float] | UnsetType = UNSET
    pending_capacity: int | UnsetType = UNSET
    pending_max_batches: int | UnsetType = UNSET
    max_tiers: int | UnsetType = UNSET
    relearn_batches: int | UnsetType = UNSET


#: RouterConfig fields a config file may set
ROUTER_KEYS = RouterSection.__struct_fields__


class PodConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    endpoint: str | None = None
    replay_endpoint: str | None = None
    model: str | None = None
    data_parallel_size: Annotated[int, Meta(ge=1)] = 1
    http: str | None = None
    topic: str | None = None

    def __post_init__(self) -> None:
        if not self.name or "#" in self.name:
            raise KeyCheck("name", "must be a non-empty string without '#'", self.name)
        if self.http is not None and not self.http.startswith(("http://", "https://")):
            raise KeyCheck("http", "must be an http:// or https:// URL", self.http)

    def publishers(self) -> list[tuple[str, str | None, str | None]]:
        """``(identity, endpoint, replay)`` per data-parallel rank (rank 0 is the pod's name)."""
        out = []
        for r in range(self.data_parallel_size):
            ident = self.name if r == 0 else f"{self.name}#dp{r}"
            out.append((ident, offset_endpoint(self.endpoint, r), offset_endpoint(self.replay_endpoint, r)))
        return out


class ApiConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    host: str = "127.0.0.1"
    port: Annotated[int, Meta(ge=0, le=65535)] = 8000
    api_token_file: str | None = None
    max_body_bytes: Annotated[int, Meta(ge=1024)] = 1 << 20
    proxy: bool = False
    tokenizer: str | None = None
    upstream_timeout: Seconds = 60.0
    down_for: Seconds = 10.0
    #: answer POST /v1/score and /v1/pick with the lean HTTP/1.1 front (kvservice.fasthttp);
    #: false: every request goes through aiohttp
    fast_path: bool = True
    #: the process's GIL switch interval (sys.setswitchinterval), in ms: the longest the ingest
    #: thread keeps the GIL while the API's loop waits for it, and back (CPython's default: 5)
    gil_switch_ms: Annotated[float, Meta(gt=0)] = 1.0
    #: the service's event loop: "auto" (uvloop where installed, else asyncio's), "uvloop", "asyncio"
    event_loop: Literal["auto", "uvloop", "asyncio"] = "auto"


class SubscriberConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    late_join: bool = True
    stale_after: Seconds = 10.0
    replay_timeout: Seconds = 2.0
    bind: str | None = None
    #: nats://HOST:PORT: read the fleet's events from the JetStream event plane instead of ZeroMQ
    event_plane: str | None = None
    replica_name: str | None = None  #: with event_plane: the durable consumer's name (default kvrouter-<pid>)
    #: seconds: while batches trickle in, the ingest thread polls at most this often (each poll of
    #: many pods' sockets costs CPU, each wake-up a GIL hand-over); a backlog drains without pause;
    #: 0: poll again at once
    poll_interval: Annotated[float, Meta(ge=0, le=1)] = 0.005

    def __post_init__(self) -> None:
        if self.event_plane is not None and not self.event_plane.startswith(("nats://", "tls://")):
            raise KeyCheck("event_plane", "must be a nats://HOST:PORT URL", self.event_plane)


class ServiceConfig(Struct, forbid_unknown_fields=True, kw_only=True):
    router: RouterSection = msgspec.field(default_factory=RouterSection)
    api: ApiConfig = msgspec.field(default_factory=ApiConfig)
    subscriber: SubscriberConfig = msgspec.field(default_factory=SubscriberConfig)
    pods: list[PodConfig] = msgspec.field(default_factory=list)
    #: [http]: every connection's bounds (http_limits.py)
    http: HttpConfig = msgspec.field(default_factory=HttpConfig)
    proxy: ProxyConfig = msgspec.field(default_factory=ProxyConfig)

    def router_config(self) -> RouterConfig:
        """The RouterConfig: the [router] keys given, plus publisher identity -> pod for every rank."""
        kw = msgspec.structs.asdict(self.router)
        kw = {k: v for k, v in kw.items() if v is not UNSET}
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
        except ConfigError as exc:  # its own range checks: "RouterConfig.block_size must be ..."
            raise ConfigError(f"router.{str(exc).removeprefix('RouterConfig.')}") from None

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
        return pod.model or self.router.model

    def models(self) -> set[str]:
        out = {m for p in self.pods if (m := self.pod_model(p))}
        if self.router.model:
            out.add(self.router.model)
        return out

    def validate(self) -> "ServiceConfig":
        """The rules between keys (each key's own were checked when it was decoded: from_dict)."""
        bind = self.subscriber.bind
        if self.subscriber.event_plane is not None:
            if bind is not None:
                raise ConfigError("subscriber.event_plane and subscriber.bind are alternatives: give one")
            # pods are learned from the plane's kv@<pod>@<model> topics, as in bind mode
            bind = self.subscriber.event_plane
        elif bind is not None:
            _endpoint(bind, "subscriber.bind")
        elif not self.pods:
            raise ConfigError("no pods: give [[pods]] (or --pod NAME=ENDPOINT) or subscriber.bind for engines to "
                              "connect to")
        seen: set[str] = set()
        topics: dict[str, str] = {}
        for i, p in enumerate(self.pods):
            where = f"pods[{i}]"
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
            try:
                p.publishers()
            except EndpointError as exc:
                raise ConfigError(f"{where}: {exc}") from None
            if self.pod_model(p) is None:
                # vLLM's default topic "" names no model: a batch from this pod could not be attributed
                raise ConfigError(f"{where}.model: pod {p.name!r} names no model and router.model is not set; "
                                  "vLLM's default topic \"\" does not carry one, so its events could not be indexed")
        if self.api.event_loop == "uvloop" and importlib.util.find_spec("uvloop") is None:
            raise ConfigError("api.event_loop = \"uvloop\" but uvloop is not installed (pip install uvloop)")
        if self.api.proxy and not any(p.http for p in self.pods):
            raise ConfigError("api.proxy needs pods with an http URL (pods[].http) to forward to")
        self.router_config()
        return self


def _endpoint(ep: object, key: str) -> None:
    try:
        validate_endpoint(ep, what=key)  # type: ignore[arg-type]
    except EndpointError as exc:
        raise ConfigError(str(exc)) from None


def from_dict(data: Any) -> ServiceConfig:
    """A ServiceConfig from parsed TOML/YAML: every key's type and range checked here, with one
    line naming the key (msgspec's path); the rules between keys: :meth:`ServiceConfig.validate`."""
    return decode(data, ServiceConfig)


def read_config(path: str | Path) -> Any:
    """A TOML file's tables (``.yaml``/``.yml``: YAML, when PyYAML is importable), not yet checked."""
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
            return yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    if tomllib is None:
        raise ConfigError(f"{p}: reading TOML needs Python 3.11+ (tomllib); use YAML with PyYAML instead")
    try:
        return tomllib.loads(text.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p}: not valid TOML: {exc}") from None


def load_config(path: str | Path) -> ServiceConfig:
    """Read and decode a config file; an error names the file, then the key."""
    data = read_config(path)
    try:
        return from_dict(data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
