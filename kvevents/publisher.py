"""Moved: :mod:`kvevents.transport.zmq.publisher` (this path keeps old imports working)."""

from .transport.zmq.frames import END_SEQ
from .transport.zmq.publisher import OVERFLOW_POLICIES, ZmqEventPublisher

__all__ = ["END_SEQ", "OVERFLOW_POLICIES", "ZmqEventPublisher"]
