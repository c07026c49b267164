"""kvservice: the router as a network service (``kvevents router`` / ``python -m kvservice``).

The top floor: it composes ``kvevents`` (subscriber) and ``consumers`` (KVRouter) behind an HTTP
API and an OpenAI-compatible proxy; nothing below imports it. It holds no routing logic of its
own: attribution of batches to pods, threads and HTTP only.
"""

from .config import ApiConfig, PodConfig, ServiceConfig, SubscriberConfig, load_config

__all__ = ["ApiConfig", "PodConfig", "ServiceConfig", "SubscriberConfig", "load_config"]
