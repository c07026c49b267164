"""kvevents inside vLLM: the plugin package (a top floor; the only package that imports vLLM).

vLLM calls :func:`register` in every one of its processes through the ``vllm.general_plugins``
entry point. It registers, lazily (nothing heavy is imported until vLLM asks for it):

- the offloading spec ``KVEventsOffloadingSpec`` (``kvevents_vllm.spec``) with vLLM's
  ``OffloadingSpecFactory``: our tiered manager and transfer worker behind vLLM's types;
- the KV-events publisher ``"kvevents"`` (``kvevents_vllm.publisher``) with vLLM's
  ``EventPublisherFactory``: our never-blocking ZeroMQ publisher and replay server.

Every difference between vLLM releases lives in this package, never in ``manager/``.
"""

from __future__ import annotations

SPEC_NAME = "KVEventsOffloadingSpec"
PUBLISHER_NAME = "kvevents"


def register() -> None:
    """vLLM's ``general_plugins`` hook: make our spec and publisher known to vLLM's factories."""
    from kvevents_vllm import plugin

    plugin.register_all()
