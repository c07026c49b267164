"""The request-head grammar of the service's lean HTTP front (:mod:`kvservice.fasthttp`), and its
``Date`` header.

Every request head is checked against what aiohttp's own parser (llhttp,
strict) accepts, before anything is answered: CR and LF only as CRLF, no control character but
HTAB, header names that are tokens, exactly one ``Host`` (HTTP/1.1), one decimal
``Content-Length``, not both it and ``Transfer-Encoding``. A head that breaks one of these rules
is answered 400 by the front, naming the rule (counted under route ``malformed``; aiohttp refuses the
same bytes: ``tests/test_service_http_grammar.py`` feeds both the same corpus). A head this
reader cannot vouch for (another HTTP version, a chunked or upgraded request, ``Expect``...)
goes to aiohttp unread, and the connection stays with aiohttp's parser ("opaque").
"""

from __future__ import annotations

import re
import time
from email.utils import formatdate

__all__ = ["BROKEN", "HEAD", "DateHeader", "broken", "misfit"]

#: bytes a head may hold: HTAB, CR, LF (as CRLF, checked apart), visible ASCII, SP, obs-text
_TEXT = bytes([9, 10, 13, *range(0x20, 0x7F), *range(0x80, 0x100)])
BROKEN = "a bare CR or LF, or a control character, in the request head"
_TOKEN = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+"
#: the common shape of a head (without its blank line), every rule of the grammar in one match:
#: method, origin-form target, version, and the header lines (each CRLF-led: a token name, ':',
#: a value of HTAB, visible ASCII, SP and obs-text)
HEAD = re.compile(rb"([A-Z]+) (/[\x21-\x7e]*) (HTTP/1\.[01])((?:\r\n" + _TOKEN + rb":[\t\x20-\x7e\x80-\xff]*)*)")
_NAME = re.compile(_TOKEN)


def misfit(head: bytes) -> str | None:
    """Why a head off :data:`HEAD`'s shape is refused (aiohttp's parser refuses it too), or None:
    aiohttp's parser is to judge it (another request-line form)."""
    if broken(head):
        return BROKEN
    for line in head.split(b"\r\n")[1:]:
        name, sep, _value = line.partition(b":")
        if not sep or not _NAME.fullmatch(name):
            return "a malformed header line (no ':', or whitespace or a separator in the name, or a folded line)"
    return None


def broken(part) -> bool:
    """Part of a head, from a line's start or a pending CR: a control character but HTAB, or a
    CR/LF not in a CRLF (a CR at the end may still get its LF)."""
    crlf = part.count(b"\r\n")
    return bool(part.translate(None, _TEXT)) or part.count(b"\n") != crlf or part.count(b"\r") - crlf > part.endswith(b"\r")


class DateHeader:
    """The ``Date`` header, formatted once a second."""

    __slots__ = ("sec", "value")

    def __init__(self) -> None:
        self.sec = -1
        self.value = b""

    def get(self) -> bytes:
        now = int(time.time())
        if now != self.sec:
            self.sec = now
            self.value = formatdate(now, usegmt=True).encode()
        return self.value
