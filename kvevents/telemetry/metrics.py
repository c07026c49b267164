"""The publisher's and subscriber's metric specs (their observers: :mod:`kvevents.telemetry.observe`,
the lag histogram in :mod:`kvevents.telemetry.messaging`).

Plain data, registered in the ``kvevents.metrics`` entry-point group; the catalogue
(:mod:`kvevents.telemetry.catalog`) assembles every component's list.
"""

from __future__ import annotations

from .catalog import COUNTER, GAUGE, HISTOGRAM, LATENCY_BUCKETS, UPDOWN, MetricSpec
from .catalog import spec as _m

__all__ = ["METRICS"]

_P = ("publisher",)
_S = ("publisher",)

METRICS: tuple[MetricSpec, ...] = (
    # ---- publisher (kvevents.ZmqEventPublisher.stats()) ---------------------------------------
    _m("kvevents.publisher.batches", COUNTER, "{batch}", "Batches sent on the live PUB socket.",
       _P, "publisher", "stats()['batches_published']", "kvevents_publisher_batches_total"),
    _m("kvevents.publisher.events", COUNTER, "{event}", "Events in the batches sent live.",
       _P, "publisher", "stats()['events_published']", "kvevents_publisher_events_total"),
    _m("kvevents.publisher.bytes", COUNTER, "By", "Payload bytes sent live.",
       _P, "publisher", "stats()['bytes_published']", "kvevents_publisher_bytes_total"),
    _m("kvevents.publisher.queue.depth", UPDOWN, "{batch}", "Batches queued by publish() and not yet sent.",
       _P, "publisher", "stats()['queue_depth']", "kvevents_publisher_queue_depth"),
    _m("kvevents.publisher.overflow", COUNTER, "{batch}",
       "Batches taken off the live path because the queue was full (kept for replay unless counted lost).",
       _P, "publisher", "stats()['overflow']", "kvevents_publisher_overflow_total"),
    _m("kvevents.publisher.overflow.lost", COUNTER, "{batch}",
       "Overflowed batches also lost to replay (policy drop_oldest, or the ring-only backlog full).",
       _P, "publisher", "stats()['overflow_lost']", "kvevents_publisher_overflow_lost_total"),
    _m("kvevents.publisher.live.dropped", COUNTER, "{batch}",
       "Batches kept off the live socket by the drop_live fault injector (still replayable).",
       _P, "publisher", "stats()['live_dropped']", "kvevents_publisher_live_dropped_total"),
    _m("kvevents.publisher.errors", COUNTER, "{error}",
       "Publisher errors by kind: encode, send, replay_malformed, replay_aborted, replay_stalled.",
       _P + ("kind",), "publisher",
       "stats()['encode_errors'|'send_errors'|'replay_malformed'|'replay_aborted'|'replay_stalled']",
       "kvevents_publisher_errors_total"),
    _m("kvevents.publisher.ring.batches", UPDOWN, "{batch}", "Batches held in the replay ring.",
       _P, "publisher", "stats()['ring_batches']", "kvevents_publisher_ring_batches"),
    _m("kvevents.publisher.ring.size", UPDOWN, "By", "Payload bytes held in the replay ring.",
       _P, "publisher", "stats()['ring_bytes']", "kvevents_publisher_ring_size_bytes"),
    _m("kvevents.publisher.ring.evicted", COUNTER, "{batch}",
       "Batches pushed out of the replay ring by its count/bytes bounds.",
       _P, "publisher", "stats()['ring_evicted']", "kvevents_publisher_ring_evicted_total"),
    _m("kvevents.publisher.replay.requests", COUNTER, "{request}", "Replay requests received.",
       _P, "publisher", "stats()['replay_requests']", "kvevents_publisher_replay_requests_total"),
    _m("kvevents.publisher.replay.served", COUNTER, "{batch}", "Batches sent in answer to replay requests.",
       _P, "publisher", "stats()['replay_batches_served']", "kvevents_publisher_replay_served_total"),
    _m("kvevents.publisher.replay.rate_limited", COUNTER, "{request}",
       "Replay requests that waited for their client's token bucket.",
       _P, "publisher", "stats()['replay_rate_limited']", "kvevents_publisher_replay_rate_limited_total"),
    _m("kvevents.publisher.replay.refused", COUNTER, "{request}",
       "Replay requests refused: the client's earlier answer sits unread, or too many clients.",
       _P, "publisher", "stats()['replay_refused']", "kvevents_publisher_replay_refused_total"),
    _m("kvevents.publisher.replay.superseded", COUNTER, "{request}",
       "Replay requests replaced by a newer one from the same client.",
       _P, "publisher", "stats()['replay_superseded']", "kvevents_publisher_replay_superseded_total"),
    _m("kvevents.publisher.replay.completed", COUNTER, "{replay}", "Replays answered to the end marker.",
       _P, "publisher", "stats()['replays_completed']", "kvevents_publisher_replay_completed_total"),
    _m("kvevents.publisher.replay.active", UPDOWN, "{replay}", "Replays in progress.",
       _P, "publisher", "stats()['replay_active']", "kvevents_publisher_replay_active"),
    _m("kvevents.publisher.replay.outstanding", UPDOWN, "By",
       "Replay bytes queued toward clients and not yet taken by their connections (bounded).",
       _P, "publisher", "stats()['replay_outstanding_bytes']", "kvevents_publisher_replay_outstanding_bytes"),
    _m("kvevents.publisher.pub.hwm", GAUGE, "{message}",
       "The PUB socket's per-subscriber queue bound (SNDHWM, from hwm and hwm_bytes / mean_batch_bytes).",
       _P, "publisher", "stats()['pub_hwm']", "kvevents_publisher_pub_hwm"),
    # ---- subscriber (kvevents.Subscriber.health(), per publisher) ------------------------------
    _m("kvevents.subscriber.received", COUNTER, "{batch}", "Live frames received.",
       _S, "subscriber", "health()[p].received", "kvevents_subscriber_received_total"),
    _m("kvevents.subscriber.gaps", COUNTER, "{gap}", "Sequence gaps detected.",
       _S, "subscriber", "health()[p].gaps", "kvevents_subscriber_gaps_total"),
    _m("kvevents.subscriber.recovered", COUNTER, "{batch}", "Batches delivered from replay to fill gaps.",
       _S, "subscriber", "health()[p].recovered", "kvevents_subscriber_recovered_total"),
    _m("kvevents.subscriber.unrecoverable", COUNTER, "{batch}", "Batches lost for good (GAP deliveries).",
       _S, "subscriber", "health()[p].unrecoverable", "kvevents_subscriber_unrecoverable_total"),
    _m("kvevents.subscriber.resets", COUNTER, "{reset}",
       "Publisher restarts seen (sequence went backwards, or the last batch's payload changed under its seq).",
       _S, "subscriber", "health()[p].resets", "kvevents_subscriber_resets_total"),
    _m("kvevents.subscriber.malformed", COUNTER, "{frame}",
       "Malformed input by kind: frames, seq, payload, replay (publisher \"(bind)\": shared bind-mode socket).",
       _S + ("kind",), "subscriber", "health()[p].malformed[kind]", "kvevents_subscriber_malformed_total"),
    _m("kvevents.subscriber.probes", COUNTER, "{request}",
       "Replay probes sent to a quiet publisher (finds batches lost at the end of a burst).",
       _S, "subscriber", "health()[p].probes", "kvevents_subscriber_probes_total"),
    _m("kvevents.subscriber.join_retries", COUNTER, "{request}",
       "Late join: initial replay requests sent again because no answer came in time.",
       _S, "subscriber", "health()[p].join_retries", "kvevents_subscriber_join_retries_total"),
    _m("kvevents.subscriber.publishers.refused", COUNTER, "{frame}",
       "Bind mode: frames under a new topic refused at max_publishers (no silent publisher to expire).",
       (), "subscriber", "stats()['publishers_refused']", "kvevents_subscriber_publishers_refused_total"),
    _m("kvevents.subscriber.publishers.expired", COUNTER, "{publisher}",
       "Bind mode: publishers silent past stale_after forgotten to make room for a new topic.",
       (), "subscriber", "stats()['publishers_expired']", "kvevents_subscriber_publishers_expired_total"),
    _m("kvevents.subscriber.lag", HISTOGRAM, "s",
       "Receive time minus the batch's ts, of the delivered batches with seq % N == 0 (N = lag_sample_every, "
       "default 32; replayed included).",
       _S, "subscriber", "Subscriber.hooks.on_deliveries (per poll)", "kvevents_subscriber_lag_seconds", LATENCY_BUCKETS),
    _m("kvevents.subscriber.health", GAUGE, "1",
       "1 for the publisher's current state (CONNECTING, SYNCED, RECOVERING, STALE), 0 for the others.",
       _S + ("state",), "subscriber", "health()[p].state", "kvevents_subscriber_health"),
)
