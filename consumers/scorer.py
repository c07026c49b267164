"""The Scorer: how much of a prompt's prefix each pod holds (score), the pod to send it to
(pick, with THE tie-break: :func:`consumers.score.best`) and why (explain)."""

from __future__ import annotations

import struct
from array import array
from collections.abc import Mapping

import msgspec

from .endpoints import Endpoints
from .index import Index
from .keys import _FAST, as_token_list, chain_keys, model_seed
from .router_config import RouterConfig, RouterStats
from .score import Explanation, Score, TierMatch, best, better

__all__ = ["Scorer"]

_DIRECT = (list, tuple, array)


def _toks(tokens: object):
    """tokens as the C calls take them: a list, tuple, array or memoryview('I') (what
    consumers.keys.json_request reads a body into) as it is, anything else as a list."""
    t = type(tokens)
    if t in _DIRECT or (t is memoryview and tokens.format == "I"):  # type: ignore[attr-defined]
        return tokens
    return as_token_list(tokens)


_enc = msgspec.json.encode


def _json_plan(rows: tuple, pods: dict, stages: list) -> tuple:
    """What score_json writes that only the plan decides, as msgspec writes it: per row the
    pod's JSON string (the pick), the Score's text before its total and from its matched
    tokens' end to ``"load":``; per stage its tier's ``"name":``; the pods' indices in name order (the
    answer's order where totals tie); the rows' (slot, pod index, factor as a float) packed as C
    reads them (a factor is an int or a float, RouterConfig.state_factors: the same product
    either way, and its fragment is msgspec's text of it as it is)."""
    frags = tuple((_enc(pod), b'{"pod":' + _enc(pod) + b',"total":',
                   b',"rank":' + _enc(rank) + b',"state":' + _enc(state) + b',"factor":' + _enc(factor) +
                   b',"load":') for _slot, pod, rank, state, factor, _pi in rows)
    return (frags, tuple(_enc(name) + b":" for _, name, _ in stages),
            array("I", [pods[p] for p in sorted(pods)]).tobytes(),
            b"".join(struct.pack("=iid", slot, pi, float(factor)) for slot, _pod, _rank, _state, factor, pi in rows))


class Scorer:
    def __init__(self, config: RouterConfig, endpoints: Endpoints, index: Index, stats: RouterStats,
                 accel=None) -> None:
        self._cfg = config
        self._bs = config.block_size
        self.eps = endpoints
        self.index = index
        self._accel = accel  #: the native backend's C table access (consumers.index.accelerator), or None
        self._stats = stats
        self._cplan: tuple = (None, None)  # (the endpoints' plan, score_pods' plan built from it)
        self._model_json: dict[str, bytes] = {}  # model -> its JSON string (score_json's answer)

    def _pods_plan(self, plan: tuple) -> tuple:
        """score_pods' and score_json's plan for the endpoints' ``plan`` (rebuilt when that changes)."""
        cached = self._cplan
        if cached[0] is plan:
            return cached[1]
        stages, lanes, start, eps = plan
        pods: dict[str, int] = {}
        rows = tuple((ep.slot, ep.pod, ep.rank, state, factor, pods.setdefault(ep.pod, len(pods)))
                     for ep, state, factor in eps if factor > 0)
        lw = self._cfg.load_weight
        cplan = (lanes, start, rows, tuple(n for _, n, _ in stages), tuple(float(w) for _, _, w in stages),
                 float(lw), Score, self._bs) + _json_plan(rows, pods, stages)
        self._cplan = (plan, cplan)
        return cplan

    def score(self, tokens: object, lora_name: str | None = None, *, model: str | None = None,
              load: Mapping[str, float] | None = None) -> dict[str, Score]:
        """Pod -> :class:`Score` for every pod of ``model`` not excluded by its state: in one C
        call (``score_pods``, consumers/_fp_score_pods.h) over the native index, else
        :meth:`score_py`, the reference the C call is tested against."""
        accel = self._accel
        if accel is None:
            return self.score_py(tokens, lora_name, model=model, load=load)
        toks = _toks(tokens)
        model = self.eps.model_for_query(model)
        plan = self.eps.plan(model)
        out, top = _FAST.score_pods(accel.table, toks, model_seed(model, lora_name), self._bs, self._pods_plan(plan),
                                    load if load is None or type(load) is dict else dict(load))
        self._count(len(toks), None if top is None else top.tokens_by_tier)
        return out

    def score_py(self, tokens: object, lora_name: str | None = None, *, model: str | None = None,
                 load: Mapping[str, float] | None = None) -> dict[str, Score]:
        """:meth:`score` in Python over the Index role (any backend): chain_keys, the index's
        match, then per endpoint its tokens by tier, total and Score."""
        toks = as_token_list(tokens)
        model = self.eps.model_for_query(model)
        stages, _lanes, _start, eps = self.eps.plan(model)
        keys = chain_keys(toks, model_seed(model, lora_name), self._bs)
        segments, ends = self.index.match(keys, [t for t, _, _ in stages], [ep.slot for ep, _, f in eps if f > 0])
        n_keys = len(keys)
        C = self._bs
        n_tokens = max(1, len(toks))
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
                total = 0.0 - lw * pod_load  # (never -0.0)
                prev = out.get(pod)
                if prev is None or total > prev.total:
                    out[pod] = s = Score(pod, total, {}, 0, ep.rank, state, factor, pod_load)
                    if better(s, top):
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
            prev = out.get(pod)
            if prev is None or total > prev.total:
                out[pod] = s = Score(pod, total, by_tier, end * C, ep.rank, state, factor, pod_load)
                if better(s, top):
                    top = s
        self._count(len(toks), None if top is None else top.tokens_by_tier)
        return out

    def score_json(self, tokens: object, lora_name: str | None = None, *, model: str | None = None,
                   load: Mapping[str, float] | None = None) -> bytes | None:
        """The service's ``/v1/score`` answer as JSON bytes — ``{"model", "prompt_tokens", "pick",
        "pods"}``, :meth:`score`'s Scores sorted by (-total, load, pod) — in one C call
        (``consumers/_fp_score_answer.h``), counted like :meth:`score`. None where the index is
        not the native one (no C table to walk): the caller then encodes :meth:`score`'s
        Scores, the reference these bytes are tested against."""
        accel = self._accel
        if accel is None:
            return None
        toks = _toks(tokens)
        model = self.eps.model_for_query(model)
        plan = self.eps.plan(model)
        model_json = self._model_json.get(model)
        if model_json is None:
            model_json = _enc(model)
            if len(self._model_json) < 64:  # the fleet's models (a query's unknown one is refused before)
                self._model_json[model] = model_json
        res = _FAST.score_json(accel.table, toks, model_seed(model, lora_name), self._bs, self._pods_plan(plan),
                               model_json, load if load is None or type(load) is dict else dict(load))
        self._count(len(toks), res[1])
        return res[0]

    def _count(self, prompt_tokens: int, top_tiers: dict[str, int] | None) -> None:
        """The lookup counters: one lookup, its tokens, and the pick's matched tokens by tier."""
        stats = self._stats
        stats.lookups += 1
        stats.prompt_tokens += prompt_tokens
        if top_tiers is not None:
            matched = stats.matched_tokens
            for tier, n in top_tiers.items():
                matched[tier] = matched.get(tier, 0) + n

    def pick(self, tokens: object, lora_name: str | None = None, *, model: str | None = None,
             load: Mapping[str, float] | None = None) -> str | None:
        """The pod with the highest total (ties: lower load, then name); None if none is eligible."""
        top = best(self.score(tokens, lora_name, model=model, load=load))
        return None if top is None else top.pod

    def explain(self, tokens: object, lora_name: str | None = None, *,
                model: str | None = None) -> dict[str, list[Explanation]]:
        """Pod -> one :class:`Explanation` per data-parallel rank: what matched, tier by tier,
        and why the match ended."""
        toks = as_token_list(tokens)
        model = self.eps.model_for_query(model)
        keys = chain_keys(toks, model_seed(model, lora_name), self._bs)
        stages, _lanes, _start, plan_eps = self.eps.plan(model)
        index = self.index
        tiers = [t for t, _, _ in stages]
        segments, ends = index.match(keys, tiers, [ep.slot for ep, _, f in plan_eps if f > 0])
        mine = [ep.slot for ep, _, _ in plan_eps]
        alone_ends = {t: index.match(keys, [t], mine) for t in tiers}  # each tier by itself
        C = self._bs
        out: dict[str, list[Explanation]] = {}
        for ep in sorted(self.eps, key=lambda e: (e.pod, e.rank)):
            if ep.model != model:
                continue
            state, factor = self.eps.state_factor(ep)
            alone: dict[str, int] = {}
            for t, name, _w in stages:
                held_segs, held_ends = alone_ends[t]
                alone[name] = held_ends.get(ep.slot, 0) * C if ep.slot in held_segs else 0
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
                at = keys[end: end + 1]
                held = [name for t, name, _w in stages if index.match(at, [t], [ep.slot])[0]]
                where = f"tokens {end * C}..{(end + 1) * C - 1}"
                if held:
                    reason = (f"block {end} ({where}) is only in tier(s) {held}, above the tier the "
                              "match had moved down to")
                elif not index.match(at, range(len(self.eps.tiers)), [e.slot for e in self.eps])[0]:
                    reason = f"block {end} ({where}) is not indexed for any pod"
                else:
                    reason = f"block {end} ({where}) is in no tier of this pod"
            if ep.unreliable and factor > 0:
                left = self.eps.uncertain.get(ep.pod)
                reason += (f"; discounted x{factor:g}: events were lost for good, "
                           + (f"{left} more batches to re-learn" if left else "until a reset or clear"))
            out.setdefault(ep.pod, []).append(Explanation(
                ep.pod, ep.rank, state, factor, end * C if factor > 0 else 0, segs, alone, ended, reason,
                len(keys), {"relearn_batches_left": self.eps.uncertain.get(ep.pod)} if ep.unreliable else {}))
        return out
