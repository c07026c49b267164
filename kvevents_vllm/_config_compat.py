"""Make ``"publisher": "kvevents"`` a value vLLM's own config accepts.

Why: vLLM 0.32 and 0.33 type ``KVEventsConfig.publisher`` as ``Literal["null", "zmq"]`` on a
pydantic dataclass, and ``--kv-events-config`` is validated against that model while the
command line is read (``TypeAdapter(KVEventsConfig).validate_json``). A name registered with
``EventPublisherFactory.register_publisher`` is therefore rejected before the factory is ever
asked. vLLM loads general plugins (us) before it builds its argument parser, so the plugin can
widen the literal in time.

How (the least we can touch, through pydantic's documented API): the literal of that one field
gets our name appended -- on the dataclass field's type and the class annotation, which vLLM's
argument builder and pydantic read -- and ``pydantic.dataclasses.rebuild_dataclass(cls,
force=True)`` regenerates the class's validator in place. Nothing else of vLLM changes: the
other names stay valid, an unknown name is still rejected by the same validator, and the field
keeps its default.

What it does not reach: a pydantic model that inlined ``KVEventsConfig``'s old schema before
this ran (vLLM's ``VllmConfig``) still rejects ``"kvevents"`` in a plain *dict*; it accepts a
``KVEventsConfig`` instance, which is what the command line produces. From Python, build a
``KVEventsConfig(..., publisher="kvevents")`` after ``kvevents_vllm.register()`` and pass that.

Idempotent: a second call (vLLM loads plugins in each of its processes) changes nothing.
"""

from __future__ import annotations

import typing

from kvevents.errors import ConfigError


def accept_publisher_name(config_cls: type, name: str) -> bool:
    """Add ``name`` to ``config_cls.publisher``'s literal; False when it was there already."""
    from pydantic.dataclasses import rebuild_dataclass

    field = getattr(config_cls, "__dataclass_fields__", {}).get("publisher")
    current = field.type if field is not None else None
    if typing.get_origin(current) is not typing.Literal:
        raise ConfigError(
            f"kvevents_vllm: {config_cls.__module__}.{config_cls.__qualname__}.publisher is "
            f"{current!r}, not a Literal; this vLLM is not one the plugin supports")
    names = typing.get_args(current)
    if name in names:
        return False
    widened = typing.Literal[names + (name,)]  # type: ignore[valid-type]
    field.type = widened
    config_cls.__annotations__["publisher"] = widened
    rebuild_dataclass(config_cls, force=True)
    return True
