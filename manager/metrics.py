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
       _MT, "manager", "primary.stores_completed; secondary tier .stores (or its successful store jobs)"),
    _m("kvevents.manager.loads", COUNTER, "{block}",
       "Blocks loaded out of the tier (primary: to the GPU; secondary: promoted to the primary).",
       _MT, "manager", "connector.blocks_loaded (else primary.loads); secondary tier .loads"),
    _m("kvevents.manager.evictions", COUNTER, "{block}", "Blocks evicted from the tier.",
       _MT, "manager", "primary.evictions; secondary tier .evictions"),
    _m("kvevents.manager.bytes", COUNTER, "By",
       "Bytes moved by finished transfer jobs (direction store: into the tier, load: out of it).",
       _MTD, "manager", "transfer-job hook (blocks x bytes per block)"),
    _m("kvevents.manager.blocks.used", UPDOWN, "{block}", "Blocks the tier holds.",
       _MT, "manager", "primary num_blocks - free_blocks; secondary tier index size"),
    _m("kvevents.manager.blocks.capacity", UPDOWN, "{block}", "Blocks the tier can hold (absent if unbounded).",
       _MT, "manager", "primary num_blocks; secondary tier capacity_blocks"),
    _m("kvevents.manager.promotions", COUNTER, "{block}",
       "Blocks promoted from a secondary tier into the primary (successful promotion jobs).",
       _MT, "manager", "tier job hook"),
    _m("kvevents.manager.cascades", COUNTER, "{block}",
       "Blocks cascaded from the primary into a secondary tier (successful store jobs).",
       _MT, "manager", "tier job hook"),
    _m("kvevents.manager.stores.skipped", COUNTER, "{block}",
       "Blocks of store jobs a secondary tier's backpressure policy skipped (never pinned, written or announced).",
       _MT, "manager", "secondary tier .blocks_skipped"),
    _m("kvevents.manager.stores.not_admitted", COUNTER, "{block}",
       "Blocks offered for store into the primary tier and left out by its admission filter (offered fewer "
       "than store_threshold times so far).",
       _MT, "manager", "primary.stores_not_admitted"),
    _m("kvevents.manager.store.backlog", UPDOWN, "{block}",
       "Blocks of store jobs submitted to a secondary tier and not finished yet (what backpressure bounds).",
       _MT, "manager", "secondary tier store_backlog()"),
    _m("kvevents.manager.lookups.pending", COUNTER, "{lookup}",
       "Secondary-tier lookups answered pending (an asynchronous lookup in flight: asked again next step).",
       _MT, "manager", "secondary tier .lookups_pending"),
    _m("kvevents.manager.tier.faults", COUNTER, "{fault}",
       "A secondary tier's faults by kind: store_error (a block not written), load_error (a load job failed), "
       "corrupt (a damaged file or pack unit dropped), scan_error (an entry the start-up scan could not read or "
       "delete), punch_error (an evicted pack unit or pack whose space could not be given back).",
       ("engine", "tier", "kind"), "manager",
       "secondary tier stats()['store_errors'|'load_errors'|'corrupt_files'|'scan_errors'|'punch_errors']"),
    _m("kvevents.manager.job.failures", COUNTER, "{job}", "Transfer jobs that failed.",
       _MTD, "manager", "transfer-job hook (TransferResult/JobResult success=False)"),
    _m("kvevents.manager.job.duration", HISTOGRAM, "s",
       "Transfer-job latency, submit to result collected (GPU<->CPU jobs: tier = primary).",
       _MTD, "manager", "transfer-job hook", buckets=LATENCY_BUCKETS),
    _m("kvevents.manager.steps", COUNTER, "{step}", "Scheduler steps (on_schedule_end calls).",
       ("engine",), "manager", "connector.steps"),
    _m("kvevents.manager.requests.ignored", COUNTER, "{request}",
       "Request finishes ignored: reason repeat (finished twice) or unknown (never announced).",
       ("engine", "reason"), "manager",
       "stats()['finish_repeats'|'finish_unknown'] of the connector plus the tiering manager"),
    # ---- simulated engine (manager.engine_sim.SimEngine.stats()) ------------------------------
    _m("kvevents.engine.tokens", COUNTER, "{token}",
       "Prompt tokens by how they were served: computed, gpu_hit, offload_hit.",
       ("engine", "kind"), "engine", "stats()['computed_tokens'|'gpu_hit_tokens'|'offload_hit_tokens']"),
    _m("kvevents.engine.requests", COUNTER, "{request}", "Requests finished by the engine.",
       ("engine",), "engine", "stats()['requests_finished']"),
)
