"""Consistent sequence-based trace sampling, decided by our hooks before any OpenTelemetry call.

A Python SDK span costs tens of microseconds when sampled and several when the SDK's
sampler drops it (the span object, the attribute dict, the context and the sampler call are
all paid before the decision), so a span per batch cannot fit the 5% hot-path budget. Our
hooks therefore decide first, from the batch's sequence number alone:

    a batch is traced  iff  seq % sample_every == 0

Because the rule depends only on the seq the publisher stamped on the wire, the publisher
(send span), every subscriber (receive span) and every router (process span), in any process,
trace the *same* batches, so a sampled trace is complete end to end without propagating a
trace context on the wire. The engine's step span follows the seq the step will publish
(``publisher.next_seq`` at step start), the manager's ``schedule_end`` span and transfer-job
spans follow their step (a job finishing later is traced iff it was submitted in a traced
step), and router score spans are taken one call in ``sample_every`` by a counter. Rare events
(gap recovery, replay served, resets and gaps delivered to the router) are always traced.

The same rule, with its own period, thins the two per-item histograms, the subscriber's lag
and the manager's job latency (:data:`DEFAULT_HISTOGRAM_SAMPLE_EVERY`): counters are plain
ints read at collection time, but a histogram point is an SDK call per value.

An untraced batch costs an integer modulo in the hook: no OpenTelemetry call, no context
capture, no allocation.

``sample_every=1`` traces everything. The default comes from the ``KVEVENTS_TRACE_SAMPLE_EVERY``
environment variable, else :data:`DEFAULT_SAMPLE_EVERY`; processes that trace one pipeline
together must use the same value (their sampled seqs then coincide). Configure the SDK's own
sampler as ALWAYS_ON (its default, parent-based) on top: a ratio sampler would split each
process's traces independently again.
"""

from __future__ import annotations

import os

__all__ = ["DEFAULT_HISTOGRAM_SAMPLE_EVERY", "DEFAULT_SAMPLE_EVERY", "ENV_VAR", "check_every",
           "resolve_sample_every", "sampled"]

#: one batch in 1024 traced by default. A sampled span costs 25-100 µs of CPU when spans are
#: frequent, but a rare span runs with cold caches: 130-330 µs in place, measured inside the
#: benchmark's paths (about 95 Python calls in the SDK per send span). The cheapest paths cost
#: 11-16 µs per operation (publisher send, router score), so 1/1024 keeps the amortized span
#: cost near 1-2%, leaving room for the unsampled hooks and the metrics within 5%
#: (benchmarks/telemetry_overhead.py). At 1000 batches/s that is still ~1 complete trace/s
#: per publisher; set KVEVENTS_TRACE_SAMPLE_EVERY lower where the rate is low.
DEFAULT_SAMPLE_EVERY = 1024
ENV_VAR = "KVEVENTS_TRACE_SAMPLE_EVERY"

#: the two per-item histograms record one item in 32: the subscriber's lag the batches with
#: ``seq % 32 == 0``, the manager's job latency every 32nd job submitted per (tier, direction).
#: One SDK histogram record costs 10-25 µs in place (cold caches: measured inside the
#: benchmark), as much as a batch's receive+decode or a tenth of a simulated step; a sample
#: chosen by sequence is unbiased for the quantiles and means the dashboards show. 1 records all.
DEFAULT_HISTOGRAM_SAMPLE_EVERY = 32


def resolve_sample_every(value: int | None = None) -> int:
    """``value``, else ``$KVEVENTS_TRACE_SAMPLE_EVERY``, else :data:`DEFAULT_SAMPLE_EVERY`;
    ValueError unless it is a positive int."""
    if value is None:
        env = os.environ.get(ENV_VAR, "").strip()
        if not env:
            return DEFAULT_SAMPLE_EVERY
        try:
            value = int(env)
        except ValueError:
            raise ValueError(f"{ENV_VAR} must be a positive integer, got {env!r}") from None
        return check_every(value, ENV_VAR)
    return check_every(value, "sample_every")


def check_every(value: int, what: str) -> int:
    """``value`` if it is a positive int, else ValueError naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive integer (1: every item), got {value!r}")
    return value


def sampled(seq: int, sample_every: int) -> bool:
    """The rule itself, for tools and tests: is the batch ``seq`` traced?"""
    return seq % sample_every == 0
