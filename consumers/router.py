"""KVRouter: a KV-cache-aware prefix router fed by KV events from many pods.

A facade over its parts: :class:`~consumers.endpoints.Endpoints` (pods, ranks, slots, health,
models, tiers), an :class:`~consumers.ingest.Ingestor` (events -> index operations, learned
engine hashes, pending joins; :class:`~consumers.nativeingest.NativeIngestor` where the C
extension is in use), an :class:`~consumers.index.Index` backend (``RouterConfig.index``) and a
:class:`~consumers.scorer.Scorer` (score, pick, explain). Its core needs no sockets:
``apply(pod, batch)`` feeds it one decoded batch, ``reset_pod``/``remove_pod`` drop a pod's
state, ``score``/``pick``/``explain`` answer; ``run(source)`` drives it from any event source
(:mod:`consumers.feed`). ``snapshot()``/``restore()`` save and load its whole state.

Known limitations (measured in ``benchmarks/router.py``):

* Where the C extension is not built, ingest stays far below the decode-only rate.
* With engine blocks larger than the canonical block, removing a block also clears the
  first key it shares with a sibling still held (the score under-reports, never over-reports).
* ``reset_pod``/``AllBlocksCleared``/``remove_pod`` scan every key.
"""

from __future__ import annotations

from collections.abc import Iterable

from . import feed, snapshot
from .endpoints import Endpoints, pod_from_topic
from .index import Index, SlotLayout, accelerator, make_index
from .instrumented import InstrumentedIndex, TracedIndex
from .ingest import Ingestor
from .keys import _FAST
from .learned import LearnedMap
from .nativeingest import NativeIngestor, available
from .router_config import RouterConfig, RouterInputError, RouterStats
from .scorer import Scorer

__all__ = ["KVRouter", "pod_from_topic"]


class KVRouter:
    def __init__(self, config: RouterConfig | None = None, **overrides: object) -> None:
        if config is None:
            config = RouterConfig(**overrides)  # type: ignore[arg-type]
        elif overrides:
            raise TypeError("pass either a RouterConfig or keyword overrides, not both")
        self._cfg = config
        self._build()
        self.feed = feed.Feed()  #: deliveries -> this router (a place telemetry can wrap)

    def _build(self) -> None:
        config = self._cfg
        self._stats = RouterStats()
        index = make_index(config.index, config.max_entries, max_tiers=config.max_tiers, native=_FAST is not None)
        if config.index_metrics:
            index = InstrumentedIndex(index)
        if config.index_tracing:
            index = TracedIndex(index)
        self._index = index
        accel = accelerator(index)  # the native backend's C table, whatever decorates it (else None)
        native = available(config, accel)
        self._learned = LearnedMap(config.max_learned or config.max_entries,
                                   table=_FAST.LearnedTable if native else None)  # type: ignore[union-attr]
        layout = accel if accel is not None else SlotLayout(max_tiers=config.max_tiers)
        told = self._eps.attributed if hasattr(self, "_eps") else {}  # (what the owner said stays across a restore)
        self._eps = Endpoints(config, layout, self._learned, self._stats)  # type: ignore[arg-type]
        self._eps.attributed = told
        if native:
            self._ingest: Ingestor = NativeIngestor(config, self._eps, index, self._learned, self._stats, accel)
        else:
            self._ingest = Ingestor(config, self._eps, index, self._learned, self._stats)
        self.scorer = Scorer(config, self._eps, index, self._stats, accel)
        self.apply_payload = self._ingest.apply_payload  # (bound: no facade frame per batch)
        self.apply = self._ingest.apply  # type: ignore[method-assign]

    # --- parts --------------------------------------------------------------------------------
    @property
    def config(self) -> RouterConfig:
        return self._cfg

    @property
    def stats(self) -> RouterStats:
        self._ingest.sync()
        return self._stats

    @property
    def index(self) -> Index:
        return self._index

    @property
    def endpoints(self) -> Endpoints:
        return self._eps

    @property
    def ingestor(self) -> Ingestor:
        return self._ingest

    @property
    def learned(self) -> LearnedMap:
        self._ingest.sync()
        return self._learned

    def pods(self) -> list[str]:
        return self._eps.pods()

    # --- feeding ------------------------------------------------------------------------------
    def apply(self, pod: str, batch, *, model: str | None = None, strict: bool = False) -> None:
        """Feed one decoded batch from ``pod`` (bad events counted in ``stats.errors``, raised
        with ``strict=True``). (Each router binds its ingestor's ``apply`` in this place: no
        facade frame per batch.)"""
        self._ingest.apply(pod, batch, model=model, strict=strict)

    def reset_pod(self, pod: str) -> None:
        """The pod's publisher restarted: everything it told us is void."""
        self._stats.resets += 1
        self._eps.touch += 1
        for ep in self._eps.of_pod(pod):
            self._ingest.clear_endpoint(ep)
            # the engine block size is configuration, not state: a restarted engine keeps it
            ep.chunk_keys.clear()
            ep.chunk_seen.clear()
            ep.token_tiers.clear()
            ep.tier_bs.clear()

    def remove_pod(self, pod: str) -> None:
        """The pod left the configuration: purge it."""
        eps = self._eps.of_pod(pod)
        if eps:
            self._stats.purges += 1
        self._ingest.forget_pod(pod)
        for ep in eps:
            self._ingest.clear_endpoint(ep)
            self._eps.drop(ep)
        self._eps.forget_pod(pod)

    def add_pod(self, pod: str, model: str | None = None) -> None:
        """A pod known before it publishes (configured): scored from now on, 0 until it has told
        something (:class:`~consumers.router_config.PodRefused` past ``max_pods``)."""
        self._eps.get(pod, 0, model)

    def mark_unreliable(self, pod: str) -> None:
        """Events from ``pod`` were lost for good: its entries may be wrong. It stays routed, its
        score discounted (``state_factors["UNRELIABLE"]``) until ``relearn_batches`` more of its
        batches were applied, or a clear/reset."""
        self._stats.gaps += 1
        self._eps.set_unreliable(pod, True)

    def uncertainty(self) -> dict[str, dict[str, object]]:
        """UNRELIABLE pods -> ``{"factor": the discount now, "batches_left": until it ends (None:
        until a clear/reset)}``."""
        eps = self._eps
        return {pod: {"factor": eps.discount(pod), "batches_left": eps.uncertain.get(pod)}
                for pod in sorted({ep.pod for ep in eps if ep.unreliable})}

    def mark_resynced(self, pod: str) -> None:
        """The caller has brought ``pod`` back in sync (e.g. re-fed it from a snapshot)."""
        self._eps.set_unreliable(pod, False)

    def set_health(self, pod: str, state: str) -> None:
        """``SYNCED``, ``RECOVERING`` or ``STALE`` (``run`` does this from ``source.health()``)."""
        self._eps.set_health(pod, state)

    def count_error(self, kind: str, msg: str) -> None:
        self._ingest.error(kind, msg, False)

    # --- driving from an event source -------------------------------------------------------------
    def pod_for(self, publisher: str, topic: str) -> tuple[str, str | None]:
        """``(pod, model)`` of a delivery (:meth:`Endpoints.pod_for`: attributions, pins, refusals)."""
        return self._eps.pod_for(publisher, topic)

    def attribute(self, publisher: str, pod: str, model: str | None = None) -> None:
        """Publisher ``publisher`` is pod ``pod`` serving ``model``: its deliveries go there
        whatever their topic says (:meth:`Endpoints.attribute`; kept across a restore)."""
        self._eps.attribute(publisher, pod, model)

    def handle(self, delivery: object) -> str:
        """Apply one :class:`kvevents.delivery.Delivery`; the outcome (:data:`consumers.feed.OUTCOMES`:
        ``"applied"``, ``"bad"``, ``"refused"``...), so a caller acts on this delivery's own."""
        return self.feed.handle(self, delivery)

    def refresh_health(self, source: object) -> None:
        feed.refresh_health(self, source)

    def run(self, source: Iterable, *, stop: object = None, health_interval: float = 1.0) -> int:
        """Apply every delivery ``source`` yields until it ends (or ``stop.is_set()``).

        A live source (anything with ``poll(timeout_ms)``) is polled, so ``stop`` is seen within
        0.05 s (:data:`consumers.feed.POLL_MS`) and ``health()`` is read every ``health_interval``
        seconds even while a pod is silent (that is how a STALE pod gets excluded); a plain
        iterable is consumed as is, with ``health()`` read every ``health_every`` deliveries.
        Returns the count. (The loop is :func:`consumers.feed.run`, the service's too.)
        """
        return feed.run(self, source, stop=stop, health_interval=health_interval)

    # --- answers ------------------------------------------------------------------------------
    def score(self, tokens: object, lora_name: str | None = None, *, model: str | None = None, load=None):
        """Pod -> :class:`~consumers.score.Score` for every pod of ``model`` not excluded by its state."""
        return self.scorer.score(tokens, lora_name, model=model, load=load)

    def pick(self, tokens: object, lora_name: str | None = None, *, model: str | None = None,
             load=None) -> str | None:
        """The pod with the highest total (ties: lower load, then name); None if none is eligible."""
        return self.scorer.pick(tokens, lora_name, model=model, load=load)

    def explain(self, tokens: object, lora_name: str | None = None, *, model: str | None = None):
        """Pod -> one :class:`~consumers.score.Explanation` per data-parallel rank."""
        return self.scorer.explain(tokens, lora_name, model=model)

    # --- snapshots -----------------------------------------------------------------------------
    def snapshot(self, *, stream_seq: int | None = None) -> bytes:
        """The whole state as versioned, checksummed bytes (see :mod:`consumers.snapshot`);
        ``stream_seq``: the last stream sequence applied, returned by :meth:`restore`."""
        return snapshot.save(self, stream_seq)

    def restore(self, data: bytes) -> snapshot.SnapshotInfo:
        """Replace the state with a snapshot's; :class:`~consumers.snapshot.SnapshotError` (and
        an empty router: a cold start) for corrupt, truncated, future-version or foreign data."""
        return snapshot.load_into(self, data)

    def state_digest(self) -> str:
        """A digest of the full state answers and joins come from (not the counters): equal
        digests, equal index, learned maps, joins and endpoints (replicas compare these)."""
        return snapshot.state_digest(self)

    def _reset_parts(self) -> None:
        """Fresh, empty parts (the configuration and any telemetry wrapper of the scorer stay)."""
        old = self.scorer
        self._build()
        inner = old
        while hasattr(inner, "inner") and hasattr(inner.inner, "inner"):
            inner = inner.inner
        if hasattr(inner, "inner"):
            inner.inner = self.scorer
            self.scorer = old

    # --- introspection ----------------------------------------------------------------------------
    def chunk_extents(self) -> dict[str, dict[str, int]]:
        """Per pod and offload tier, the keys (canonical blocks) per offloaded chunk the join
        inferred from the stream (the smallest over the pod's ranks; a tier that
        ``offload_chunk_blocks`` configures is not inferred, so not listed)."""
        out: dict[str, dict[str, int]] = {}
        names = self._eps.tier_names
        for ep in self._eps:
            d = out.setdefault(ep.pod, {})
            for t, n in ep.chunk_keys.items():
                d[names[t]] = min(n, d.get(names[t], n))
        return out

    def entries(self) -> int:
        """Indexed (key, endpoint, tier) entries."""
        return self._index.stats()["entries"]

    def entries_by_tier(self) -> dict[str, int]:
        """(key, endpoint) entries per tier name."""
        lanes = self._index.stats("tiers")["by_tier"]
        return {name: lanes[t] for name, t in self._eps.tiers.items()}

    def entries_by_pod(self) -> dict[str, dict[str, int]]:
        """Pod -> tier name -> (key, endpoint) entries, the pod's ranks summed; pods that hold
        nothing are listed with zeros. O(index) per call (the index's per-endpoint census), so
        call it for a status page, not per request."""
        eps, names = self._eps, self._eps.tier_names
        owner = {ep.slot: ep.pod for ep in eps}
        out: dict[str, dict[str, int]] = {pod: {name: 0 for name in names} for pod in owner.values()}
        for slot, row in self._index.stats("endpoints")["by_endpoint"].items():
            pod = owner.get(slot)
            if pod is not None:
                for t, n in enumerate(row[: len(names)]):
                    out[pod][names[t]] += n
        return out

    def memory_report(self) -> dict[str, float]:
        """Approximate bytes held by the index and the learned maps."""
        st = self._index.stats("bytes")
        learned_b = self.learned.nbytes()
        total = st["bytes"] + learned_b
        entries = max(1, st["entries"])
        return {"entries": st["entries"], "keys": st["keys"], "learned": self._learned.size,
                "distinct_masks": st.get("distinct_masks", 0), "bytes_masks": st.get("bytes_masks", st["bytes"]),
                "bytes_parents": st.get("bytes_parents", 0), "bytes_learned": learned_b, "bytes_total": total,
                "bytes_per_entry": total / entries}

    def counters(self) -> dict[str, object]:
        d = self.stats.as_dict()
        st = self._index.stats()
        d.update(entries=st["entries"], keys=st["keys"], evicted_keys=st["evicted_keys"],
                 evicted_entries=st["evicted_entries"], compactions=st.get("compactions", 0),
                 learned=self._learned.size, learned_evicted=self._learned.evicted,
                 pending=len(self._ingest.pending), pods=len({ep.pod for ep in self._eps}),
                 uncertain_pods=len({ep.pod for ep in self._eps if ep.unreliable}))
        return d
