"""The router's endpoints: pods, their data-parallel ranks, slots (bit lanes), health,
model attribution and the tiers table.

One :class:`Endpoint` per (pod, rank) engine owns one slot of the index; :class:`Endpoints`
creates, finds, re-states and removes them and keeps what the scorer needs to walk the index
for a model (a plan cached until an endpoint, a state, a tier or the slot layout changes).
"""

from __future__ import annotations

from kvevents.topic import parse_topic

from .index import SlotLayout
from .keys import model_seed
from .learned import LearnedMap
from .router_config import PodRefused, RouterConfig, RouterInputError, RouterStats

__all__ = ["BUILTIN_TIERS", "Endpoint", "Endpoints", "pod_from_topic"]

BUILTIN_TIERS = ("GPU", "CPU", "STORAGE")


#: ``kv@<pod>@<model>`` -> ``(pod, model)``: the topic format lives in kvevents.topic
pod_from_topic = parse_topic


class Endpoint:
    """One engine: a pod's data-parallel rank. Owns one slot (bit lane) in the index."""

    __slots__ = ("pod", "rank", "slot", "model", "lmap", "odd", "seed", "block_size", "chunk_keys",
                 "odd_chunks", "token_tiers", "unreliable", "tier_bs", "chunk_joined", "chunk_seen")

    def __init__(self, pod: str, rank: int, slot: int, model: str, lmap: dict, odd: list) -> None:
        self.pod = pod
        self.rank = rank
        self.slot = slot
        self.model = model
        self.lmap = lmap  #: the model's engine-hash -> key map (shared by every endpoint of the model)
        self.odd = odd  #: [True] once the model's map holds a non-int (partial block) value
        self.seed = model_seed(model)  #: chain seed without LoRA
        self.block_size = 0  #: engine block size, learned from token-carrying events
        self.chunk_keys: dict[int, int] = {}  #: tier -> keys per offloaded chunk (inferred)
        self.odd_chunks: dict[int, dict[object, int]] = {}  #: tier -> chunk hash -> keys, if not the default
        self.token_tiers: set[int] = set()  #: tiers whose stores carried tokens
        self.unreliable = False
        #: token-carrying tiers whose block size differs from ``block_size`` (the GPU's): vLLM
        #: 0.33's self-describing offload stores carry their chunk's tokens and block size
        self.tier_bs: dict[int, int] = {}
        #: tier -> chunk hashes joined while the inferred extent (> 1 key) may still shrink
        #: (bounded): a re-derived, smaller extent takes their extra keys back out of the index
        self.chunk_joined: dict[int, dict[object, None]] = {}
        self.chunk_seen: dict[int, int] = {}  #: tier -> offload joins seen (depth evidence is sampled)

    def __repr__(self) -> str:
        return f"Endpoint({self.pod!r}, rank={self.rank}, slot={self.slot}, model={self.model!r})"


class Endpoints:
    """Pods, ranks, slots, health and the tiers table of one router.

    ``touch`` is bumped whenever something a cached ingest context depends on changes (the slot
    layout, the tiers, an endpoint's learned shape); ``gen`` whenever what scoring depends on
    changes (endpoints, their states).

    ``layout`` is the slot numbering of the index's bit lanes (``cap`` endpoints per tier,
    ``grow``, ``lane(tier)``): the native backend's C table, else a :class:`~consumers.index.SlotLayout`."""

    def __init__(self, config: RouterConfig, layout: SlotLayout, learned: LearnedMap, stats: RouterStats) -> None:
        self.cfg = config
        self.stats = stats
        self.pinned = {pod: pub for pub, pod in config.publisher_pods.items()}  #: pod -> a publisher pinned to it
        self.layout = layout
        self.learned = learned
        self.by_key: dict[tuple[str, int], Endpoint] = {}
        self.slots: dict[int, Endpoint] = {}
        self.free_slots: list[int] = []
        self.next_slot = 0
        self.pod_model: dict[str, str] = {}
        self.pub_pod: dict[str, str] = {}  #: publisher identity -> the pod its deliveries went to
        #: publisher identity -> (pod, model) its owner told (:meth:`attribute`): the one place a
        #: publisher is attributed by name rather than by topic (model None: the topic's, else the default)
        self.attributed: dict[str, tuple[str, str | None]] = {}
        self.health: dict[str, str] = {}  #: pod -> RECOVERING / STALE (SYNCED pods absent)
        #: UNRELIABLE pods still re-learning -> batches left until their discount ends
        self.uncertain: dict[str, int] = {}
        self.tiers: dict[str, int] = {}
        self.tier_names: list[str] = []
        self.gen = 0
        self.touch = 0
        self._plan: tuple = (None, None)
        for name in BUILTIN_TIERS[: config.max_tiers]:
            self.tier(name)

    # --- tiers ------------------------------------------------------------------------------
    def tier(self, medium: str | None) -> int:
        """The tier number of ``medium`` (None is GPU), added if new; -1 if one too many."""
        name = "GPU" if medium is None else medium
        t = self.tiers.get(name)
        if t is None:
            if len(self.tiers) >= self.cfg.max_tiers:
                return -1
            t = self.tiers[name] = len(self.tiers)
            self.tier_names.append(name)
            self.touch += 1
        return t

    # --- endpoints --------------------------------------------------------------------------
    def get(self, pod: str, rank: int | None, model: str | None) -> Endpoint:
        """The endpoint of ``(pod, rank)``, created (a slot, the model's learned map) if new."""
        key = (pod, rank or 0)
        ep = self.by_key.get(key)
        if ep is not None:
            return ep
        if not isinstance(pod, str) or not pod:
            raise RouterInputError(f"pod must be a non-empty str, got {pod!r}")
        model = model or self.pod_model.get(pod) or self.cfg.model
        if model is None:
            raise RouterInputError(f"pod {pod!r}: no model (topic kv@<pod>@<model>, apply(model=...) "
                                   "or RouterConfig.model)")
        self.admit(pod)
        self.pod_model[pod] = model
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            slot = self.next_slot
            self.next_slot += 1
            if slot >= self.layout.cap:
                self.layout.grow(self.layout.cap * 2)
                self.touch += 1  # every endpoint's bits moved
        lmap = self.learned.for_model(model)
        ep = Endpoint(pod, rank or 0, slot, model, lmap, self.learned.odd[model])
        self.by_key[key] = ep
        self.slots[slot] = ep
        self.gen += 1
        return ep

    def admit(self, pod: str) -> None:
        """A new pod: refused (counted, :class:`PodRefused`) past ``max_pods``."""
        if len(self.pod_model) >= self.cfg.max_pods and pod not in self.pod_model:
            self.refuse("too_many_pods", f"pod {pod!r} refused: the router holds max_pods={self.cfg.max_pods} "
                        "pods already")

    def refuse(self, kind: str, msg: str) -> None:
        stats = self.stats
        stats.pods_refused += 1
        stats.errors[kind] = stats.errors.get(kind, 0) + 1
        raise PodRefused(msg)

    def pod_for(self, publisher: str, topic: str) -> tuple[str, str | None]:
        """``(pod, model)`` of a delivery: an attributed publisher's (:meth:`attribute`), else a
        pinned publisher's pod, else the topic's, else the publisher identity. Refuses (counted,
        :class:`PodRefused`) an unpinned publisher when ``pinned_only``, and a topic claiming a pod
        pinned to another publisher."""
        told = self.attributed.get(publisher)
        if told is not None:
            if told[1] is None:  # its model: the topic's, else (Endpoints.get) the pod's or the default
                return told[0], pod_from_topic(topic)[1]
            return told
        pod, model = pod_from_topic(topic)
        pinned = self.cfg.publisher_pods.get(publisher)
        if pinned is not None:
            return pinned, model
        return self._claim(publisher, pod or publisher, f"its topic {topic!r}"), model

    def _claim(self, publisher: str, pod: str, how: str) -> str:
        """``pod`` for an unpinned ``publisher``, or refused (counted): when ``pinned_only``, or
        when ``pod`` is pinned to another publisher."""
        if self.cfg.pinned_only:
            self.refuse("unpinned_publisher", f"publisher {publisher!r} refused: not in publisher_pods "
                        "(pinned_only)")
        if pod in self.pinned:
            self.refuse("pod_claim_refused", f"publisher {publisher!r} refused: {how} names pod "
                        f"{pod!r}, pinned to publisher {self.pinned[pod]!r}")
        return pod

    def attribute(self, publisher: str, pod: str, model: str | None = None) -> None:
        """Publisher ``publisher`` is pod ``pod`` serving ``model`` (None: the model its topic
        names, else the pod's or ``RouterConfig.model``): from now on its deliveries go there,
        whatever their topic says. A pinned publisher may be told only its own pod; an unpinned
        one is refused (counted, :class:`PodRefused`) as its topic would be: under ``pinned_only``,
        or naming a pod pinned to another publisher."""
        if not isinstance(pod, str) or not pod:
            raise RouterInputError(f"attribute: pod must be a non-empty str, got {pod!r}")
        pinned = self.cfg.publisher_pods.get(publisher)
        if pinned is None:
            self._claim(publisher, pod, "its attribution")
        elif pinned != pod:
            raise RouterInputError(f"attribute: publisher {publisher!r} is pinned to pod {pinned!r} "
                                   f"(publisher_pods), not {pod!r}")
        self.attributed[publisher] = (pod, model)

    def of_pod(self, pod: str) -> list[Endpoint]:
        return [ep for ep in self.by_key.values() if ep.pod == pod]

    def drop(self, ep: Endpoint) -> None:
        del self.by_key[(ep.pod, ep.rank)]
        del self.slots[ep.slot]
        self.free_slots.append(ep.slot)
        self.gen += 1

    def forget_pod(self, pod: str) -> None:
        self.pod_model.pop(pod, None)
        self.health.pop(pod, None)
        self.uncertain.pop(pod, None)
        self.gen += 1

    def pods(self) -> list[str]:
        return sorted({ep.pod for ep in self.by_key.values()})

    def __iter__(self):
        return iter(list(self.by_key.values()))

    def __len__(self) -> int:
        return len(self.by_key)

    # --- health -----------------------------------------------------------------------------
    def set_health(self, pod: str, state: str) -> None:
        if self.health.get(pod, "SYNCED") == state:
            return
        self.gen += 1
        if state == "SYNCED":
            self.health.pop(pod, None)
        else:
            self.health[pod] = state

    def set_unreliable(self, pod: str, value: bool) -> None:
        self.gen += 1
        for ep in self.of_pod(pod):
            ep.unreliable = value
        if value:
            if self.cfg.relearn_batches:
                self.uncertain[pod] = self.cfg.relearn_batches  # (another gap: the count starts over)
        else:
            self.uncertain.pop(pod, None)

    def relearn_one(self, pod: str) -> None:
        """A batch of the UNRELIABLE ``pod`` was applied: one closer to certain (the feed calls
        this per batch delivery of a pod in ``uncertain``; the plan moves at each of eight steps)."""
        n = self.cfg.relearn_batches
        left = self.uncertain[pod] - 1
        if left <= 0:
            self.stats.relearned += 1
            self.set_unreliable(pod, False)
            return
        self.uncertain[pod] = left
        if (n - left) * 8 // n != (n - left - 1) * 8 // n:
            self.gen += 1

    def discount(self, pod: str) -> float:
        """The UNRELIABLE factor of ``pod`` now: ``state_factors["UNRELIABLE"]`` right after the
        gap, rising in eight steps to 1 over ``relearn_batches`` batches."""
        base = self.cfg.state_factors.get("UNRELIABLE", 1.0)
        left = self.uncertain.get(pod)
        n = self.cfg.relearn_batches
        if left is None or base >= 1.0 or not n:
            return base
        return base + (1.0 - base) * ((n - left) * 8 // n) / 8

    def state_factor(self, ep: Endpoint) -> tuple[str, float]:
        """``(state, factor)`` of ``ep``: its pod's health state's factor, times the UNRELIABLE
        discount while it re-learns (state UNRELIABLE where its health is SYNCED)."""
        health = self.health.get(ep.pod, "SYNCED")
        factor = self.cfg.state_factors.get(health, 1.0)
        if ep.unreliable:
            return ("UNRELIABLE" if health == "SYNCED" else health), factor * self.discount(ep.pod)
        return health, factor

    # --- what scoring walks -------------------------------------------------------------------
    def model_for_query(self, model: str | None) -> str:
        if model is not None:
            return model
        if self.cfg.model is not None:
            return self.cfg.model
        models = set(self.pod_model.values())
        if len(models) == 1:
            return next(iter(models))
        if not models:
            return ""  # no pod heard yet: every prompt scores nothing
        raise RouterInputError(f"score: name the model (pods serve {sorted(models)!r})")

    def stages(self) -> list[tuple[int, str, float]]:
        """``(tier, name, weight)``, heaviest first."""
        w = self.cfg.tier_weights
        d = self.cfg.default_tier_weight
        tiers = [(t, name, w.get(name, d)) for name, t in self.tiers.items()]
        tiers.sort(key=lambda x: (-x[2], x[0]))
        return tiers

    def plan(self, model: str) -> tuple:
        """``(stages, lanes, start, eps)`` for ``model``: cached until endpoints, their states,
        the tiers or the slot layout change."""
        layout = self.layout
        ck = (model, self.gen, len(self.tiers), layout.cap)
        cached = self._plan
        if cached[0] == ck:
            return cached[1]
        stages = self.stages()
        lanes = [layout.lane(t) for t, _, _ in stages]
        start = 0
        eps = []
        for ep in self.by_key.values():
            if ep.model == model:
                state, factor = self.state_factor(ep)
                eps.append((ep, state, factor))
                if factor > 0:
                    start |= 1 << ep.slot
        plan = (stages, lanes, start, eps)
        self._plan = (ck, plan)
        return plan
