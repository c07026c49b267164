"""The ``demo --serve`` load generator: the demo workload as real HTTP through the router proxy."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import TextIO

import msgspec

from .workload import Workload, WorkloadConfig

__all__ = ["LoadReport", "drive", "send_load"]


@dataclass
class LoadReport:
    sent: int = 0
    ok: int = 0
    streamed: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    by_pod: dict[str, int] = field(default_factory=dict)
    matched_tokens: int = 0
    prompt_tokens: int = 0
    latencies: list[float] = field(default_factory=list)

    def pct(self, q: float) -> float:
        if not self.latencies:
            return 0.0
        xs = sorted(self.latencies)
        return xs[min(len(xs) - 1, int(q * len(xs)))]


async def send_load(url: str, model: str, duration: float, seed: int, *, concurrency: int = 8,
                    stream_every: int = 4, max_requests: int | None = None) -> LoadReport:
    """Send the workload's requests to ``url``/v1/completions for ``duration`` seconds."""
    import aiohttp

    wl = Workload(WorkloadConfig(seed=seed))
    rep = LoadReport()
    end = time.monotonic() + duration
    counter = iter(range(1 << 62))

    async def worker(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < end and (max_requests is None or rep.sent < max_requests):
            k = next(counter)
            req = wl.next_request()
            stream = stream_every > 0 and k % stream_every == 0
            body = {"model": model, "prompt": req.tokens, "max_tokens": req.max_new_tokens, "stream": stream}
            rep.sent += 1
            rep.prompt_tokens += len(req.tokens)
            t0 = time.perf_counter()
            try:
                async with session.post(f"{url}/v1/completions", data=msgspec.json.encode(body),
                                        headers={"content-type": "application/json"}) as resp:
                    data = await resp.read()
                    if resp.status != 200:
                        key = f"http_{resp.status}"
                        rep.errors[key] = rep.errors.get(key, 0) + 1
                        continue
                    if stream and not data.rstrip().endswith(b"data: [DONE]"):
                        rep.errors["truncated_stream"] = rep.errors.get("truncated_stream", 0) + 1
                        continue
                    pod = resp.headers.get("x-kvevents-pod", "?")
                    rep.by_pod[pod] = rep.by_pod.get(pod, 0) + 1
                    rep.matched_tokens += int(resp.headers.get("x-kvevents-matched-tokens", "0"))
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                key = type(exc).__name__
                rep.errors[key] = rep.errors.get(key, 0) + 1
                continue
            rep.latencies.append(time.perf_counter() - t0)
            rep.ok += 1
            rep.streamed += stream

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    return rep


def drive(fleet, duration: float, seed: int, out: TextIO, *, concurrency: int = 8, stream_every: int = 4) -> int:
    """Start the router service (proxy mode) in front of ``fleet``, load it, print the outcome."""
    from kvservice.cli import serve
    from kvservice.config import from_dict

    cfg = from_dict(fleet.config(proxy=True)).validate()
    loop = asyncio.new_event_loop()
    started = threading.Event()
    box: dict = {}

    def run() -> None:
        asyncio.set_event_loop(loop)
        box["stop"] = asyncio.Event()

        def announce(line: str) -> None:
            box["url"] = line.split()[4]
            out.write(line + "\n")
            started.set()

        try:
            loop.run_until_complete(serve(cfg, box["stop"], announce=announce))
        except BaseException as exc:  # noqa: BLE001 — reported by the caller's thread
            box["error"] = exc
            started.set()

    t = threading.Thread(target=run, name="kvservice", daemon=True)
    t.start()
    started.wait(30)
    if "error" in box:
        raise box["error"]
    url = box["url"]
    out.write("SIMULATED engines (kvdemo.engine_http: no model runs; real KV events, real HTTP):\n")
    for p in fleet.pods:
        out.write(f"  simulated engine {p.name}: OpenAI API {p.url}, KV events {p.endpoint}\n")
    out.write(f"load: {concurrency} concurrent clients, {duration:g}s, /v1/completions through {url}\n")
    try:
        rep = asyncio.run(send_load(url, fleet.model, duration, seed, concurrency=concurrency,
                                    stream_every=stream_every))
    finally:
        loop.call_soon_threadsafe(box["stop"].set)
        t.join(10)
        loop.close()
    share = rep.matched_tokens / rep.prompt_tokens if rep.prompt_tokens else 0.0
    out.write(f"requests: {rep.sent} sent, {rep.ok} answered ({rep.streamed} streamed), errors {rep.errors or 'none'}\n")
    out.write(f"by pod: {dict(sorted(rep.by_pod.items()))}\n")
    out.write(f"prefix tokens the router found cached at pick time: {rep.matched_tokens} of {rep.prompt_tokens} "
              f"({share:.0%})\n")
    out.write(f"latency through the proxy: p50 {rep.pct(0.5) * 1e3:.1f} ms, p99 {rep.pct(0.99) * 1e3:.1f} ms\n")
    return 0 if rep.ok and not rep.errors else 1
