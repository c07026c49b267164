"""The demo cluster's life: build it, drive it, drain it, account for everything, report.

One thread drives the engines, the router and the subscriber (no locks between them); the
recorder has a thread of its own; each publisher and the fs tiers have theirs.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from consumers import KVRouter, RouterConfig
from consumers.score import best
from kvevents.delivery import DeliveryKind
from kvevents.recorder import Recorder
from kvevents.recording import RecordingWriter
from kvevents.subscriber import PublisherSpec, Subscriber

from . import report
from .nodes import EngineSizing, Node, make_node
from .observe import Telemetry
from .workload import Workload, WorkloadConfig

__all__ = ["DemoOptions", "DemoRun", "execute", "run_demo", "MODEL"]

MODEL = "demo-model"
TIERS = ("GPU", "CPU", "STORAGE")


@dataclass(slots=True)
class DemoOptions:
    duration: float = 5.0
    engines: int = 3
    prometheus_port: int | None = None
    prometheus_host: str = "127.0.0.1"
    otlp: str | None = None
    #: trace one batch in N (by seq, so every stage traces the same batches); the demo's rates
    #: are low enough that 1 in 16 costs little and still gives traces every second
    trace_sample_every: int = 16
    record: str | None = None
    drop_rate: float = 0.01
    seed: int = 0
    baseline: bool = True
    progress_every: float = 1.0
    drain_timeout: float = 5.0


@dataclass(slots=True)
class Tally:
    """Prefix tokens by tier a pick is worth, according to the router's index at pick time."""

    requests: int = 0
    prompt_tokens: int = 0
    GPU: int = 0
    CPU: int = 0
    STORAGE: int = 0

    def add(self, tokens_by_tier: dict[str, int] | None, prompt_tokens: int) -> None:
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        for tier, n in (tokens_by_tier or {}).items():
            if tier in TIERS:
                setattr(self, tier, getattr(self, tier) + n)

    @property
    def total(self) -> int:
        return self.GPU + self.CPU + self.STORAGE


@dataclass(slots=True)
class StreamTally:
    """What the router's subscriber delivered, per publisher."""

    batches: int = 0
    events: int = 0
    replayed: int = 0
    lost: int = 0  #: batches reported lost (GAP deliveries)
    resets: int = 0


class DemoRun:
    def __init__(self, opts: DemoOptions, out: TextIO = sys.stdout) -> None:
        self.opts = opts
        self.out = out
        self.stop = threading.Event()
        self.stopped_by: str | None = None
        self.tmp = Path(tempfile.mkdtemp(prefix="kvdemo-"))
        self.sizing = EngineSizing()
        if opts.record:
            self.record_path = Path(opts.record)
            self.record_is_temp = False
        else:
            fd, name = tempfile.mkstemp(prefix="kvevents-demo-", suffix=".kvrec")
            os.close(fd)
            self.record_path = Path(name)
            self.record_is_temp = True
        self.workload = Workload(WorkloadConfig(seed=opts.seed))
        self.routed = Tally()
        self.shadow_rr = Tally()
        self.cold_picks = 0  #: picks made before the router knew any engine (least loaded instead)
        self.streams: dict[str, StreamTally] = {}
        self.errors: list[str] = []
        self.nodes: list[Node] = []
        self.baseline: list[Node] = []
        self.sub: Subscriber | None = None
        self.recorder: Recorder | None = None
        self._rec_thread: threading.Thread | None = None
        self._rec_stop = threading.Event()
        self.telemetry = Telemetry()

    # ---- set-up ------------------------------------------------------------------------------
    def build(self) -> None:
        o = self.opts
        self.telemetry.start(o.prometheus_port, o.prometheus_host, o.otlp)
        for i in range(o.engines):
            self.nodes.append(make_node(f"engine-{i}", self.tmp, self.sizing, model=MODEL, drop_rate=o.drop_rate,
                                        seed=o.seed * 1000 + i))
            if o.baseline:
                self.baseline.append(make_node(f"rr-{i}", self.tmp, self.sizing, publish=False))
        self.streams = {n.name: StreamTally() for n in self.nodes}
        self.router = KVRouter(RouterConfig(
            block_size=self.sizing.block_size, model=MODEL, load_weight=0.25,
            offload_chunk_blocks={"CPU": self.sizing.offload_block_size // self.sizing.block_size,
                                  "STORAGE": self.sizing.offload_block_size // self.sizing.block_size}))
        # raw: the router decodes the payloads itself (KVRouter.apply_payload, in C where built)
        self.sub = Subscriber([PublisherSpec(n.endpoint, n.replay_endpoint, n.name) for n in self.nodes],
                              late_join=True, raw=True)
        writer = RecordingWriter(self.record_path, meta={
            "source": "kvevents demo", "backfill": True, "engines": [n.name for n in self.nodes],
            "model": MODEL}, flush_every=16)
        self.recorder = Recorder(writer, [n.endpoint for n in self.nodes],
                                 replay_endpoints=[n.replay_endpoint for n in self.nodes], backfill=True)
        self._rec_thread = threading.Thread(target=self._record_loop, name="kvdemo-recorder", daemon=True)
        self._rec_thread.start()
        dead = [name for name, ok in self.sub.probe_replay(2.0).items() if not ok]
        if dead:
            raise RuntimeError(f"replay sockets of {dead} did not answer within 2 s")
        self.telemetry.instrument(self, self.opts.trace_sample_every)

    def _record_loop(self) -> None:
        rec = self.recorder
        while not self._rec_stop.is_set():
            rec.poll_once(50)

    # ---- the loop ----------------------------------------------------------------------------
    def _loads(self) -> dict[str, float]:
        m = self.sizing.max_num_seqs
        return {n.name: n.in_flight / m for n in self.nodes}

    def _admit(self, k: int) -> None:
        req = self.workload.next_request()
        loads = self._loads()
        scores = self.router.score(req.tokens, model=MODEL, load=loads)
        if scores:
            pick_name = best(scores).pod  # (the router's one tie-break)
        else:
            self.cold_picks += 1
            pick_name = min(self.nodes, key=lambda n: (n.in_flight, n.name)).name
        node = next(n for n in self.nodes if n.name == pick_name)
        n_tok = len(req.tokens)
        self.routed.add(scores[pick_name].tokens_by_tier if pick_name in scores else None, n_tok)
        rr = k % len(self.nodes)
        rr_score = scores.get(self.nodes[rr].name)
        self.shadow_rr.add(rr_score.tokens_by_tier if rr_score is not None else None, n_tok)
        node.engine.add_request(req.req_id, req.tokens, max_new_tokens=req.max_new_tokens)
        node.admitted += 1
        node.prompt_tokens += n_tok
        if self.baseline:
            b = self.baseline[rr]
            b.engine.add_request(req.req_id, req.tokens, max_new_tokens=req.max_new_tokens)
            b.admitted += 1
            b.prompt_tokens += n_tok

    def _take(self, deliveries) -> int:
        n = 0
        stats = self.router.stats
        for d in deliveries:
            events_before = stats.events
            self.router.handle(d)
            st = self.streams.get(d.publisher)
            if st is None:
                st = self.streams[d.publisher] = StreamTally()
            if d.kind is DeliveryKind.BATCH:
                st.batches += 1
                st.events += stats.events - events_before  # (raw deliveries: the router counted them)
                st.replayed += d.replayed
                n += 1
            elif d.kind is DeliveryKind.GAP:
                st.lost += d.missed
            else:
                st.resets += 1
        return n

    def loop(self) -> None:
        o = self.opts
        concurrency = max(1, int(len(self.nodes) * self.sizing.max_num_seqs * 1.5))
        self.start = time.monotonic()
        end = self.start + o.duration
        next_progress = self.start + o.progress_every
        k = 0
        polls = 0
        report.header(self)
        while not self.stop.is_set():
            now = time.monotonic()
            if now >= end:
                self.stopped_by = self.stopped_by or "duration"
                break
            admitted = 0
            while admitted < 2 * len(self.nodes):
                busy = sum(n.in_flight for n in self.nodes)
                if self.baseline:
                    busy = max(busy, sum(b.in_flight for b in self.baseline))
                if busy >= concurrency:
                    break
                self._admit(k)
                k += 1
                admitted += 1
            worked = False
            for n in self.nodes + self.baseline:
                if n.engine.has_work():
                    n.engine.step()
                    worked = True
            got = self._take(self.sub.poll(0 if worked else 5))
            polls += 1
            if polls % 32 == 0:
                self.router.refresh_health(self.sub)
            if not worked and not got:
                time.sleep(0.001)  # nothing to do this instant: do not spin the CPU
            if now >= next_progress:
                next_progress += o.progress_every
                report.progress(self, now - self.start)
        self.elapsed = time.monotonic() - self.start

    # ---- the end -----------------------------------------------------------------------------
    def accounted(self) -> bool:
        return all(self.streams[n.name].batches + self.streams[n.name].lost >= n.published() for n in self.nodes)

    def drain(self) -> None:
        """Close the streams, let every published batch reach the router (or be reported lost),
        and let the recorder get everything too."""
        for n in self.nodes:
            n.close_stream()
        deadline = time.monotonic() + self.opts.drain_timeout
        while not self.accounted() and time.monotonic() < deadline:
            self._take(self.sub.poll(50))
        self.router.refresh_health(self.sub)

        def recorder_done() -> bool:
            for n in self.nodes:
                src = self.recorder.sources[n.endpoint]
                if src.high is None or src.high < n.published() - 1 or src.outstanding is not None:
                    return False
            return True

        while not recorder_done() and time.monotonic() < deadline:
            time.sleep(0.01)  # the recorder thread is catching up; poll it with a deadline
        self.recorder_complete = recorder_done()
        self._rec_stop.set()
        self._rec_thread.join(timeout=5.0)
        self.recorder.close()
        self.recorder.writer.close()

    def shutdown(self) -> None:
        self.shutdown_reports = {}
        for n in self.nodes:
            if n.publisher is not None:
                self.shutdown_reports[n.name] = n.publisher.shutdown(timeout=1.0)
        for n in self.nodes + self.baseline:
            n.shutdown_engine()
        if self.sub is not None:
            self.sub.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def abort(self) -> None:
        """Release what was built (a failure during set-up or the run): threads, sockets, files."""
        self._rec_stop.set()
        if self._rec_thread is not None:
            self._rec_thread.join(timeout=5.0)
        if self.recorder is not None:
            self.recorder.close()
            self.recorder.writer.close()
        for n in self.nodes:
            if n.publisher is not None:
                n.publisher.shutdown(timeout=0.1)
        for n in self.nodes + self.baseline:
            n.shutdown_engine()
        if self.sub is not None:
            self.sub.close()
        self.telemetry.shutdown()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def silently_lost(self) -> int:
        return sum(max(0, n.published() - self.streams[n.name].batches - self.streams[n.name].lost)
                   for n in self.nodes)


def run_demo(opts: DemoOptions, out: TextIO = sys.stdout) -> int:
    """Run the demo; the exit code (0: everything accounted for)."""
    return execute(opts, out)[0]


def execute(opts: DemoOptions, out: TextIO = sys.stdout) -> tuple[int, DemoRun]:
    """Run the demo; ``(exit code, the finished run)`` (tests look inside the run).

    SIGTERM and SIGINT (when called from the main thread) end the run early, cleanly, with the
    summary; the previous handlers are restored afterwards.
    """
    run = DemoRun(opts, out)
    previous = {}

    def on_signal(signum, _frame) -> None:
        run.stopped_by = signal.Signals(signum).name
        run.stop.set()

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, on_signal)
    try:
        try:
            run.build()
            run.loop()
            run.drain()
        except BaseException:
            run.abort()
            raise
        run.shutdown()
        telemetry_note = run.telemetry.shutdown()
        code = report.summary(run, telemetry_note)
        if run.stopped_by == "SIGINT" and code == 0:
            code = 130  # interrupted (Ctrl-C), as the README says; the summary is still printed
        return code, run
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
