"""KVRouter: a KV-cache-aware prefix router fed by KV events from many pods.

Its core needs no sockets: ``apply(pod, batch)`` feeds it one decoded batch,
``reset_pod``/``remove_pod`` drop a pod's state, ``score``/``pick``/``explain`` answer.
``run(subscriber)`` drives it from anything that yields :class:`kvevents.delivery.Delivery`
(a live :class:`kvevents.Subscriber`), resets and gaps included.

Known limitations (measured in ``benchmarks/router.py``):

* Where the C extension is not built, ingest stays far below the decode-only rate (hashing an
  event's 4 x 16 token ids alone costs about what decoding it does). With it,
  ``apply_payload`` ingests at or above the decode-only rate (see the README's figures).
* With engine blocks larger than the canonical block, removing a block also clears the
  first key it shares with a sibling still held (the score under-reports, never over-reports).
* ``reset_pod``/``AllBlocksCleared``/``remove_pod`` scan every key (one C-level pass; in
  pure Python then a loop over the keys the endpoint held).
"""

from __future__ import annotations

import sys
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping

from kvevents.errors import DecodeError
from kvevents.events import KVEventBatch
from kvevents.topic import parse_topic

from .fastingest import FastIngestMixin
from .index import LearnedMap, make_index
from .ingest import Endpoint, IngestMixin
from .keys import _FAST, as_token_list, chain_keys, model_seed
from .router_config import RouterConfig, RouterInputError, RouterStats
from .score import Explanation, Score, TierMatch, walk

__all__ = ["KVRouter", "pod_from_topic"]

_BUILTIN_TIERS = ("GPU", "CPU", "STORAGE")


#: ``kv@<pod>@<model>`` -> ``(pod, model)``: the topic format lives in kvevents.topic
pod_from_topic = parse_topic


class KVRouter(FastIngestMixin, IngestMixin):
    def __init__(self, config: RouterConfig | None = None, **overrides: object) -> None:
        if config is None:
            config = RouterConfig(**overrides)  # type: ignore[arg-type]
        elif overrides:
            raise TypeError("pass either a RouterConfig or keyword overrides, not both")
        self._cfg = config
        self._bs = config.block_size
        self._index = make_index(config.max_entries, max_tiers=config.max_tiers, fast=_FAST)
        self._learned = LearnedMap(config.max_learned or config.max_entries, table=getattr(_FAST, "LearnedTable", None))
        self.stats = RouterStats()
        self._py_touch = 0  #: bumped whenever the Python ingest path runs (the C fast path's cache key)
        self._tiers: dict[str, int] = {}
        self._tier_names: list[str] = []
        for name in _BUILTIN_TIERS[: config.max_tiers]:
            self._tier(name)
        self._endpoints: dict[tuple[str, int], Endpoint] = {}
        self._slots: dict[int, Endpoint] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._pending: OrderedDict = OrderedDict()
        self._pending_by_hash: dict[object, list] = {}
        self._pod_model: dict[str, str] = {}
        self._pub_pod: dict[str, str] = {}
        self._health: dict[str, str] = {}  #: pod -> RECOVERING / STALE (SYNCED pods absent)
        self._gen = 0  #: bumped whenever endpoints or their states change (score's cache key)
        self._fast_ctxs: dict[str, dict[int, tuple]] = {}  #: pod -> rank -> the C fast path's context
        self._bind_fast()
        self._walk_cache: tuple = (None, None)

    @property
    def config(self) -> RouterConfig:
        return self._cfg

    # --- endpoints ------------------------------------------------------------------------
    def _endpoint(self, pod: str, rank: int | None, model: str | None) -> Endpoint:
        key = (pod, rank or 0)
        ep = self._endpoints.get(key)
        if ep is not None:
            return ep
        if not isinstance(pod, str) or not pod:
            raise RouterInputError(f"pod must be a non-empty str, got {pod!r}")
        model = model or self._pod_model.get(pod) or self._cfg.model
        if model is None:
            raise RouterInputError(f"pod {pod!r}: no model (topic kv@<pod>@<model>, apply(model=...) "
                                   "or RouterConfig.model)")
        self._pod_model[pod] = model
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            slot = self._next_slot
            self._next_slot += 1
            if slot >= self._index.cap:
                self._index.grow(self._index.cap * 2)
                self._py_touch += 1  # every endpoint's bits moved
        lmap = self._learned.for_model(model)
        ep = Endpoint(pod, rank or 0, slot, model, lmap, self._learned.odd[model])
        self._endpoints[key] = ep
        self._gen += 1
        self._slots[slot] = ep
        return ep

    def pods(self) -> list[str]:
        return sorted({ep.pod for ep in self._endpoints.values()})

    # --- feeding --------------------------------------------------------------------------
    def apply(self, pod: str, batch: KVEventBatch, *, model: str | None = None, strict: bool = False) -> None:
        """Feed one decoded batch from ``pod`` (its ``data_parallel_rank`` picks the endpoint).

        Bad events are counted in ``stats.errors`` and skipped (raised with ``strict=True``).
        """
        if type(batch) is not KVEventBatch and not isinstance(batch, KVEventBatch):
            raise TypeError(f"apply expects a KVEventBatch, got {type(batch).__name__}")
        rank = batch.data_parallel_rank
        ep = self._endpoints.get((pod, rank or 0))
        if ep is None:
            ep = self._endpoint(pod, rank, model)
        self.stats.batches += 1
        lmap = ep.lmap
        n0 = len(lmap)
        self._apply_events(ep, batch.events, strict)
        if self._pending:
            self._expire_pending()
        learned = self._learned
        learned.size += len(lmap) - n0
        if learned.size > learned.max_size:
            learned.recount()

    def reset_pod(self, pod: str) -> None:
        """The pod's publisher restarted: everything it told us is void."""
        self.stats.resets += 1
        self._py_touch += 1
        for ep in self._pod_endpoints(pod):
            self._clear_endpoint(ep)
            # the engine block size is configuration, not state: a restarted engine keeps it
            # (its next GPU event re-teaches it if not), so an offload joined before that event
            # still spans the right keys
            ep.chunk_keys.clear()
            ep.token_tiers.clear()

    def remove_pod(self, pod: str) -> None:
        """The pod left the configuration: purge it."""
        eps = self._pod_endpoints(pod)
        if eps:
            self.stats.purges += 1
        self._fast_ctxs.pop(pod, None)
        for ep in eps:
            self._clear_endpoint(ep)
            del self._endpoints[(ep.pod, ep.rank)]
            self._gen += 1
            del self._slots[ep.slot]
            self._free_slots.append(ep.slot)
        self._pod_model.pop(pod, None)
        self._health.pop(pod, None)
        self._gen += 1

    def mark_unreliable(self, pod: str) -> None:
        """Events from ``pod`` were lost for good: its entries may be wrong until a clear/reset."""
        self.stats.gaps += 1
        self._gen += 1
        for ep in self._pod_endpoints(pod):
            ep.unreliable = True

    def mark_resynced(self, pod: str) -> None:
        """The caller has brought ``pod`` back in sync (e.g. re-fed it from a snapshot)."""
        self._gen += 1
        for ep in self._pod_endpoints(pod):
            ep.unreliable = False

    def set_health(self, pod: str, state: str) -> None:
        """``SYNCED``, ``RECOVERING`` or ``STALE`` (``run`` does this from ``subscriber.health()``)."""
        if self._health.get(pod, "SYNCED") == state:
            return
        self._gen += 1
        if state == "SYNCED":
            self._health.pop(pod, None)
        else:
            self._health[pod] = state

    def _pod_endpoints(self, pod: str) -> list[Endpoint]:
        return [ep for ep in self._endpoints.values() if ep.pod == pod]

    # --- driving from a subscriber ----------------------------------------------------------
    def pod_for(self, publisher: str, topic: str) -> tuple[str, str | None]:
        pod, model = pod_from_topic(topic)
        configured = self._cfg.publisher_pods.get(publisher)
        if configured is not None:
            pod = configured
        return (pod or publisher), model

    def handle(self, delivery: object) -> None:
        """Apply one :class:`kvevents.delivery.Delivery`."""
        kind = getattr(getattr(delivery, "kind", None), "value", None)
        pod, model = self.pod_for(delivery.publisher, delivery.topic)  # type: ignore[attr-defined]
        self._pub_pod[delivery.publisher] = pod  # type: ignore[attr-defined]
        if kind == "batch":
            batch = delivery.batch  # type: ignore[attr-defined]
            try:
                if batch is not None:
                    self.apply(pod, batch, model=model)
                    return
                payload = getattr(delivery, "payload", None)
                if payload is None:
                    self._error("empty_delivery", f"pod {pod!r}: BATCH delivery without a batch", False)
                    return
                try:  # a raw-mode subscriber: the payload, decoded here (in C where it is built)
                    self.apply_payload(pod, payload, model=model)
                except DecodeError as exc:  # a lost batch, as a subscriber that decodes reports it
                    self._error("malformed_payload", f"pod {pod!r}: seq {delivery.seq}: {exc}", False)  # type: ignore[attr-defined]
                    self.mark_unreliable(pod)
            except RouterInputError as exc:
                self._error("bad_delivery", str(exc), False)
        elif kind == "reset":
            self.reset_pod(pod)
            self.mark_resynced(pod)
        elif kind == "gap":
            self.mark_unreliable(pod)
        else:
            self._error("unknown_delivery", f"pod {pod!r}: delivery of unknown kind {kind!r}", False)

    def refresh_health(self, subscriber: object) -> None:
        health = getattr(subscriber, "health", None)
        if not callable(health):
            return
        for publisher, h in health().items():
            pod = self._pub_pod.get(publisher) or self._cfg.publisher_pods.get(publisher)
            if pod is None:
                continue
            state = getattr(h, "state", h)
            self.set_health(pod, getattr(state, "value", str(state)))

    def run(self, subscriber: Iterable, *, stop: object = None, health_interval: float = 1.0) -> int:
        """Apply every delivery ``subscriber`` yields until it ends (or ``stop.is_set()``).

        A live :class:`kvevents.Subscriber` (anything with ``poll(timeout_ms)``) is polled, so
        ``stop`` is seen within 0.1 s and ``health()`` is read every ``health_interval`` seconds
        even while a pod is silent (that is how a STALE pod gets excluded); a plain iterable is
        consumed as is, with ``health()`` read every ``health_every`` deliveries. Returns the count.
        """
        n = 0
        is_set = getattr(stop, "is_set", None)
        self.refresh_health(subscriber)
        poll = getattr(subscriber, "poll", None)
        if callable(poll):
            next_health = time.monotonic() + health_interval
            while is_set is None or not is_set():
                for delivery in poll(100):
                    self.handle(delivery)
                    n += 1
                if time.monotonic() >= next_health:
                    self.refresh_health(subscriber)
                    next_health = time.monotonic() + health_interval
            self.refresh_health(subscriber)
            return n
        every = self._cfg.health_every
        for delivery in subscriber:
            self.handle(delivery)
            n += 1
            if n % every == 0:
                self.refresh_health(subscriber)
            if is_set is not None and is_set():
                break
        self.refresh_health(subscriber)
        return n

    # --- answers --------------------------------------------------------------------------
    def _model_for_query(self, model: str | None) -> str:
        if model is not None:
            return model
        if self._cfg.model is not None:
            return self._cfg.model
        models = set(self._pod_model.values())
        if len(models) == 1:
            return next(iter(models))
        if not models:
            return ""  # no pod heard yet: every prompt scores nothing
        raise RouterInputError(f"score: name the model (pods serve {sorted(models)!r})")

    def _state(self, ep: Endpoint) -> str:
        if ep.unreliable:
            return "UNRELIABLE"
        return self._health.get(ep.pod, "SYNCED")

    def _factor(self, state: str) -> float:
        return self._cfg.state_factors.get(state, 1.0)

    def _stages(self) -> list[tuple[int, str, float]]:
        w = self._cfg.tier_weights
        d = self._cfg.default_tier_weight
        tiers = [(t, name, w.get(name, d)) for name, t in self._tiers.items()]
        tiers.sort(key=lambda x: (-x[2], x[0]))
        return tiers

    def _plan(self, model: str) -> tuple:
        """``(stages, lanes, start, eps)`` for ``model``: cached until endpoints, their states,
        the tiers or the slot layout change."""
        index = self._index
        ck = (model, self._gen, len(self._tiers), index.cap)
        cached = self._walk_cache
        if cached[0] == ck:
            return cached[1]
        stages = self._stages()
        full = (1 << index.cap) - 1
        lanes = [(t * index.cap, full) for t, _, _ in stages]
        start = 0
        health = self._health
        factors = self._cfg.state_factors
        eps = []
        for ep in self._endpoints.values():
            if ep.model == model:
                state = "UNRELIABLE" if ep.unreliable else health.get(ep.pod, "SYNCED")
                factor = factors.get(state, 1.0)
                eps.append((ep, state, factor))
                if factor > 0:
                    start |= 1 << ep.slot
        plan = (stages, lanes, start, eps)
        self._walk_cache = (ck, plan)
        return plan

    def _walk(self, tokens: object, lora_name: str | None, model: str | None):
        toks = as_token_list(tokens)
        model = self._model_for_query(model)
        keys = chain_keys(toks, model_seed(model, lora_name), self._bs)
        stages, lanes, start, eps = self._plan(model)
        segments, ends = walk(self._index.masks, keys, lanes, start)
        return toks, keys, stages, segments, ends, model, eps

    def score(self, tokens: object, lora_name: str | None = None, *, model: str | None = None,
              load: Mapping[str, float] | None = None) -> dict[str, Score]:
        """Pod -> :class:`Score` for every pod of ``model`` not excluded by its state."""
        toks, keys, stages, segments, ends, model, eps = self._walk(tokens, lora_name, model)
        C = self._bs
        n_tokens = max(1, len(toks))
        n_keys = len(keys)
        lw = self._cfg.load_weight
        out: dict[str, Score] = {}
        top: Score | None = None  # what pick() would choose: the counters below follow it
        for ep, state, factor in eps:
            if factor <= 0:
                continue
            pod = ep.pod
            pod_load = 0.0 if load is None else float(load.get(pod, 0.0))
            seg = segments.get(ep.slot)
            if seg is None:
                total = -lw * pod_load
                best = out.get(pod)
                if best is None or total > best.total:
                    out[pod] = s = Score(pod, total, {}, 0, ep.rank, state, factor, pod_load)
                    if top is None or total > top.total or (total == top.total and (
                            pod_load < top.load or (pod_load == top.load and pod < top.pod))):
                        top = s
                continue
            by_tier: dict[str, int] = {}
            weighted = 0.0
            end = ends.get(ep.slot, n_keys)
            for i, (stage, first) in enumerate(seg):
                last = seg[i + 1][1] if i + 1 < len(seg) else end
                if last > first:
                    _, name, w = stages[stage]
                    by_tier[name] = by_tier.get(name, 0) + (last - first) * C
                    weighted += w * (last - first) * C
            total = factor * weighted / n_tokens - lw * pod_load
            best = out.get(pod)
            if best is None or total > best.total:
                out[pod] = s = Score(pod, total, by_tier, end * C, ep.rank, state, factor, pod_load)
                if top is None or total > top.total or (total == top.total and (
                        pod_load < top.load or (pod_load == top.load and pod < top.pod))):
                    top = s
        stats = self.stats
        stats.lookups += 1
        stats.prompt_tokens += len(toks)
        if top is not None:
            matched = stats.matched_tokens
            for tier, n in top.tokens_by_tier.items():
                matched[tier] = matched.get(tier, 0) + n
        return out

    def pick(self, tokens: object, lora_name: str | None = None, *, model: str | None = None,
             load: Mapping[str, float] | None = None) -> str | None:
        """The pod with the highest total (ties: lower load, then name); None if none is eligible."""
        scores = self.score(tokens, lora_name, model=model, load=load)
        if not scores:
            return None
        return min(scores.values(), key=lambda s: (-s.total, s.load, s.pod)).pod

    def explain(self, tokens: object, lora_name: str | None = None, *,
                model: str | None = None) -> dict[str, list[Explanation]]:
        """Pod -> one :class:`Explanation` per data-parallel rank: what matched, tier by tier,
        and why the match ended."""
        toks, keys, stages, segments, ends, model, _eps = self._walk(tokens, lora_name, model)
        C = self._bs
        index = self._index
        masks = index.masks
        out: dict[str, list[Explanation]] = {}
        for ep in sorted(self._endpoints.values(), key=lambda e: (e.pod, e.rank)):
            if ep.model != model:
                continue
            state = self._state(ep)
            factor = self._factor(state)
            alone: dict[str, int] = {}
            for t, name, _w in stages:
                bit = index.bit(t, ep.slot)
                n = 0
                for k in keys:
                    if not masks.get(k, 0) & bit:
                        break
                    n += 1
                alone[name] = n * C
            segs: list[TierMatch] = []
            seg = segments.get(ep.slot)
            end = ends.get(ep.slot, 0) if seg is not None else 0
            if seg is not None:
                for i, (stage, first) in enumerate(seg):
                    last = seg[i + 1][1] if i + 1 < len(seg) else end
                    if last > first:
                        segs.append(TierMatch(stages[stage][1], first, last - first, (last - first) * C))
            tail = len(toks) - len(keys) * C
            if factor <= 0:
                reason = f"excluded: pod state {state}"
                ended = 0
            elif end >= len(keys):
                ended = None
                reason = (f"end of prompt: all {len(keys)} full blocks matched"
                          + (f"; the last {tail} tokens are not a full block" if tail else ""))
            else:
                ended = end
                held = [name for t, name, _w in stages if masks.get(keys[end], 0) & index.bit(t, ep.slot)]
                where = f"tokens {end * C}..{(end + 1) * C - 1}"
                if held:
                    reason = (f"block {end} ({where}) is only in tier(s) {held}, above the tier the "
                              "match had moved down to")
                elif keys[end] not in masks:
                    reason = f"block {end} ({where}) is not indexed for any pod"
                else:
                    reason = f"block {end} ({where}) is in no tier of this pod"
            out.setdefault(ep.pod, []).append(Explanation(
                ep.pod, ep.rank, state, factor, end * C if factor > 0 else 0, segs, alone, ended, reason,
                len(keys)))
        return out

    # --- introspection --------------------------------------------------------------------
    def entries(self) -> int:
        """Indexed (key, endpoint, tier) entries."""
        return self._index.entries

    def memory_report(self) -> dict[str, float]:
        """Approximate bytes held by the index (dicts plus the int objects they own; an
        interned mask is counted once)."""
        idx = self._index
        size = sys.getsizeof
        masks_b = idx.masks_nbytes()
        parents_b = idx.parents_nbytes()
        learned_b = self._learned.nbytes()
        total = masks_b + parents_b + learned_b
        entries = max(1, idx.entries)
        return {"entries": idx.entries, "keys": len(idx.masks), "learned": self._learned.size,
                "distinct_masks": idx.distinct_masks(), "bytes_masks": masks_b, "bytes_parents": parents_b,
                "bytes_learned": learned_b, "bytes_total": total, "bytes_per_entry": total / entries}

    def counters(self) -> dict[str, object]:
        d = self.stats.as_dict()
        d.update(entries=self._index.entries, keys=len(self._index.masks), evicted_keys=self._index.evicted_keys,
                 evicted_entries=self._index.evicted_entries, compactions=self._index.compactions,
                 learned=self._learned.size,
                 learned_evicted=self._learned.evicted, pending=len(self._pending))
        return d
