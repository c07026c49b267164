"""The generic mechanism: observable instruments fed by many components, and tracers.

One observable instrument exists per (meter, catalogue name); every observed component adds
a *source* to it: a callable returning ``(value, attributes)`` pairs read from the
component's plain-int counters. :class:`Observation` handles remove their sources again.
Only the OpenTelemetry API is used: without a configured SDK every instrument is a no-op.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackOptions, Meter
from opentelemetry.metrics import Observation as _Point

from . import catalog

__all__ = ["INSTRUMENTATION_NAME", "Observation", "add_source", "get_meter", "get_tracer", "histogram"]

INSTRUMENTATION_NAME = "kvevents"
_log = logging.getLogger(__name__)

Source = Callable[[], Iterable[tuple[float, dict[str, Any]]]]


def get_meter(meter: Meter | None = None) -> Meter:
    return meter if meter is not None else metrics.get_meter(INSTRUMENTATION_NAME)


def get_tracer(tracer_provider: trace.TracerProvider | None = None) -> trace.Tracer:
    return trace.get_tracer(INSTRUMENTATION_NAME, tracer_provider=tracer_provider)


class _Multiplexed:
    """One observable instrument; its callback yields every registered source's points."""

    __slots__ = ("spec", "sources", "lock", "errors", "__weakref__")

    def __init__(self, meter: Meter, spec: catalog.MetricSpec) -> None:
        self.spec = spec
        self.sources: dict[int, Source] = {}
        self.lock = threading.Lock()
        self.errors = 0  #: sources that raised while being read (logged, skipped)
        create = {
            catalog.COUNTER: meter.create_observable_counter,
            catalog.UPDOWN: meter.create_observable_up_down_counter,
            catalog.GAUGE: meter.create_observable_gauge,
        }[spec.kind]
        create(spec.name, callbacks=[self._callback], unit=spec.unit, description=spec.description)

    def _callback(self, options: CallbackOptions) -> Iterable[_Point]:
        with self.lock:
            sources = list(self.sources.values())
        out = []
        for source in sources:
            try:
                out.extend(_Point(value, attrs) for value, attrs in source())
            except Exception:  # a broken source must not break the whole collection
                self.errors += 1
                _log.exception("telemetry source for %s failed", self.spec.name)
        return out


_lock = threading.Lock()
_observables: dict[tuple[int, str], _Multiplexed] = {}
_histograms: dict[tuple[int, str], Any] = {}
_meters: dict[int, Meter] = {}  # keeps the meters whose id() keys the tables alive
_next_id = 0


def attribute_cache(extra: dict[str, Any]) -> Callable[..., dict]:
    """``a(publisher="x")`` -> the same attribute dict each time (``extra`` merged in): the
    SDK is handed one dict per series instead of a fresh one per observation."""
    cache: dict[tuple, dict] = {}

    def a(**kv: Any) -> dict:
        key = tuple(kv.items())
        d = cache.get(key)
        if d is None:
            d = cache[key] = {**kv, **extra}
        return d

    return a


def _key(meter: Meter, name: str) -> tuple[int, str]:
    _meters[id(meter)] = meter
    return id(meter), name


def add_source(meter: Meter, name: str, source: Source) -> tuple[_Multiplexed, int]:
    """Register ``source`` with the observable instrument ``name`` (a catalogue name) of ``meter``."""
    global _next_id
    spec = catalog.get(name)
    if spec.kind == catalog.HISTOGRAM:
        raise ValueError(f"{name} is a histogram: record it through histogram(), not a source")
    with _lock:
        key = _key(meter, name)
        inst = _observables.get(key)
        if inst is None:
            inst = _observables[key] = _Multiplexed(meter, spec)
        _next_id += 1
        sid = _next_id
    with inst.lock:
        inst.sources[sid] = source
    return inst, sid


def histogram(meter: Meter, name: str):
    """The histogram ``name`` (a catalogue name) of ``meter``, created once."""
    spec = catalog.get(name)
    if spec.kind != catalog.HISTOGRAM:
        raise ValueError(f"{name} is a {spec.kind}, not a histogram")
    with _lock:
        key = _key(meter, name)
        h = _histograms.get(key)
        if h is None:
            kw = {"explicit_bucket_boundaries_advisory": list(spec.buckets)} if spec.buckets else {}
            h = _histograms[key] = meter.create_histogram(spec.name, unit=spec.unit, description=spec.description,
                                                          **kw)
        return h


class Observation:
    """What ``observe_*`` returns: the sources it registered; ``close()`` removes them (and
    whatever hooks the observer installed), after which the component is no longer read."""

    def __init__(self, component: object) -> None:
        self.component = component
        self._sources: list[tuple[_Multiplexed, int]] = []
        self._on_close: list[Callable[[], None]] = []
        self.closed = False

    def add(self, meter: Meter, name: str, source: Source) -> None:
        self._sources.append(add_source(meter, name, source))

    def on_close(self, fn: Callable[[], None]) -> None:
        self._on_close.append(fn)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for inst, sid in self._sources:
            with inst.lock:
                inst.sources.pop(sid, None)
        self._sources.clear()
        for fn in reversed(self._on_close):
            fn()
        self._on_close.clear()

    def __enter__(self) -> "Observation":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
