"""The topic format ``kv@<pod>@<model>``: one place that writes and reads it.

A publisher's topic names the pod (the engine instance) and the model it serves; consumers
attribute what they receive to that pod and model. The model part may itself hold ``@``
(``kv@pod-a@org/model@rev``). Any other topic is allowed on the wire; it names no pod.
"""

from __future__ import annotations

__all__ = ["PREFIX", "make_topic", "parse_topic", "topic_pod"]

PREFIX = "kv@"


def make_topic(pod: str, model: str) -> str:
    """``("pod-a", "m")`` -> ``"kv@pod-a@m"``. ValueError for an empty pod or a pod holding ``@``."""
    if not pod or "@" in pod:
        raise ValueError(f"a pod name is non-empty and holds no '@', got {pod!r}")
    return f"{PREFIX}{pod}@{model}"


def parse_topic(topic: str) -> tuple[str | None, str | None]:
    """``"kv@<pod>@<model>"`` -> ``(pod, model)``; ``(None, None)`` for any other topic.

    ``"kv@pod@"`` names a pod and no model: ``("pod", None)``.
    """
    if topic.startswith(PREFIX):
        pod, sep, model = topic[len(PREFIX):].partition("@")
        if sep and pod:
            return pod, model or None
    return None, None


def topic_pod(topic: str) -> str | None:
    """``"kv@pod-a@model"`` -> ``"pod-a"``; None for a topic without that shape."""
    return parse_topic(topic)[0]
