"""The manager's and the simulated engine's metric specs (their observers: :mod:`manager.telemetry`).

Plain data, registered in the ``kvevents.metrics`` entry-point group; the catalogue
(:mod:`kvevents.telemetry.catalog`) assembles every component's list.
"""

from __future__ import annotations

from kvevents.telemetry.catalog import COUNTER, GAUGE, HISTOGRAM, LATENCY_BUCKETS, UPDOWN, MetricSpec
from kvevents.telemetry.catalog import spec as _m

__all__ = ["METRICS"]

_MT = ("engine", "tier")
_MTD = ("engine", "tier", "direction")

METRICS: tuple[MetricSpec, ...] = (
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
)
