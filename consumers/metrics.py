"""The router's metric specs (its observer: :mod:`consumers.telemetry`).

Plain data, registered in the ``kvevents.metrics`` entry-point group; the catalogue
(:mod:`kvevents.telemetry.catalog`) assembles every component's list.
"""

from __future__ import annotations

from kvevents.telemetry.catalog import COUNTER, GAUGE, HISTOGRAM, LATENCY_BUCKETS, UPDOWN, MetricSpec
from kvevents.telemetry.catalog import spec as _m

__all__ = ["METRICS"]

METRICS: tuple[MetricSpec, ...] = (
    # ---- router (consumers.telemetry: KVRouter) -----------------------------------------------
    _m("kvevents.router.entries", UPDOWN, "{entry}",
       "Index entries (key, endpoint) held per tier (sampled by a scan, at most once per refresh interval).",
       ("tier",), "router", "index masks, set bits per tier lane"),
    _m("kvevents.router.index.size", UPDOWN, "By",
       "Approximate index memory per tier (the index's bytes split by each tier's share of entries).",
       ("tier",), "router", "memory estimate (sys.getsizeof of masks and learned maps)"),
    _m("kvevents.router.batches", COUNTER, "{batch}", "Batches applied to the index.",
       (), "router", "stats.batches"),
    _m("kvevents.router.events", COUNTER, "{event}", "Events applied to the index.",
       (), "router", "stats.events"),
    _m("kvevents.router.lookups", COUNTER, "{lookup}", "score() calls (pick() included).",
       (), "router", "stats.lookups"),
    _m("kvevents.router.prompt.tokens", COUNTER, "{token}", "Prompt tokens of the scored requests.",
       (), "router", "stats.prompt_tokens"),
    _m("kvevents.router.matched.tokens", COUNTER, "{token}",
       "Prefix tokens the best-scoring pod holds, per tier it would serve them from.",
       ("tier",), "router", "stats.matched_tokens (the pod pick() would choose)"),
    _m("kvevents.router.offload.unjoined", COUNTER, "{block}",
       "Offload events that arrived before the GPU event they join, by outcome: "
       "held, resolved, expired, dropped, cancelled.",
       ("outcome",), "router", "stats.pending_*"),
    _m("kvevents.router.offload.chunk.inferences", COUNTER, "{estimate}",
       "Offload chunk extents the join inferred from the stream, by outcome: inferred (a first estimate "
       "for a pod's tier), rederived (made smaller by contradicting evidence).",
       ("outcome",), "router", "stats.chunk_inferred / stats.chunk_rederived"),
    _m("kvevents.router.offload.chunk.extent", UPDOWN, "{block}",
       "Canonical blocks per offloaded chunk the join inferred, per pod and tier (tiers configured by "
       "offload_chunk_blocks are not listed).",
       ("pod", "tier"), "router", "chunk_extents()"),
    _m("kvevents.router.offload.pending", UPDOWN, "{block}", "Offload events waiting for their GPU event.",
       (), "router", "len(pending)"),
    _m("kvevents.router.index.operations", COUNTER, "{call}",
       "Calls made through the index role, by operation (store, remove, clear, match, lineage, snapshot, "
       "restore); the C ingest and the C score walk write and read the native table directly and are counted "
       "by the router's block counters and lookups instead. Only with RouterConfig.index_metrics.",
       ("op",), "router", "InstrumentedIndex.calls"),
    _m("kvevents.router.evicted", COUNTER, "{entry}", "Index entries evicted by the entry budget.",
       (), "router", "index.evicted_entries"),
    _m("kvevents.router.removals", COUNTER, "{block}",
       "BlockRemoved hashes by outcome: removed, unknown (never learned).",
       ("outcome",), "router", "stats.blocks_removed / stats.remove_unknown"),
    _m("kvevents.router.errors", COUNTER, "{event}", "Bad input the router counted and skipped, by kind.",
       ("kind",), "router", "stats.errors[kind]"),
    _m("kvevents.router.gaps", COUNTER, "{gap}",
       "Unrecoverable gaps (pod marked UNRELIABLE: routed, its score discounted until it re-learns).",
       (), "router", "stats.gaps"),
    _m("kvevents.router.uncertain_pods", UPDOWN, "{pod}",
       "Pods UNRELIABLE now: routed with their score discounted after events were lost for good.",
       (), "router", "counters()['uncertain_pods']"),
    _m("kvevents.router.relearned", COUNTER, "{pod}",
       "UNRELIABLE discounts ended: relearn_batches batches applied since the gap.",
       (), "router", "stats.relearned"),
    _m("kvevents.router.resets", COUNTER, "{reset}", "Pod resets (publisher restarts).",
       (), "router", "stats.resets"),
)
