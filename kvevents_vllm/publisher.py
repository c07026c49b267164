"""The KV-events publisher ``"kvevents"`` inside vLLM: our never-blocking ZeroMQ publisher.

``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "kvevents",
"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'`` makes vLLM's scheduler publish
through :class:`KVEventsPublisher` instead of vLLM's ``ZmqEventPublisher``. The wire is the same
(PUB frames ``[topic, seq, payload]``, the replay ROUTER protocol); what changes is what the
engine pays and risks: ``publish()`` never blocks the scheduler (vLLM's waits on a full queue),
the replay ring is bounded in bytes as well as batches, replays are served by their own thread
and rate-limited per client, and every batch that misses the live path is counted. vLLM exports
no publisher counters, so a watch thread logs a warning naming each loss counter that grew
(every ``WATCH_INTERVAL`` seconds, only when one did) and the totals are logged at shutdown.

vLLM's ``EventPublisherFactory`` calls the constructor with ``data_parallel_rank`` and every
field of vLLM's ``KVEventsConfig`` but ``publisher`` / ``enable_kv_cache_events``. Each maps to
our :class:`kvevents.transport.zmq.publisher.ZmqEventPublisher` argument of the same name and
meaning (``endpoint``, ``replay_endpoint``, ``buffer_steps``, ``hwm``, ``max_queue_size``,
``topic``); our own bounds keep their defaults. A field this module does not know (a later vLLM
added one) fails the engine's start-up with a :class:`~kvevents.errors.ConfigError` naming it,
as does an endpoint we cannot use (e.g. ``tcp://*:0``: give a port).

Payloads are vLLM's batches encoded by msgspec exactly as vLLM's own publisher encodes them
(every field vLLM has, ``extra_keys`` / ``group_idx`` / ``kv_cache_spec_kind`` included), on the
scheduler's thread (a few microseconds a step), then handed to our publisher's queue.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import msgspec
from vllm.config.kv_events import KVEventsConfig as VllmKVEventsConfig
from vllm.distributed import kv_events as vllm_kv_events

from kvevents.errors import ConfigError
from kvevents.transport.zmq.publisher import ZmqEventPublisher

from ._config_compat import accept_publisher_name

# under "vllm." so the lines go where vLLM's own log lines go (vLLM configures that logger)
logger = logging.getLogger("vllm.kvevents_vllm.publisher")

#: the name in ``"publisher": ...`` (``kvevents_vllm.PUBLISHER_NAME``, kept here too: the package
#: must not be imported back by the module it loads lazily)
PUBLISHER_NAME = "kvevents"
#: vLLM KVEventsConfig fields the factory passes, each handed to our publisher under its name
MAPPED_FIELDS = ("endpoint", "replay_endpoint", "buffer_steps", "hwm", "max_queue_size", "topic")
#: counters whose growth is logged (a warning naming each) by the watch thread; not
#: ``ring_evicted``: a full replay ring drops its oldest batch at every step, by design
LOSS_COUNTERS = ("overflow", "overflow_lost", "encode_errors", "send_errors", "replay_aborted",
                 "replay_refused")
#: seconds between two looks of the watch thread at those counters
WATCH_INTERVAL = 10.0

_registered = False


class KVEventsPublisher(vllm_kv_events.EventPublisher):
    """vLLM's ``EventPublisher`` interface over our :class:`ZmqEventPublisher`."""

    def __init__(self, data_parallel_rank: int = 0, **config: Any) -> None:
        unknown = sorted(set(config) - set(MAPPED_FIELDS))
        if unknown:
            raise ConfigError(
                f"kvevents publisher: unsupported kv-events-config key(s) {unknown} "
                f"(this kvevents_vllm maps {list(MAPPED_FIELDS)})")
        super().__init__(data_parallel_rank)
        self._pub = ZmqEventPublisher(data_parallel_rank=data_parallel_rank, **config)
        self._encoder = msgspec.msgpack.Encoder()
        self._config = VllmKVEventsConfig(
            enable_kv_cache_events=True, publisher=PUBLISHER_NAME, endpoint=self._pub.endpoint,
            replay_endpoint=self._pub.replay_endpoint,
            **{k: config[k] for k in ("buffer_steps", "hwm", "max_queue_size", "topic") if k in config})
        logger.info("kvevents publisher: events on %s, replay on %s (data parallel rank %d)",
                    self._pub.endpoint, self._pub.replay_endpoint, data_parallel_rank)
        # vLLM exports nothing of a publisher's: what missed the live path is logged as it grows
        self._seen = {k: 0 for k in LOSS_COUNTERS}
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._watch_loop, name="kvevents-pub-watch", daemon=True)
        self._watch.start()

    def publish(self, events: Any) -> None:
        """Queue one of vLLM's ``KVEventBatch``es; never blocks (the overflow policy decides)."""
        if events.data_parallel_rank is None:
            events.data_parallel_rank = self._data_parallel_rank
        self._pub.publish_raw(self._encoder.encode(events))

    def check_counters(self) -> dict[str, int]:
        """Log one warning naming every loss counter that grew since the last look; the growth."""
        stats = self._pub.stats()
        grown = {k: stats[k] - self._seen[k] for k in LOSS_COUNTERS if stats[k] > self._seen[k]}
        if grown:
            self._seen.update({k: stats[k] for k in grown})
            logger.warning("kvevents publisher: %s (totals: %s)",
                           ", ".join(f"{k} +{v}" for k, v in grown.items()),
                           ", ".join(f"{k} {stats[k]}" for k in LOSS_COUNTERS))
        return grown

    def _watch_loop(self) -> None:
        while not self._stop.wait(WATCH_INTERVAL):
            self.check_counters()

    def shutdown(self) -> None:
        self._stop.set()
        report = self._pub.shutdown()
        stats = self._pub.stats()
        lost = stats["overflow_lost"] + stats["encode_errors"] + stats["send_errors"] + report.unsent
        log = logger.warning if lost else logger.info
        log("kvevents publisher closed: %d batches published, %d unsent at shutdown, overflow %d "
            "(lost %d), send errors %d, replays served %d", stats["batches_published"],
            report.unsent, stats["overflow"], stats["overflow_lost"], stats["send_errors"],
            stats["replays_completed"])

    def get_publisher_config(self) -> VllmKVEventsConfig:
        """The resolved configuration (endpoints offset by the data-parallel rank)."""
        return self._config

    def stats(self) -> dict[str, int]:
        """Our publisher's counters (see :class:`kvevents.publisher_base.PublisherStats`)."""
        return self._pub.stats()


def register_publisher() -> None:
    """Make ``"publisher": "kvevents"`` valid in vLLM's config and known to its factory.

    Safe to call more than once in a process; fails with one line on a vLLM release the plugin
    was not tested against, or when another plugin already took the name.
    """
    global _registered
    from .versions import check_vllm_version

    check_vllm_version()
    accept_publisher_name(VllmKVEventsConfig, PUBLISHER_NAME)
    if _registered:
        return
    try:
        vllm_kv_events.EventPublisherFactory.register_publisher(PUBLISHER_NAME, KVEventsPublisher)
    except KeyError:
        raise ConfigError(f"kvevents_vllm: vLLM already has a KV-events publisher named "
                          f"{PUBLISHER_NAME!r} (another plugin registered it)") from None
    _registered = True
