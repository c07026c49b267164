"""Moved: :mod:`kvevents.transport.zmq.endpoints` (this path keeps old imports working)."""

from .transport.zmq.endpoints import SCHEMES, offset_endpoint, should_bind, validate_endpoint

__all__ = ["SCHEMES", "offset_endpoint", "should_bind", "validate_endpoint"]
