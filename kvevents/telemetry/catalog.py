"""The metric catalogue: every metric the project defines, in one place.

Each :class:`MetricSpec` names the OpenTelemetry instrument (dotted name, kind, unit,
attributes), the component counter it reads, and the name it takes on a Prometheus scrape
through ``opentelemetry-exporter-prometheus`` (dots become underscores; a unit ``s`` adds
``_seconds`` and ``By`` adds ``_bytes`` unless the name already ends so; a counter gets
``_total``; curly-brace units such as ``{batch}`` and ``1`` add nothing). The Prometheus names
are written out here, not derived at run time, so dashboards can grep them; a test checks
them against what the exporter really emits.

The adapters that create the instruments (:mod:`kvevents.telemetry.observe`,
``manager.telemetry``, ``consumers.telemetry``) take name, kind, unit and description from
here, so the table in the README (:func:`render_markdown_table`) is what the code exports.
This module is plain data: it imports nothing from OpenTelemetry.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "COUNTER",
    "GAUGE",
    "HISTOGRAM",
    "UPDOWN",
    "CATALOG",
    "MetricSpec",
    "by_component",
    "get",
    "prometheus_names",
    "render_markdown_table",
]

COUNTER = "counter"  #: monotonic sum (observable counter, or a counter for wrapper-counted values)
UPDOWN = "up-down"  #: a sum that goes both ways (queue depth, blocks used)
GAUGE = "gauge"  #: a sampled value (health state, index size)
HISTOGRAM = "histogram"  #: a distribution recorded per batch or per job

#: bucket bounds (seconds) for lag and job latency: 100 µs .. 30 s
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str  #: OpenTelemetry instrument name (dotted)
    kind: str  #: COUNTER, UPDOWN, GAUGE or HISTOGRAM
    unit: str  #: UCUM unit as OpenTelemetry takes it ("By", "s", "{batch}", "1")
    description: str
    attributes: tuple[str, ...]  #: attribute keys every point carries
    component: str  #: publisher, subscriber, manager, engine, router
    source: str  #: what it reads (the component counter, or the hook that records it)
    prometheus: str  #: the series name on a Prometheus scrape (histograms: the base of _bucket/_sum/_count)
    buckets: tuple[float, ...] | None = None  #: explicit histogram bucket bounds


def _m(name, kind, unit, description, attributes, component, source, prometheus, buckets=None) -> MetricSpec:
    return MetricSpec(name, kind, unit, description, tuple(attributes), component, source, prometheus, buckets)


_P = ("publisher",)
_S = ("publisher",)
_MT = ("engine", "tier")
_MTD = ("engine", "tier", "direction")

CATALOG: tuple[MetricSpec, ...] = (
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
       "Publisher errors by kind: encode, send, replay_malformed, replay_aborted.",
       _P + ("kind",), "publisher", "stats()['encode_errors'|'send_errors'|'replay_malformed'|'replay_aborted']",
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
    # ---- subscriber (kvevents.Subscriber.health(), per publisher) ------------------------------
    _m("kvevents.subscriber.received", COUNTER, "{batch}", "Live frames received.",
       _S, "subscriber", "health()[p].received", "kvevents_subscriber_received_total"),
    _m("kvevents.subscriber.gaps", COUNTER, "{gap}", "Sequence gaps detected.",
       _S, "subscriber", "health()[p].gaps", "kvevents_subscriber_gaps_total"),
    _m("kvevents.subscriber.recovered", COUNTER, "{batch}", "Batches delivered from replay to fill gaps.",
       _S, "subscriber", "health()[p].recovered", "kvevents_subscriber_recovered_total"),
    _m("kvevents.subscriber.unrecoverable", COUNTER, "{batch}", "Batches lost for good (GAP deliveries).",
       _S, "subscriber", "health()[p].unrecoverable", "kvevents_subscriber_unrecoverable_total"),
    _m("kvevents.subscriber.resets", COUNTER, "{reset}", "Publisher restarts seen (sequence went backwards).",
       _S, "subscriber", "health()[p].resets", "kvevents_subscriber_resets_total"),
    _m("kvevents.subscriber.malformed", COUNTER, "{frame}",
       "Malformed input by kind: frames, seq, payload, replay (publisher \"(bind)\": shared bind-mode socket).",
       _S + ("kind",), "subscriber", "health()[p].malformed[kind]", "kvevents_subscriber_malformed_total"),
    _m("kvevents.subscriber.lag", HISTOGRAM, "s",
       "Receive time minus the batch's ts, of the delivered batches with seq % N == 0 (N = lag_sample_every, "
       "default 32; replayed included).",
       _S, "subscriber", "Subscriber.hooks.on_deliveries (per poll)", "kvevents_subscriber_lag_seconds", LATENCY_BUCKETS),
    _m("kvevents.subscriber.health", GAUGE, "1",
       "1 for the publisher's current state (CONNECTING, SYNCED, RECOVERING, STALE), 0 for the others.",
       _S + ("state",), "subscriber", "health()[p].state", "kvevents_subscriber_health"),
    # ---- manager (manager.telemetry: CPUOffloadingManager, tiers, transfer jobs) ---------------
    _m("kvevents.manager.stores", COUNTER, "{block}", "Blocks stored into the tier.",
       _MT, "manager", "primary.stores_completed; secondary tier .stores (or its successful store jobs)",
       "kvevents_manager_stores_total"),
    _m("kvevents.manager.loads", COUNTER, "{block}",
       "Blocks loaded out of the tier (primary: to the GPU; secondary: promoted to the primary).",
       _MT, "manager", "connector.blocks_loaded (else primary.loads); secondary tier .loads",
       "kvevents_manager_loads_total"),
    _m("kvevents.manager.evictions", COUNTER, "{block}", "Blocks evicted from the tier.",
       _MT, "manager", "primary.evictions; secondary tier .evictions", "kvevents_manager_evictions_total"),
    _m("kvevents.manager.bytes", COUNTER, "By",
       "Bytes moved by finished transfer jobs (direction store: into the tier, load: out of it).",
       _MTD, "manager", "transfer-job hook (blocks x bytes per block)", "kvevents_manager_bytes_total"),
    _m("kvevents.manager.blocks.used", UPDOWN, "{block}", "Blocks the tier holds.",
       _MT, "manager", "primary num_blocks - free_blocks; secondary tier index size",
       "kvevents_manager_blocks_used"),
    _m("kvevents.manager.blocks.capacity", UPDOWN, "{block}", "Blocks the tier can hold (absent if unbounded).",
       _MT, "manager", "primary num_blocks; secondary tier capacity_blocks", "kvevents_manager_blocks_capacity"),
    _m("kvevents.manager.promotions", COUNTER, "{block}",
       "Blocks promoted from a secondary tier into the primary (successful promotion jobs).",
       _MT, "manager", "tier job hook", "kvevents_manager_promotions_total"),
    _m("kvevents.manager.cascades", COUNTER, "{block}",
       "Blocks cascaded from the primary into a secondary tier (successful store jobs).",
       _MT, "manager", "tier job hook", "kvevents_manager_cascades_total"),
    _m("kvevents.manager.stores.skipped", COUNTER, "{block}",
       "Blocks of store jobs a secondary tier's backpressure policy skipped (never pinned, written or announced).",
       _MT, "manager", "secondary tier .blocks_skipped", "kvevents_manager_stores_skipped_total"),
    _m("kvevents.manager.store.backlog", UPDOWN, "{block}",
       "Blocks of store jobs submitted to a secondary tier and not finished yet (what backpressure bounds).",
       _MT, "manager", "secondary tier store_backlog()", "kvevents_manager_store_backlog"),
    _m("kvevents.manager.lookups.pending", COUNTER, "{lookup}",
       "Secondary-tier lookups answered pending (an asynchronous lookup in flight: asked again next step).",
       _MT, "manager", "secondary tier .lookups_pending", "kvevents_manager_lookups_pending_total"),
    _m("kvevents.manager.job.failures", COUNTER, "{job}", "Transfer jobs that failed.",
       _MTD, "manager", "transfer-job hook (TransferResult/JobResult success=False)",
       "kvevents_manager_job_failures_total"),
    _m("kvevents.manager.job.duration", HISTOGRAM, "s",
       "Transfer-job latency, submit to result collected (GPU<->CPU jobs: tier = primary).",
       _MTD, "manager", "transfer-job hook", "kvevents_manager_job_duration_seconds", LATENCY_BUCKETS),
    _m("kvevents.manager.steps", COUNTER, "{step}", "Scheduler steps (on_schedule_end calls).",
       ("engine",), "manager", "connector.steps", "kvevents_manager_steps_total"),
    _m("kvevents.manager.requests.ignored", COUNTER, "{request}",
       "Request finishes ignored: reason repeat (finished twice) or unknown (never announced).",
       ("engine", "reason"), "manager",
       "stats()['finish_repeats'|'finish_unknown'] of the connector plus the tiering manager",
       "kvevents_manager_requests_ignored_total"),
    # ---- simulated engine (manager.engine_sim.SimEngine.stats()) ------------------------------
    _m("kvevents.engine.tokens", COUNTER, "{token}",
       "Prompt tokens by how they were served: computed, gpu_hit, offload_hit.",
       ("engine", "kind"), "engine", "stats()['computed_tokens'|'gpu_hit_tokens'|'offload_hit_tokens']",
       "kvevents_engine_tokens_total"),
    _m("kvevents.engine.requests", COUNTER, "{request}", "Requests finished by the engine.",
       ("engine",), "engine", "stats()['requests_finished']", "kvevents_engine_requests_total"),
    # ---- router (consumers.telemetry: KVRouter) -----------------------------------------------
    _m("kvevents.router.entries", UPDOWN, "{entry}",
       "Index entries (key, endpoint) held per tier (sampled by a scan, at most once per refresh interval).",
       ("tier",), "router", "index masks, set bits per tier lane", "kvevents_router_entries"),
    _m("kvevents.router.index.size", UPDOWN, "By",
       "Approximate index memory per tier (the index's bytes split by each tier's share of entries).",
       ("tier",), "router", "memory estimate (sys.getsizeof of masks and learned maps)",
       "kvevents_router_index_size_bytes"),
    _m("kvevents.router.batches", COUNTER, "{batch}", "Batches applied to the index.",
       (), "router", "stats.batches", "kvevents_router_batches_total"),
    _m("kvevents.router.events", COUNTER, "{event}", "Events applied to the index.",
       (), "router", "stats.events", "kvevents_router_events_total"),
    _m("kvevents.router.lookups", COUNTER, "{lookup}", "score() calls (pick() included).",
       (), "router", "stats.lookups", "kvevents_router_lookups_total"),
    _m("kvevents.router.prompt.tokens", COUNTER, "{token}", "Prompt tokens of the scored requests.",
       (), "router", "stats.prompt_tokens", "kvevents_router_prompt_tokens_total"),
    _m("kvevents.router.matched.tokens", COUNTER, "{token}",
       "Prefix tokens the best-scoring pod holds, per tier it would serve them from.",
       ("tier",), "router", "stats.matched_tokens (the pod pick() would choose)", "kvevents_router_matched_tokens_total"),
    _m("kvevents.router.offload.unjoined", COUNTER, "{block}",
       "Offload events that arrived before the GPU event they join, by outcome: "
       "held, resolved, expired, dropped, cancelled.",
       ("outcome",), "router", "stats.pending_*", "kvevents_router_offload_unjoined_total"),
    _m("kvevents.router.offload.pending", UPDOWN, "{block}", "Offload events waiting for their GPU event.",
       (), "router", "len(pending)", "kvevents_router_offload_pending"),
    _m("kvevents.router.evicted", COUNTER, "{entry}", "Index entries evicted by the entry budget.",
       (), "router", "index.evicted_entries", "kvevents_router_evicted_total"),
    _m("kvevents.router.removals", COUNTER, "{block}",
       "BlockRemoved hashes by outcome: removed, unknown (never learned).",
       ("outcome",), "router", "stats.blocks_removed / stats.remove_unknown", "kvevents_router_removals_total"),
    _m("kvevents.router.errors", COUNTER, "{event}", "Bad input the router counted and skipped, by kind.",
       ("kind",), "router", "stats.errors[kind]", "kvevents_router_errors_total"),
    _m("kvevents.router.gaps", COUNTER, "{gap}", "Unrecoverable gaps (pod marked unreliable).",
       (), "router", "stats.gaps", "kvevents_router_gaps_total"),
    _m("kvevents.router.resets", COUNTER, "{reset}", "Pod resets (publisher restarts).",
       (), "router", "stats.resets", "kvevents_router_resets_total"),
)

_BY_NAME = {m.name: m for m in CATALOG}
assert len(_BY_NAME) == len(CATALOG), "duplicate metric name in the catalogue"


def get(name: str) -> MetricSpec:
    """The spec of ``name``; KeyError naming the unknown metric otherwise."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"metric {name!r} is not in kvevents.telemetry.catalog.CATALOG") from None


def by_component(component: str) -> list[MetricSpec]:
    return [m for m in CATALOG if m.component == component]


def prometheus_names(*, series: bool = False) -> set[str]:
    """Every Prometheus name; ``series=True`` adds the ``_bucket``/``_sum``/``_count`` series of histograms."""
    out = set()
    for m in CATALOG:
        out.add(m.prometheus)
        if series and m.kind == HISTOGRAM:
            out.update(m.prometheus + s for s in ("_bucket", "_sum", "_count"))
    return out


def render_markdown_table(specs: tuple[MetricSpec, ...] | list[MetricSpec] = CATALOG) -> str:
    """The README's metric table (markdown), one row per metric, in catalogue order."""
    rows = ["| Prometheus name | OpenTelemetry name | kind | unit | attributes | what it counts | reads |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for m in specs:
        attrs = ", ".join(f"`{a}`" for a in m.attributes) or "-"
        desc = m.description.replace("|", "\\|")
        src = m.source.replace("|", "\\|")
        rows.append(f"| `{m.prometheus}` | `{m.name}` | {m.kind} | `{m.unit}` | {attrs} | {desc} | {m.component}: {src} |")
    return "\n".join(rows) + "\n"
