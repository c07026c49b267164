"""What the event plane puts in a JetStream stream, and how it reads it back.

One stream holds every pod's messages. A message's subject is ``<prefix>.<model>.<pod>`` (each
token sanitised: NATS subject tokens cannot hold ``.``, ``*``, ``>`` or whitespace); its body is
the engine's raw vLLM payload, untouched; its headers say where it came from:

==============  =========================================================================
``Kv-Kind``     ``batch`` | ``reset`` | ``gap`` (control messages have an empty body)
``Kv-Pod``      the pod (engine) name, unsanitised
``Kv-Topic``    the engine's ZeroMQ topic
``Kv-Model``    the model, unsanitised (consumers see ``kv@<pod>@<model>`` where the topic names none)
``Kv-Dp-Rank``  the data-parallel rank
``Kv-Seq``      batch: the engine seq; reset: the first seq of the new run; gap: the first missing seq
``Kv-Run``      the engine run: a counter the plane raises at every RESET of that pod
``Kv-Missed``   gap only: how many batches were lost; ``Kv-Reason`` why
``Kv-Count``    batch only, when the bridge packs: this message holds that many consecutive
                batches (seq, seq+1, ...), each as a 4-byte big-endian length then the payload
``Nats-Msg-Id`` ``<pod>:<run>:<kind>:<seq>:<nonce>`` — JetStream's duplicate window drops a
                re-send (the same message, same id); the nonce (16 random hex digits per
                message) makes the id of a batch not yet sent unguessable, so nobody can
                store a message first under it and have JetStream drop the real one
==============  =========================================================================

Control messages travel in the same stream as the batches, so every consumer sees a pod's
RESET and GAP in order with its batches.
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass

from ...errors import ConfigError, DecodeError

__all__ = ["PlaneMsg", "StreamSpec", "id_matches", "msg_id", "pack", "pack_parts", "parse_headers", "plane_headers", "subject_for",
           "token", "unpack"]

KIND, POD, TOPIC, RANK, SEQ, RUN, MISSED, REASON, COUNT, MODEL = (
    "Kv-Kind", "Kv-Pod", "Kv-Topic", "Kv-Dp-Rank", "Kv-Seq", "Kv-Run", "Kv-Missed", "Kv-Reason", "Kv-Count", "Kv-Model")
MAX_PACK = 4096
MSG_ID = "Nats-Msg-Id"
KINDS = ("batch", "reset", "gap")
_BAD = re.compile(r"[^A-Za-z0-9_\-]")
_HEX = re.compile(r"[0-9a-f]{16}")


def token(name: str) -> str:
    """``name`` as one NATS subject token: anything but letters, digits, ``_`` and ``-`` becomes ``_``."""
    t = _BAD.sub("_", name)
    return t or "_"


def subject_for(prefix: str, model: str, pod: str) -> str:
    return f"{prefix}.{token(model or 'default')}.{token(pod)}"


_pool = b""  #: random bytes from the OS, taken 8 at a time (one getrandom call per 512 nonces)
_at = 0


def _nonce() -> str:
    global _pool, _at
    if _at + 8 > len(_pool):
        _pool, _at = os.urandom(4096), 0
    _at += 8
    return _pool[_at - 8:_at].hex()


def msg_id(pod: str, run: int, kind: str, seq: int, nonce: str | None = None) -> str:
    """A message's ``Nats-Msg-Id``; a fresh random nonce unless one is given."""
    return f"{pod}:{run}:{kind}:{seq}:{_nonce() if nonce is None else nonce}"


def id_matches(m: "PlaneMsg", mid: str | None) -> bool:
    """Whether ``mid`` is an id the plane's writers give a message with headers ``m``: the
    headers' own ``<pod>:<run>:<kind>:<seq>:`` and a 16-hex-digit nonce."""
    if not mid:
        return False
    head = f"{m.pod}:{m.run}:{m.kind}:{m.seq}:"
    n = len(head)
    return len(mid) == n + 16 and mid.startswith(head) and _HEX.fullmatch(mid, n) is not None


def plane_headers(kind: str, pod: str, topic: str, rank: int, seq: int, run: int,
                  missed: int = 0, reason: str = "", model: str = "") -> dict[str, str]:
    h = {KIND: kind, POD: pod, TOPIC: topic, RANK: str(rank), SEQ: str(seq), RUN: str(run),
         MSG_ID: msg_id(pod, run, kind, seq)}
    if model:
        h[MODEL] = model
    if kind == "gap":
        h[MISSED] = str(missed)
        h[REASON] = reason or "lost"
    return h


@dataclass(slots=True)
class PlaneMsg:
    """One stream message's headers, checked."""

    kind: str
    pod: str
    topic: str
    rank: int
    seq: int
    run: int
    missed: int = 0
    reason: str = ""
    count: int = 1  #: batch: how many packed batches the body holds
    model: str = ""

    @property
    def router_topic(self) -> str:
        """The engine's topic if it names pod and model (``kv@<pod>@<model>``), else one built from the headers."""
        if self.topic.startswith("kv@") or not self.model:
            return self.topic
        return f"kv@{self.pod}@{self.model}"


def pack_parts(payloads: list[bytes]) -> list[bytes]:
    """A packed body (see ``Kv-Count``) as its parts: each payload's 4-byte length, then the
    payload. The sender writes the parts back to back; nothing joins them in between."""
    parts = []
    for p in payloads:
        parts.append(len(p).to_bytes(4, "big"))
        parts.append(p)
    return parts


def pack(payloads: list[bytes]) -> bytes:
    """Several consecutive batches' payloads as one message body (see ``Kv-Count``)."""
    return b"".join(pack_parts(payloads))


_LEN = struct.Struct(">I").unpack_from


def unpack(body: bytes, count: int) -> list[bytes]:
    """The payloads of a packed body; a DecodeError if it does not hold exactly ``count``.

    (Slices of the bytes body, one copy each; the length prefixes read in place.)"""
    if type(body) is not bytes:
        body = bytes(body)
    out = []
    append = out.append
    pos, end = 0, len(body)
    while pos < end:
        if pos + 4 > end:
            raise DecodeError(f"packed event-plane body truncated at byte {pos} (a length prefix)")
        n = _LEN(body, pos)[0]
        pos += 4
        if pos + n > end:
            raise DecodeError(f"packed event-plane body truncated: batch {len(out)} wants {n} bytes, {end - pos} left")
        append(body[pos:pos + n])
        pos += n
    if len(out) != count:
        raise DecodeError(f"packed event-plane body holds {len(out)} batches, its {COUNT} header says {count}")
    return out


def _int(headers: dict, name: str, default: int | None = None) -> int:
    raw = headers.get(name)
    if raw is None:
        if default is not None:
            return default
        raise DecodeError(f"event-plane message lacks header {name}")
    try:
        v = int(raw)
    except (TypeError, ValueError):
        raise DecodeError(f"event-plane header {name} is not an integer: {raw!r:.40}") from None
    if v < 0 or v >= 1 << 63:
        raise DecodeError(f"event-plane header {name} out of range: {v}")
    return v


def parse_headers(headers: dict | None) -> PlaneMsg:
    """The headers of a stream message, checked; a :class:`DecodeError` names what is wrong."""
    if not headers:
        raise DecodeError("event-plane message has no headers")
    kind = headers.get(KIND)
    if kind not in KINDS:
        raise DecodeError(f"event-plane header {KIND} is {kind!r:.40}, not one of {KINDS}")
    pod = headers.get(POD)
    if not pod:
        raise DecodeError(f"event-plane message lacks header {POD}")
    count = _int(headers, COUNT, 1) if kind == "batch" else 1
    if not 1 <= count <= MAX_PACK:
        raise DecodeError(f"event-plane header {COUNT} must be 1..{MAX_PACK}, got {count}")
    return PlaneMsg(kind, pod, headers.get(TOPIC, ""), _int(headers, RANK, 0), _int(headers, SEQ), _int(headers, RUN),
                    _int(headers, MISSED, 0) if kind == "gap" else 0, headers.get(REASON, "") if kind == "gap" else "",
                    count, headers.get(MODEL, ""))


@dataclass(slots=True)
class StreamSpec:
    """The stream the plane writes: its name, subject prefix and bounds.

    ``max_bytes``/``max_age`` bound the stream (the oldest messages go first when hit: size it so
    a snapshot period's worth always fits, see the README); ``duplicate_window`` is how long
    JetStream remembers message ids (a re-send after a bridge restart is dropped within it).
    """

    name: str = "KVEVENTS"
    prefix: str = "kvevents"
    max_bytes: int = 1 << 30
    max_age: float = 0.0  #: seconds; 0 = no age limit (the replicas' purge trims the stream)
    max_msgs: int = 0  #: 0 = no count limit
    duplicate_window: float = 120.0
    storage: str = "file"  #: "file" (survives a server restart) or "memory"
    replicas: int = 1  #: JetStream replication factor (3 on a real cluster)

    def __post_init__(self) -> None:
        if not self.name or _BAD.search(self.name):
            raise ConfigError(f"stream name {self.name!r} must be letters, digits, _ or -")
        if not self.prefix or any(not t or _BAD.search(t) for t in self.prefix.split(".")):
            raise ConfigError(f"subject prefix {self.prefix!r} must be dot-separated tokens of letters, digits, _ or -")
        if self.storage not in ("file", "memory"):
            raise ConfigError(f"stream storage must be 'file' or 'memory', got {self.storage!r}")
        if self.max_bytes <= 0 or self.duplicate_window <= 0 or self.replicas < 1 or self.max_msgs < 0:
            raise ConfigError("stream max_bytes and duplicate_window must be > 0, replicas >= 1, max_msgs >= 0")

    @property
    def subjects(self) -> str:
        return f"{self.prefix}.>"

    async def ensure(self, js, *, update: bool = True) -> None:
        """Create the stream, or update its bounds if it exists (a writer's part: readers pass
        ``update=False`` and leave an existing stream as it is — their users may not change it)."""
        from nats.js import api
        from nats.js.errors import NotFoundError

        cfg = api.StreamConfig(
            name=self.name, subjects=[self.subjects], max_bytes=self.max_bytes, max_msgs=self.max_msgs or None,
            max_age=self.max_age or None, duplicate_window=self.duplicate_window,
            storage=api.StorageType.FILE if self.storage == "file" else api.StorageType.MEMORY,
            num_replicas=self.replicas, discard=api.DiscardPolicy.OLD)
        try:
            await js.stream_info(self.name)
        except NotFoundError:
            await js.add_stream(cfg)
        else:
            if update:
                await js.update_stream(cfg)
