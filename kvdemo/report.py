"""What the demo prints: a header, a progress line a second, and the summary with the accounting."""

from __future__ import annotations

# ``DemoRun`` and ``Tally`` in annotations are kvdemo.run's, left strings (not imported, not even
# under TYPE_CHECKING): run imports this module, and the floor rules allow no circle.

TIERS = ("GPU", "CPU", "STORAGE")


def _k(n: float) -> str:
    if n >= 1e6:
        return f"{n / 1e6:.1f}M"
    if n >= 1e4:
        return f"{n / 1e3:.0f}k"
    if n >= 1e3:
        return f"{n / 1e3:.1f}k"
    return f"{n:.0f}"


def _pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.0f}%" if whole else "-"


def _print(run: "DemoRun", line: str = "") -> None:
    print(line, file=run.out, flush=True)


def engine_hits(nodes) -> tuple[int, int, int]:
    """(GPU prefix-cache hit tokens, offload hit tokens, prompt tokens admitted), engine-measured."""
    return (sum(n.engine.gpu_hit_tokens for n in nodes), sum(n.engine.offload_hit_tokens for n in nodes),
            sum(n.prompt_tokens for n in nodes))


def header(run: "DemoRun") -> None:
    s, o = run.sizing, run.opts
    _print(run, f"kvevents demo: {len(run.nodes)} simulated engines (GPU {s.gpu_blocks} blocks x {s.block_size} "
                f"tokens, CPU tier {s.cpu_blocks} x {s.offload_block_size}-token chunks, fs tier {s.fs_blocks} "
                f"chunks under {run.tmp}) publishing on ipc:// with replay; a KV-aware router over all of them"
                + (f"; the same requests go round-robin to a shadow cluster of {len(run.baseline)}" if run.baseline
                   else "") + ".")
    _print(run, f"  {o.duration:g}s, {o.drop_rate:.1%} of live batches dropped on purpose to show replay healing; "
                f"recording to {run.record_path}")
    for line in run.telemetry.describe():
        _print(run, "  " + line)


def progress(run: "DemoRun", elapsed: float) -> None:
    st = run.sub.stats()
    events = sum(t.events for t in run.streams.values())
    done = sum(n.engine.requests_finished for n in run.nodes)
    r, rr = run.routed, run.shadow_rr
    line = (f"t={elapsed:4.1f}s req {run.workload.requests} done {done} | events {_k(events)} "
            f"({_k(events / max(elapsed, 1e-9))}/s) | gaps {st['gaps']} healed {st['recovered']} "
            f"lost {st['unrecoverable']} | router hits GPU {_k(r.GPU)} CPU {_k(r.CPU)} STO {_k(r.STORAGE)} "
            f"= {_pct(r.total, r.prompt_tokens)} vs rr {_pct(rr.total, rr.prompt_tokens)}")
    if run.baseline:
        g, off, p = engine_hits(run.nodes)
        bg, boff, bp = engine_hits(run.baseline)
        line += f" | engine hits {_pct(g + off, p)} vs rr cluster {_pct(bg + boff, bp)}"
    _print(run, line)


def _tier_row(name: str, t: "Tally") -> str:
    return (f"    {name:<34}{t.GPU:>10,}{t.CPU:>10,}{t.STORAGE:>10,}{t.total:>11,}"
            f"{_pct(t.total, t.prompt_tokens):>8}")


def index_by_tier(router) -> dict[str, int]:
    """(key, endpoint) entries per tier of the router's index."""
    return router.entries_by_tier()


def summary(run: "DemoRun", telemetry_note: list[str]) -> int:
    w = run.workload
    nodes = run.nodes
    published = sum(n.published() for n in nodes)
    delivered = sum(t.batches for t in run.streams.values())
    events = sum(t.events for t in run.streams.values())
    replayed = sum(t.replayed for t in run.streams.values())
    lost = sum(t.lost for t in run.streams.values())
    st = run.sub.stats()
    silent = run.silently_lost()
    pstats = [n.publisher.stats() for n in nodes]
    live_dropped = sum(p["live_dropped"] for p in pstats)
    overflow = sum(p["overflow"] for p in pstats)
    overflow_lost = sum(p["overflow_lost"] for p in pstats)
    unsent = sum(r.unsent for r in run.shutdown_reports.values())
    engine_pub = sum(n.engine.batches_published for n in nodes)
    _print(run)
    _print(run, f"summary (stopped by {run.stopped_by or 'duration'} after {run.elapsed:.1f}s):")
    finished = sum(n.engine.requests_finished for n in nodes)
    admitted = sum(n.admitted for n in nodes)
    _print(run, f"  workload: {w.requests:,} requests ({w.new_conversations:,} conversations, {w.follow_ups:,} "
                f"follow-ups), {w.prompt_tokens:,} prompt tokens; routed cluster finished {finished:,}, "
                f"{admitted - finished:,} still in flight at the stop; {run.cold_picks} picked by load before "
                f"the router had heard from any engine")
    _print(run, f"  stream: {published:,} batches published by {len(nodes)} engines ({engine_pub:,} with events + "
                f"{published - engine_pub} end-of-stream markers); the router received {delivered:,} "
                f"({events:,} events, {events / max(run.elapsed, 1e-9):,.0f} events/s), {replayed:,} of them by "
                f"replay; live drops injected {live_dropped}, gaps {st['gaps']}, healed by replay "
                f"{st['recovered']}, reported lost {lost}; SILENTLY LOST {silent}")
    _print(run, f"  publishers: queue overflow {overflow} (lost for good {overflow_lost}), unsent at shutdown "
                f"{unsent}; subscriber malformed {st['malformed']}, resets {st['resets']}")
    rs = run.router.stats
    tiers = index_by_tier(run.router)
    errors = sum(rs.errors.values())
    _print(run, "  router: index entries by tier " + ", ".join(f"{t} {tiers.get(t, 0):,}" for t in TIERS)
           + f"; offload events waiting for their GPU event: held {rs.pending_held}, joined "
             f"{rs.pending_resolved}, expired {rs.pending_expired}, dropped {rs.pending_dropped}, cancelled "
             f"{rs.pending_cancelled}; removals of unknown blocks {rs.remove_unknown}; bad input {errors}"
           + (f" {dict(rs.errors)}" if errors else ""))
    _print(run, "  prefix tokens by tier, from the router's index at pick time:")
    _print(run, f"    {'':<34}{'GPU':>10}{'CPU':>10}{'STORAGE':>10}{'total':>11}{'prompt':>8}")
    _print(run, _tier_row("KV-aware router", run.routed))
    _print(run, _tier_row("round-robin (same index, shadow)", run.shadow_rr))
    if run.baseline:
        g, off, p = engine_hits(nodes)
        bg, boff, bp = engine_hits(run.baseline)
        _print(run, "  prefix hits measured by the engines (GPU prefix cache; CPU+fs offload tiers):")
        _print(run, f"    {'':<34}{'GPU':>10}{'offload':>10}{'':>10}{'total':>11}{'prompt':>8}")
        _print(run, f"    {'KV-aware router cluster':<34}{g:>10,}{off:>10,}{'':>10}{g + off:>11,}{_pct(g + off, p):>8}")
        _print(run, f"    {'round-robin cluster':<34}{bg:>10,}{boff:>10,}{'':>10}{bg + boff:>11,}"
                    f"{_pct(bg + boff, bp):>8}")
    cpu = [n.primary for n in nodes]
    fs = [n.fs for n in nodes]
    _print(run, f"  offload tiers (router cluster): CPU stores {sum(c.stores_completed for c in cpu):,}, loads "
                f"{sum(c.loads for c in cpu):,}, evictions {sum(c.evictions for c in cpu):,}; fs stores "
                f"{sum(f.stores for f in fs):,}, loads {sum(f.loads for f in fs):,}, evictions "
                f"{sum(f.evictions for f in fs):,}, errors {sum(f.store_errors + f.load_errors for f in fs)}; "
                f"promotions {sum(n.manager.promotions_started for n in nodes):,}, cascades "
                f"{sum(n.manager.cascade_jobs for n in nodes):,}; engine load check failures "
                f"{sum(n.engine.load_verify_failures for n in nodes)}")
    rec_ok, rec_line = _recording_line(run)
    _print(run, "  " + rec_line)
    for line in telemetry_note:
        _print(run, "  " + line)
    problems = []
    if silent:
        problems.append(f"{silent} batches lost without being reported")
    if sum(n.engine.load_verify_failures for n in nodes):
        problems.append("a load brought back the wrong bytes")
    if not rec_ok:
        problems.append("the recording is incomplete")
    problems.extend(run.errors)
    _print(run, "result: " + ("OK" if not problems else "FAILED: " + "; ".join(problems)))
    return 0 if not problems else 1


def _recording_line(run: "DemoRun") -> tuple[bool, str]:
    from kvevents.recordstream import summarize

    try:
        s = summarize(run.record_path)
    except Exception as exc:  # a recording we cannot read is a failure, said plainly
        return False, f"recording: {run.record_path} is NOT readable: {exc}"
    by_ep = {n.endpoint: n for n in run.nodes}
    complete = run.recorder_complete
    batches = unrec = 0
    for ep, p in s["publishers"].items():
        batches += p["batches"]
        unrec += p["unrecovered"]
        node = by_ep.get(ep)
        if node is not None and p["batches"] + p["unrecovered"] < node.published():
            complete = False
    published = sum(n.published() for n in run.nodes)
    kept = "" if not run.record_is_temp else " (a temporary file: move it to keep it)"
    return complete, (f"recording: {run.record_path}{kept}: {s['file']['records']:,} records, "
                      f"{s['file']['bytes']:,} bytes; read back: {batches:,} of {published:,} batches, "
                      f"{unrec} reported lost; replay it with `kvevents replay {run.record_path} ...` or "
                      f"inspect it with `kvevents inspect {run.record_path}`")
