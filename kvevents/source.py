"""The event-source role: where a consumer's deliveries come from.

An :class:`EventSource` hands out :class:`~kvevents.Delivery` objects — BATCH in sequence order
per publisher, RESET when a publisher restarted, GAP for what is lost for good — and a health
snapshot per publisher. Consumers (``KVRouter.run``, the contract kit, ``kvevents tail``, the
telemetry consumer) take any source and never know which transport fed it:

* ``tcp://`` / ``ipc://`` / ``inproc://`` (or ``"zmq"``): the ZeroMQ
  :class:`~kvevents.transport.zmq.Subscriber`, gaps healed by replay;
* ``file:<path>`` (or ``"recording"``): a recording's delivery stream,
  :class:`~kvevents.recordstream.RecordingSource`, healed as a live subscriber would have;
* ``nats://``: the JetStream source, registered by its own module.

:func:`open_source` picks the implementation from the URL's scheme (or a registered name) in
:data:`SOURCES`, a :class:`~kvevents.registry.LazyRegistry`: nothing is imported until used.
A new source subclasses :class:`EventSource`, implements ``from_urls`` and the three methods,
and registers with ``SOURCES.register("scheme", "pkg.module", "ClassName")``.
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import Any

from .delivery import Delivery, PublisherHealth
from .errors import ConfigError
from .registry import LazyRegistry

__all__ = ["EventSource", "SOURCES", "open_source", "source_scheme"]


class EventSource(abc.ABC):
    """A stream of deliveries. ``poll`` never blocks longer than asked; iteration blocks."""

    @classmethod
    @abc.abstractmethod
    def from_urls(cls, urls: list[str], **options: Any) -> "EventSource":
        """A source reading ``urls`` (all of this source's scheme), configured by ``options``."""

    @abc.abstractmethod
    def poll(self, timeout_ms: int = 100) -> list[Delivery]:
        """Wait up to ``timeout_ms`` for input; return every delivery it produced (maybe none)."""

    @abc.abstractmethod
    def health(self) -> dict[str, PublisherHealth]:
        """A snapshot per publisher (copies: safe to keep)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release sockets, files, connections; idempotent."""

    @property
    def ended(self) -> bool:
        """True once a finite source (a recording) has delivered everything; a live one never ends."""
        return False

    def __iter__(self) -> Iterator[Delivery]:
        """Every delivery, blocking, until the source ends or is closed."""
        while not self.ended:
            try:
                got = self.poll(100)
            except RuntimeError:  # closed meanwhile
                return
            yield from got

    def __enter__(self) -> "EventSource":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: event sources by URL scheme or name
SOURCES = LazyRegistry("event source", {
    "zmq": ("kvevents.transport.zmq.subscriber", "Subscriber"),
    "tcp": ("kvevents.transport.zmq.subscriber", "Subscriber"),
    "ipc": ("kvevents.transport.zmq.subscriber", "Subscriber"),
    "inproc": ("kvevents.transport.zmq.subscriber", "Subscriber"),
    "file": ("kvevents.recordstream", "RecordingSource"),
    "recording": ("kvevents.recordstream", "RecordingSource"),
    "nats": ("kvevents.transport.nats.source", "JetStreamSource"),
}, base=EventSource, known_label="known schemes and names")


def source_scheme(url: str) -> str:
    """``"tcp://h:1"`` -> ``"tcp"``, ``"file:x.kvrec"`` -> ``"file"``; ConfigError when there is none."""
    if not isinstance(url, str) or not url:
        raise ConfigError(f"an event source URL must be a non-empty string, got {url!r}")
    scheme, sep, _ = url.partition(":")
    if not sep or not scheme or not scheme.replace("+", "").replace("-", "").isalnum():
        raise ConfigError(f"event source {url!r} names no scheme (tcp://, ipc://, file:, nats://...); {SOURCES.known()}")
    return scheme.lower()


def open_source(*urls: str, kind: str | None = None, **options: Any) -> EventSource:
    """An :class:`EventSource` reading ``urls``, picked by their scheme (or by ``kind``, a name).

    ``options`` go to the implementation (for ZeroMQ: ``Subscriber``'s keyword arguments).
    Raises ConfigError for no URL, mixed schemes, or an unknown scheme or name.
    """
    if not urls:
        raise ConfigError("open_source needs at least one URL")
    if kind is None:
        schemes = {source_scheme(u) for u in urls}
        if len(schemes) != 1:
            raise ConfigError(f"one event source reads one kind of URL; got schemes {sorted(schemes)} in {list(urls)}")
        kind = schemes.pop()
    return SOURCES.get(kind).from_urls(list(urls), **options)
