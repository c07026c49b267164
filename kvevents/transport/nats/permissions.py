"""Who may do what on the event plane, as nats-server enforces it: users with per-subject
permissions, one role each.

* ``bridge`` (and an engine's ``"nats"`` publisher): publish on its own pods' subjects
  (``<prefix>.<model>.<pod>``) and nothing else in the stream; create/update the stream, read
  its messages back (resume from the last message per pod; checking a duplicate ack).
* ``replica`` (``python -m kvservice.replica --name R``): its own durable consumer
  (``replica-R``: create, delete, pull, acknowledge), read messages and purge the stream (the
  purge-lease holder trims below every cover); in the snapshot bucket write its own object's
  meta (chunks are named by random ids: any chunk) and read every snapshot; in the replica
  bucket put its own ``cover.R`` and take/release the purge lease. It cannot publish on any
  pod's subject.
* ``reader`` (``kvevents router --event-plane`` without replicas): its own durable consumer.

Every role subscribes to ``_INBOX.>`` for replies (nats-py's request inbox). A subject the
user may not publish on is refused by the server (``Publish Violation`` in its log; the
client sees the request time out or an error): nothing the plane reads ever carries it.

:func:`permissions` gives one role's rules; :func:`auth_config` a whole ``authorization``
block for ``nats-server -c``: the deploy recipe (docs/event-plane-security.md), the plane demo
and the tests use it.
"""

from __future__ import annotations

import base64
import json

from ...errors import ConfigError
from .wire import StreamSpec, subject_for

__all__ = ["ROLES", "auth_config", "permissions"]

ROLES = ("bridge", "replica", "reader")
SNAPSHOTS, REPLICAS = "kvrouter-snapshots", "kvrouter-replicas"


def _api(*parts: str) -> str:
    return "$JS.API." + ".".join(parts)


def permissions(role: str, *, stream: StreamSpec | None = None, pods: list[tuple[str, str]] = (),
                name: str = "", snapshots: str = SNAPSHOTS, replicas: str = REPLICAS) -> dict:
    """nats-server ``permissions`` for one user: ``{"publish": {"allow": [...]}, "subscribe": {...}}``.

    ``pods``: the (model, pod) pairs a bridge writes; ``name``: a replica's name (``--name``) or
    a reader's durable consumer."""
    s = stream or StreamSpec()
    sn = s.name
    if role == "bridge":
        if not pods:
            raise ConfigError("a bridge's permissions need the (model, pod) pairs it writes")
        pub = [subject_for(s.prefix, model, pod) for model, pod in pods]
        pub += [_api("STREAM", op, sn) for op in ("INFO", "CREATE", "UPDATE")] + [_api("STREAM.MSG.GET", sn)]
    elif role in ("replica", "reader"):
        if not name:
            raise ConfigError(f"a {role}'s permissions need its name")
        durable = f"replica-{name}" if role == "replica" else name
        pub = [_api("STREAM.INFO", sn), _api("STREAM.CREATE", sn),
               _api("CONSUMER.DURABLE.CREATE", sn, durable), _api("CONSUMER.CREATE", sn, durable),
               _api("CONSUMER.CREATE", sn, durable, ">"), _api("CONSUMER.DELETE", sn, durable),
               _api("CONSUMER.INFO", sn, durable), _api("CONSUMER.MSG.NEXT", sn, durable),
               f"$JS.ACK.{sn}.{durable}.>"]
        if role == "replica":
            obj, kv = f"OBJ_{snapshots}", f"KV_{replicas}"
            meta = base64.urlsafe_b64encode(name.encode()).decode()
            pub += [_api("STREAM.MSG.GET", sn), _api("STREAM.PURGE", sn),
                    _api("STREAM.INFO", obj), _api("STREAM.CREATE", obj), _api("STREAM.MSG.GET", obj),
                    _api("STREAM.PURGE", obj), _api("CONSUMER.CREATE", obj), _api("CONSUMER.CREATE", obj, ">"),
                    _api("CONSUMER.DELETE", obj, ">"), f"$O.{snapshots}.C.>", f"$O.{snapshots}.M.{meta}",
                    _api("STREAM.INFO", kv), _api("STREAM.CREATE", kv), _api("STREAM.MSG.GET", kv),
                    _api("DIRECT.GET", kv, ">"), f"$KV.{replicas}.cover.{name}", f"$KV.{replicas}.purge-lease",
                    "$JS.FC.>"]
    else:
        raise ConfigError(f"unknown event-plane role {role!r}: one of {ROLES}")
    return {"publish": {"allow": pub}, "subscribe": {"allow": ["_INBOX.>"]}}


def auth_config(users: list[dict]) -> str:
    """An ``authorization { users = [...] }`` block for nats-server's configuration file.

    ``users``: ``{"user": U, "password": P, "role": R, ...}`` with :func:`permissions`' keyword
    arguments (``pods``, ``name``, ``stream``); a user with role ``admin`` may do anything
    (operators: set up, inspect)."""
    out = []
    for u in users:
        kw = {k: v for k, v in u.items() if k not in ("user", "password", "role")}
        entry = {"user": u["user"], "password": u["password"]}
        if u["role"] != "admin":
            entry["permissions"] = permissions(u["role"], **kw)
        out.append(entry)
    return "authorization {\n  users = " + json.dumps(out, indent=2) + "\n}\n"
