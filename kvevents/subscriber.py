"""Moved: :mod:`kvevents.transport.zmq.subscriber` (this path keeps old imports working)."""

from .transport.zmq.frames import END_SEQ
from .transport.zmq.subscriber import PublisherSpec, Subscriber

__all__ = ["END_SEQ", "PublisherSpec", "Subscriber"]
