"""The durable event plane on NATS JetStream: the bridge (engines' ZeroMQ -> one stream), the
router's JetStream event source, and the ``"nats"`` publisher for engines that use ours.

Needs nats-py (``pip install 'kvevents[nats]'``); nothing here is imported until asked for.
"""

from __future__ import annotations

from importlib import import_module

__all__ = ["Bridge", "EngineSpec", "JetStreamSource", "NatsEventPublisher", "PlaneSender", "StreamSpec"]

_WHERE = {"Bridge": "bridge", "EngineSpec": "bridge", "JetStreamSource": "source", "NatsEventPublisher": "publisher",
          "PlaneSender": "sender", "StreamSpec": "wire"}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(name)
