"""Request bodies of the API (msgspec Structs: decoding validates them) and the error shape."""

from __future__ import annotations

import re
from typing import Annotated

import msgspec

__all__ = ["ApiError", "ChatMessage", "ScoreRequest", "decode", "error_body"]


class ApiError(Exception):
    """A 4xx answer: ``status``, the offending ``field`` (a JSON path, or None) and a message."""

    def __init__(self, status: int, message: str, field: str | None = None, kind: str = "invalid_request") -> None:
        super().__init__(message)
        self.status = status
        self.field = field
        self.kind = kind


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
    token_ids: list[TokenId] | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    #: pod -> load, for RouterConfig.load_weight
    load: dict[str, float] | None = None


_PATH = re.compile(r" - at `\$(.*)`$")


def decode(body: bytes, kind: type) -> object:
    """Decode and validate a JSON body; ApiError(400) naming the field otherwise."""
    if not body:
        raise ApiError(400, "the request body is empty: send a JSON object", None)
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
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the request body is not valid JSON: {exc}", None) from None


def _raise(msg: str, field: str | None):
    raise ApiError(400, msg, field or None)


def error_body(status: int, message: str, field: str | None = None, kind: str = "invalid_request") -> bytes:
    return msgspec.json.encode({"error": {"type": kind, "field": field, "message": message, "status": status}})
