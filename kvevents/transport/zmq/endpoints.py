"""Endpoint strings: validation, the per-data-parallel-rank offset, and bind-or-connect.

The rules follow vLLM's publisher so a fleet configured for vLLM works unchanged:

* rank 0 uses the endpoint as given; rank r > 0 adds r to a tcp port, and appends ``_dp<r>``
  to an ipc/inproc path;
* a PUB socket binds when the endpoint is ipc://, inproc://, or names a wildcard host
  (``*``, ``0.0.0.0``, ``::``), and connects otherwise (a central proxy/subscriber binds);
  ``mode="bind"``/``"connect"`` overrides that guess;
* a replay (ROUTER) socket always binds.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...errors import EndpointError

SCHEMES = ("tcp://", "ipc://", "inproc://")
_WILDCARDS = ("*", "0.0.0.0", "::", "[::]")


@dataclass(slots=True)
class PublisherSpec:
    """One publisher a connect-mode subscriber follows."""

    endpoint: str | None  #: PUB endpoint to connect to (None in bind mode)
    replay_endpoint: str | None = None
    name: str | None = None  #: identity in deliveries and health; defaults to the endpoint (or topic in bind mode)


def publisher_spec(p: "str | tuple | PublisherSpec") -> PublisherSpec:
    """``p`` (an endpoint, ``(endpoint, replay[, name])`` or a spec) as a checked PublisherSpec."""
    if isinstance(p, PublisherSpec):
        spec = p
    elif isinstance(p, str):
        spec = PublisherSpec(p)
    elif isinstance(p, tuple) and 1 <= len(p) <= 3:
        spec = PublisherSpec(*p)
    else:
        raise EndpointError(f"a publisher is an endpoint string, (endpoint, replay[, name]) or PublisherSpec; got {p!r}")
    validate_endpoint(spec.endpoint, what="publisher endpoint")
    if spec.replay_endpoint:
        validate_endpoint(spec.replay_endpoint, what="replay endpoint")
    return spec


def validate_endpoint(endpoint: str, *, what: str = "endpoint") -> str:
    """Return ``endpoint`` if it is a ZeroMQ endpoint we can use, else raise EndpointError."""
    if not isinstance(endpoint, str) or not endpoint:
        raise EndpointError(f"{what} must be a non-empty string like tcp://127.0.0.1:5557, got {endpoint!r}")
    if not endpoint.startswith(SCHEMES):
        raise EndpointError(f"{what} {endpoint!r} has no supported scheme (tcp://, ipc://, inproc://)")
    rest = endpoint.split("://", 1)[1]
    if not rest:
        raise EndpointError(f"{what} {endpoint!r} names no address")
    if endpoint.startswith("tcp://"):
        host, sep, port = rest.rpartition(":")
        if not sep or not host:
            raise EndpointError(f"{what} {endpoint!r} needs host:port")
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise EndpointError(f"{what} {endpoint!r} has an invalid port {port!r}")
    return endpoint


def offset_endpoint(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """The endpoint data-parallel rank ``data_parallel_rank`` uses (see module docstring)."""
    if not endpoint or not data_parallel_rank:
        return endpoint
    if data_parallel_rank < 0:
        raise EndpointError(f"data_parallel_rank must be >= 0, got {data_parallel_rank}")
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{data_parallel_rank}"
    if endpoint.startswith("tcp://"):
        base, sep, port = endpoint.rpartition(":")
        if not sep or not port.isdigit():
            raise EndpointError(f"tcp endpoint {endpoint!r} must include a port to offset by rank")
        new_port = int(port) + data_parallel_rank
        if new_port > 65535:
            raise EndpointError(
                f"endpoint {endpoint!r} + data_parallel_rank {data_parallel_rank} exceeds port 65535"
            )
        return f"{base}:{new_port}"
    raise EndpointError(f"endpoint {endpoint!r} has no supported scheme (tcp://, ipc://, inproc://)")


def should_bind(endpoint: str, mode: str = "auto") -> bool:
    """Whether a PUB socket on ``endpoint`` binds (True) or connects (False)."""
    if mode == "bind":
        return True
    if mode == "connect":
        return False
    if mode != "auto":
        raise EndpointError(f"mode must be 'auto', 'bind' or 'connect', got {mode!r}")
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    host = endpoint.split("://", 1)[1].rpartition(":")[0]
    return host in _WILDCARDS


def probe_replay_endpoint(ctx, endpoint: str, timeout: float) -> bool:
    """Ask the replay socket at ``endpoint`` for an empty replay: True when its end marker came
    back within ``timeout`` seconds (ZeroMQ connects lazily: this finds an unreachable one)."""
    import time

    import zmq

    from .frames import PROBE_SEQ, is_end_marker

    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart((b"", PROBE_SEQ), zmq.NOBLOCK)
        deadline = time.monotonic() + timeout
        while sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            if is_end_marker(sock.recv_multipart()):
                return True
            if time.monotonic() >= deadline:
                break
        return False
    except zmq.ZMQError:
        return False
    finally:
        sock.close(0)
