"""What :func:`kvevents_vllm.register` does in a vLLM process: each part registers itself."""

from __future__ import annotations


def register_all() -> None:
    from kvevents_vllm.publisher import register_publisher
    from kvevents_vllm.spec import register_spec

    register_spec()
    register_publisher()
