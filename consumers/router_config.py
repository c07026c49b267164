"""Configuration and counters of :class:`consumers.KVRouter`."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from kvevents.errors import ConfigError

from .keys import DEFAULT_BLOCK_SIZE

__all__ = ["MAX_TIERS", "PodRefused", "RouterConfig", "RouterStats", "RouterInputError"]

#: the most tiers a router holds: the stages the C score walk takes (consumers._fastpath's
#: MAX_STAGES, tests/test_score_native.py checks they agree), for every index backend alike
MAX_TIERS = 16


class RouterInputError(ConfigError):
    """An event the router cannot use (wrong token count, unknown tier beyond the limit, ...).

    ``KVRouter.apply`` counts these in ``stats.errors`` and goes on; with ``strict=True`` it
    raises them.
    """


class PodRefused(RouterInputError):
    """A pod the router will not hold: one past ``max_pods``, or a claim a pin forbids."""


@dataclass(slots=True)
class RouterConfig:
    #: canonical block size of the router's keys (tokens per key)
    block_size: int = DEFAULT_BLOCK_SIZE
    #: model of pods whose topic does not name one (topic ``kv@<pod>@<model>`` wins)
    model: str | None = None
    #: publisher identity -> pod name (else the pod comes from the topic, else the identity). A
    #: pinned publisher's deliveries go to its pod whatever their topic says, and no other
    #: publisher may claim a pinned pod through its topic (refused, counted)
    publisher_pods: dict[str, str] = field(default_factory=dict)
    #: refuse deliveries from publishers not in publisher_pods (counted in stats.pods_refused)
    pinned_only: bool = False
    #: distinct pods held at most: a delivery or apply() naming one more is refused and counted
    #: (the topic names the pod, so a publisher cycling topics would otherwise create pods without
    #: bound — each one slows every score())
    max_pods: int = 1024
    #: weight per tier; the match walks tiers from the heaviest to the lightest
    tier_weights: dict[str, float] = field(
        default_factory=lambda: {"GPU": 1.0, "CPU": 0.8, "STORAGE": 0.5}
    )
    default_tier_weight: float = 0.25
    #: medium -> GPU blocks per offloaded chunk; unset media infer it from consecutive
    #: hashes of one offload event (1 until inferred)
    offload_chunk_blocks: dict[str, int] = field(default_factory=dict)
    #: entry budget: (key, endpoint, tier) entries the index holds at most (LRU eviction)
    max_entries: int = 1 << 22
    #: engine-hash -> key mappings held at most (default: max_entries)
    max_learned: int | None = None
    #: offload events waiting for their GPU event: how many, and for how many batches
    pending_capacity: int = 4096
    pending_max_batches: int = 256
    #: score factor by pod state; 0 excludes the pod from score()/pick(). STALE is a publisher
    #: with no evidence of life (no connection, no answer): excluded. UNRELIABLE (events lost for
    #: good) is a discount, not an exclusion: the pod's factor starts here and rises back to 1 as
    #: it re-learns (``relearn_batches``); it multiplies the pod's health state's factor
    state_factors: dict[str, float] = field(
        default_factory=lambda: {"SYNCED": 1.0, "RECOVERING": 0.5, "STALE": 0.0, "UNRELIABLE": 0.5}
    )
    #: after an unrecoverable gap, the pod's batches over which its UNRELIABLE discount decays
    #: back to none (in eight steps); then the pod is certain again (``stats.relearned``).
    #: 0: the discount stays until the pod's index is cleared (a reset, AllBlocksCleared)
    relearn_batches: int = 512
    #: total -= load_weight * load[pod] when score()/pick() get a load map
    load_weight: float = 0.0
    #: kv-cache groups whose events are indexed (others are counted and skipped)
    groups: frozenset = frozenset({None, 0})
    #: distinct tiers (media) the index can hold, at most MAX_TIERS (the C score walk's stages)
    max_tiers: int = 4
    #: how many keys an offloaded chunk may span at most when it is inferred
    max_chunk_keys: int = 1024
    #: health() is polled every this many deliveries in run()
    health_every: int = 64
    #: index backend (consumers.index.INDEX_BACKENDS): "native" (the C mask table), "python"
    #: (the masks in a dict), "reference" (dicts of holders), or "auto" (native where the C
    #: extension is in use, else python)
    index: str = "auto"
    #: count the calls made through the Index role (consumers.instrumented.InstrumentedIndex in
    #: front of the backend; exported by consumers.telemetry.observe_router); the C ingest and
    #: score stay (they use the native backend's table directly, uncounted here)
    index_metrics: bool = False
    #: a span for each clear, evicting store and snapshot restore of the index
    #: (consumers.instrumented.TracedIndex; made while consumers.telemetry.instrument_router runs)
    index_tracing: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.relearn_batches, int) or isinstance(self.relearn_batches, bool) \
                or self.relearn_batches < 0:
            raise ConfigError(f"RouterConfig.relearn_batches must be an int >= 0, got {self.relearn_batches!r}")
        for name in ("block_size", "max_entries", "pending_capacity", "pending_max_batches", "max_tiers",
                     "max_chunk_keys", "health_every", "max_pods"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ConfigError(f"RouterConfig.{name} must be a positive int, got {v!r}")
        if self.max_tiers > MAX_TIERS:
            raise ConfigError(f"RouterConfig.max_tiers must be <= {MAX_TIERS} (the score walk's stages), "
                              f"got {self.max_tiers!r}")
        if not isinstance(self.index, str) or not self.index:
            raise ConfigError(f"RouterConfig.index must be a backend name, got {self.index!r}")
        if self.max_learned is not None and self.max_learned <= 0:
            raise ConfigError(f"RouterConfig.max_learned must be > 0, got {self.max_learned!r}")
        for medium, n in self.offload_chunk_blocks.items():
            if not isinstance(n, int) or n <= 0:
                raise ConfigError(f"RouterConfig.offload_chunk_blocks[{medium!r}] must be a positive int, got {n!r}")
        for tier, w in self.tier_weights.items():
            if not isinstance(w, (int, float)) or w < 0:
                raise ConfigError(f"RouterConfig.tier_weights[{tier!r}] must be >= 0, got {w!r}")
        for state, f in self.state_factors.items():
            if not isinstance(f, (int, float)) or f < 0:
                raise ConfigError(f"RouterConfig.state_factors[{state!r}] must be >= 0, got {f!r}")


@dataclass(slots=True)
class RouterStats:
    """Plain-int counters; nothing is dropped without one of these moving."""

    batches: int = 0
    events: int = 0
    blocks_stored: int = 0  #: GPU-style (token-carrying) blocks indexed
    offload_blocks: int = 0  #: offload chunk hashes joined (directly or from pending)
    blocks_removed: int = 0
    remove_unknown: int = 0  #: BlockRemoved naming a hash the router never learned
    clears: int = 0  #: AllBlocksCleared events
    resets: int = 0  #: reset_pod calls (publisher restarts)
    gaps: int = 0  #: unrecoverable gaps (pod marked unreliable: its score discounted until it re-learns)
    relearned: int = 0  #: pods whose UNRELIABLE discount ended: relearn_batches batches applied since the gap
    purges: int = 0  #: remove_pod calls
    orphan_blocks: int = 0  #: GPU blocks whose parent hash was unknown (cannot be keyed)
    ignored_group_events: int = 0  #: events of kv-cache groups not indexed
    pending_held: int = 0
    pending_resolved: int = 0
    pending_expired: int = 0
    pending_dropped: int = 0  #: pushed out by pending_capacity
    pending_cancelled: int = 0  #: removed or cleared before they could be joined
    chunk_inferred: int = 0  #: offload chunk extents inferred per (endpoint, tier), from no evidence to some
    chunk_rederived: int = 0  #: inferred extents re-derived smaller because new evidence contradicted them
    pods_refused: int = 0  #: deliveries/batches refused: one pod past max_pods, or a pod claim a pin forbids
    lookups: int = 0  #: score() calls (pick() included)
    prompt_tokens: int = 0  #: tokens of the scored prompts
    #: per tier, the prefix tokens of the pod pick() would choose, summed over score() calls
    matched_tokens: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)  #: bad input, by kind

    def as_dict(self) -> dict[str, object]:
        return {f.name: (dict(v) if isinstance(v := getattr(self, f.name), dict) else v) for f in fields(self)}
