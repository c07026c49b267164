"""The ZeroMQ transport, wire-compatible with vLLM's.

* :mod:`.frames`: the frame shapes (live, replay request/answer, end marker);
* :mod:`.endpoints`: endpoint strings (validation, per-rank offset, bind or connect);
* :mod:`.publisher`: :class:`ZmqEventPublisher` (PUB, never blocks the caller);
* :mod:`.replay`: :class:`ReplayServer` (the publisher's ROUTER, its own thread);
* :mod:`.subscriber`: :class:`Subscriber` (SUB + DEALER per publisher, gaps healed by replay;
  an :class:`kvevents.source.EventSource`).
"""

from .endpoints import offset_endpoint, should_bind, validate_endpoint
from .frames import END_SEQ
from .publisher import ZmqEventPublisher
from .replay import ReplayServer
from .subscriber import PublisherSpec, Subscriber

__all__ = ["END_SEQ", "PublisherSpec", "ReplayServer", "Subscriber", "ZmqEventPublisher", "offset_endpoint",
           "should_bind", "validate_endpoint"]
