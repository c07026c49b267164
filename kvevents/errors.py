"""Typed errors. Every error the library raises on bad input is a KVEventsError."""

from __future__ import annotations


class KVEventsError(Exception):
    """Base of every error kvevents raises on purpose."""


class DecodeError(KVEventsError, ValueError):
    """A payload is not a KVEventBatch in any encoding we know; the message says why and where."""


class ConfigError(KVEventsError, ValueError):
    """A configuration value is wrong (unknown publisher name, bad size, ...)."""


class EndpointError(KVEventsError, ValueError):
    """An endpoint string is malformed or cannot be bound / connected."""
