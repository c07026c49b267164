"""Settings read into msgspec Structs, and a refusal as one line naming the key.

A settings type is a tree of ``msgspec.Struct`` classes (``forbid_unknown_fields=True``,
``kw_only=True``) whose per-key rules live in the types: ``Annotated[int, Meta(ge=1)]``,
``Literal["a", "b"]``, ``list[Pod]``. :func:`decode` converts parsed TOML, YAML or JSON into it;
when msgspec refuses the data, the :class:`ConfigError` raised says where with msgspec's own path
(``$.pods[0].name``), written the caller's way (``pods[0].name``, or
``kv_connector_extra_config['kvevents']['cpu_blocks']``), what was expected and what was there::

    api.port must be int <= 65535, got 70000
    pods[0].dp: unknown key (known: data_parallel_size, endpoint, http, model, name, ...)
    pods[1].name is required
    api.event_loop must be one of auto, uvloop, asyncio, got 'trio'

A rule the types cannot state is checked in the Struct's ``__post_init__``, which raises
:class:`KeyCheck` naming the key within its own table; msgspec adds the table's path.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgspec
import msgspec.inspect as mi

from .errors import ConfigError

__all__ = ["MAPPING_WORDS", "TABLE_WORDS", "UNKNOWN", "KeyCheck", "decode", "describe", "dotted", "subscripted"]

T = TypeVar("T")

#: a path inside the settings: a key, a list index, or None for a mapping's value (msgspec's
#: ``[...]``: it does not say which key)
Part = str | int | None
Namer = Callable[[Sequence[Part]], str]


class KeyCheck(ConfigError):
    """A rule a settings Struct checks itself (``__post_init__``): ``key`` (in its own table) and
    what is wrong with its value."""

    def __init__(self, key: str, what: str, got: object) -> None:
        super().__init__(f"{key} {what}, got {got!r}")
        self.key = key
        self.what = what
        self.got = got


def dotted(parts: Sequence[Part], root: str = "the config") -> str:
    """``pods[0].name``; ``root`` for the top level."""
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else "[...]" if p is None else f".{p}" if out else p
    return out or root


def subscripted(root: str) -> Namer:
    """A namer writing ``root['kvevents']['secondary_tiers'][0]`` (a Python mapping's keys)."""
    def name(parts: Sequence[Part]) -> str:
        return root + "".join("[...]" if p is None else f"[{p!r}]" for p in parts)
    return name


#: msgspec's names for the kinds of value, as a config file's reader calls them
TABLE_WORDS = {"object": "a table", "array": "an array"}
MAPPING_WORDS = {"object": "a mapping", "array": "a list"}


#: an unknown key's line: ``path`` names the key, ``where`` its table, ``key`` is the key itself
UNKNOWN = "{path}: unknown key (known: {known})"


def decode(data: Any, typ: type[T], *, name: Namer = dotted, words: dict[str, str] = TABLE_WORDS,
           unknown: str = UNKNOWN) -> T:
    """``data`` (parsed TOML/YAML/JSON) as a ``typ``; ConfigError in one line naming the key."""
    try:
        return msgspec.convert(data, typ)
    except msgspec.ValidationError as exc:
        raise ConfigError(describe(exc, data, typ, name, words, unknown).replace("\n", "\\n")) from None


_AT = re.compile(r"^(.*?)(?: - at `\$([^`]*)`)?$", re.S)
_PART = re.compile(r"\.(\w+)|\[(\d+)\]|\[\.\.\.\]")
_UNKNOWN = re.compile(r"^Object contains unknown field `([^`]*)`$")
_MISSING = re.compile(r"^Object missing required field `([^`]*)`$")
_ENUM = re.compile(r"^Invalid enum value ")
_EXPECTED = re.compile(r"^Expected `([^`]*)`(.*?)(?:, got `([^`]*)`)?$", re.S)


def describe(exc: msgspec.ValidationError, data: Any, typ: type, name: Namer = dotted,
             words: dict[str, str] = TABLE_WORDS, unknown: str = UNKNOWN) -> str:
    """msgspec's refusal of ``data`` as one line: the key (from msgspec's path), what it must
    be, and the value found there."""
    msg, at = _AT.match(str(exc)).groups()  # type: ignore[union-attr]
    parts: list[Part] = [m.group(1) or (int(m.group(2)) if m.group(2) else None) for m in _PART.finditer(at or "")]
    where = name(parts)
    cause = exc.__cause__
    if isinstance(cause, KeyCheck):
        return f"{name([*parts, cause.key])} {cause.what}, got {cause.got!r}"
    if m := _UNKNOWN.match(msg):
        node = _type_at(mi.type_info(typ), parts)
        known = sorted(f.name for f in node.fields) if isinstance(node, mi.StructType) else []
        return unknown.format(path=name([*parts, m.group(1)]), where=where, key=m.group(1), known=", ".join(known))
    if m := _MISSING.match(msg):
        return f"{name([*parts, m.group(1)])} is required"
    found, value = _value_at(data, parts)
    if _ENUM.match(msg):
        node = _type_at(mi.type_info(typ), parts)
        if isinstance(node, mi.LiteralType):
            return f"{where} must be one of {', '.join(map(str, node.values))}, got {value!r}"
    if m := _EXPECTED.match(msg):
        want, rule, got = m.groups()
        kinds = [words.get(k, k) for k in want.split(" | ") if k != "null"]
        got_text = repr(value) if found else words.get(got or "", got or "?")
        return f"{where} must be {' or '.join(kinds)}{rule}, got {got_text}"
    return f"{where}: {msg}"


_END = object()


def _type_at(t: mi.Type | None, parts: Sequence[Part]) -> mi.Type | None:
    """The type at ``parts`` inside ``t`` (unions: their table, list, mapping or literal member)."""
    for p in [*parts, _END]:
        if isinstance(t, mi.UnionType):
            t = next((u for u in t.types if isinstance(u, (mi.StructType, mi.ListType, mi.DictType, mi.LiteralType))),
                     None)
        if p is _END:
            return t
        if isinstance(t, mi.StructType) and isinstance(p, str):
            t = next((f.type for f in t.fields if f.name == p), None)
        elif isinstance(t, mi.ListType) and isinstance(p, int):
            t = t.item_type
        elif isinstance(t, mi.DictType) and p is None:
            t = t.value_type
        else:
            return None
    return t


def _value_at(data: Any, parts: Sequence[Part]) -> tuple[bool, Any]:
    for p in parts:
        try:
            data = data[p]  # type: ignore[index]
        except (KeyError, IndexError, TypeError):
            return False, None
    return True, data
