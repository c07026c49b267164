"""Request bodies of the API (msgspec Structs: decoding validates them) and the error shape."""

from __future__ import annotations

import re
from array import array
from typing import Annotated

import msgspec

from consumers.keys import json_tokens

__all__ = ["ApiError", "BadRequest", "ChatMessage", "ScoreRequest", "decode", "error_body", "token_ids_of"]


class ApiError(Exception):
    """A 4xx answer: ``status``, the offending ``field`` (a JSON path, or None) and a message."""

    def __init__(self, status: int, message: str, field: str | None = None, kind: str = "invalid_request") -> None:
        super().__init__(message)
        self.status = status
        self.field = field
        self.kind = kind


class BadRequest(ApiError):
    """A malformed request body (a 4xx naming what was wrong): what :func:`decode` and
    :func:`token_ids_of` raise for every input they refuse — not JSON, not UTF-8, nested past the
    decoder's depth, a wrong type or value (``field`` names it) — never the decoder's own
    exception. Same signature as :class:`ApiError` (``status``, ``message``, ``field``, ``kind``),
    caught where ApiError is."""


#: a token id: validated in msgspec's decoder (C), not by a Python loop over 4,096 ints
TokenId = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]


class ChatMessage(msgspec.Struct, forbid_unknown_fields=False):
    role: str
    content: str | list | None = None


class ScoreRequest(msgspec.Struct, forbid_unknown_fields=True):
    """One of ``token_ids``, ``prompt`` or ``messages``; ``model`` may be left out when the
    fleet serves one model."""

    model: str | None = None
    lora_name: str | None = None
    #: the JSON text of the array, kept raw: :func:`token_ids_of` reads it (in C where built) into
    #: an array('I') without a Python int per token; ``null`` or absent: not given
    token_ids: msgspec.Raw = msgspec.Raw(b"")
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    #: pod -> load, for RouterConfig.load_weight
    load: dict[str, float] | None = None


_NULL = (b"", b"null")
_TOKENS = msgspec.json.Decoder(list[TokenId])


def token_ids_of(req: ScoreRequest) -> "array | list[int] | None":
    """The request's token ids (None when not given): an array('I') from the C reader, else (no C
    extension, or anything but plain ints in range) a list from msgspec's typed decoder, whose
    error names the field (``token_ids[3]``)."""
    raw = req.token_ids
    if bytes(raw).strip() in _NULL:
        return None
    if json_tokens is not None:
        out = json_tokens(raw)
        if out is not None:
            return out
    try:
        return _TOKENS.decode(raw)
    except msgspec.ValidationError as exc:
        m = _PATH.search(str(exc))
        return _raise(str(exc).replace("`$", "`$.token_ids"), "token_ids" + (m.group(1) if m else ""))
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as exc:
        raise _undecodable(exc, "token_ids") from None


_PATH = re.compile(r" - at `\$(.*)`$")


def decode(body: bytes, kind: type) -> object:
    """Decode and validate a JSON body (``kind``: a Struct, or ``dict``/``object`` for any JSON
    object/value); :class:`BadRequest` (400) naming the problem and the field otherwise."""
    if not body:
        raise BadRequest(400, "the request body is empty: send a JSON object", None)
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        m = _PATH.search(msg)
        field = m.group(1).lstrip(".") if m else None
        if field is None:
            u = re.search(r"unknown field `([^`]*)`", msg)
            if u:
                field = u.group(1)
        return _raise(msg, field)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as exc:
        raise _undecodable(exc, None) from None


def _undecodable(exc: Exception, field: str | None) -> BadRequest:
    """The BadRequest for what the JSON decoder raises (not JSON, too deep, not UTF-8)."""
    if isinstance(exc, RecursionError):
        return BadRequest(400, "the request body nests arrays/objects too deeply for the JSON decoder", field)
    if isinstance(exc, UnicodeDecodeError):
        return BadRequest(400, f"the request body is not valid UTF-8 (byte {exc.object[exc.start]:#04x} at "
                          f"offset {exc.start} of a string)", field)
    return BadRequest(400, f"the request body is not valid JSON: {exc}", field)


def _raise(msg: str, field: str | None):
    raise BadRequest(400, msg, field or None)


def error_body(status: int, message: str, field: str | None = None, kind: str = "invalid_request") -> bytes:
    return msgspec.json.encode({"error": {"type": kind, "field": field, "message": message, "status": status}})
