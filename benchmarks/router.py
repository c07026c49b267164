"""Router benchmark: ingest rate vs decode-only, score latency, bytes per entry.

    python benchmarks/router.py            # full size (1M indexed blocks)
    python benchmarks/router.py --quick    # small, for a smoke run
    python benchmarks/router.py --dynamo-python DIR/dynamo/bin/python   # the peer from elsewhere

Runs on one core (the process pins itself to CPU 0 where it can). Ingest is
``KVRouter.apply_payload`` (payload bytes in, the C fast path where it is built); the table
also shows ``apply(decode_batch(payload))`` (Python event objects). Targets (issue 4):
ingest >= 80% of the decode-only rate; score p99 <= 200 us for a 4,096-token prompt over
64 pods x 2 tiers with 1M indexed blocks; <= 64 bytes per indexed (block, pod, tier).

Peer: NVIDIA Dynamo's ``RadixTree`` (``dynamo._core``, runtime 1.6.1 from
``../shared/peers/setup-routers.sh DIR``) runs in its own interpreter as a child process
(``--dynamo-python PATH``, else ``$KVEVENTS_DYNAMO_PY``, else ``../peers/dynamo/bin/python``;
absent: its cells say "skipped: not installed"), pinned to the same core, fed the same events
converted to its JSON form (``benchmarks/_dynamo_peer.py`` says how), its rounds interleaved
with ours (a fresh child for the index, so its RSS growth is its own). Before the score and
memory figures are printed both sides must agree on the match length of every (pod, tier) for a
sample of prompts (the ingest rounds' events go through the same conversion); a mismatch stops
the run. Memory: ours by tracemalloc, Dynamo's Rust heap by glibc's ``malloc_info`` over every
arena (bytes in use), and both as RSS growth while the index is built.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import random
import statistics
import sys
import tempfile
import time
import tracemalloc

from consumers import KVRouter, RouterConfig, fastpath_status
from consumers.keys import chain_keys, chain_keys_py
from kvevents import BlockRemoved, BlockStored, KVEventBatch, decode_batch, encode_batch

# our side of the peer only: it never imports dynamo (as a script, this folder is sys.path[0];
# imported as benchmarks.router, e.g. by service.py, it is a sibling module)
if __package__:
    from . import _dynamo_peer as dyn
else:
    import _dynamo_peer as dyn

BS = 16


def pin_one_core() -> str:
    try:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
        return "pinned to 1 core"
    except (AttributeError, OSError):
        return "not pinned"


def gpu_payloads(rnd: random.Random, n_batches: int, events: int, blocks: int):
    """Each event continues one request by ``blocks`` blocks of 16 tokens (vLLM-like)."""
    payloads, offload = [], []
    for _ in range(n_batches):
        evs, offs = [], []
        for _ in range(events):
            hs = [rnd.getrandbits(63) for _ in range(blocks)]
            evs.append(BlockStored(hs, None, [rnd.randrange(150_000) for _ in range(blocks * BS)], BS, None,
                                   "GPU", None))
            offs.append(BlockStored(hs, None, [], 0, None, "CPU", None))
        payloads.append(encode_batch(KVEventBatch(time.time(), evs, 0)))
        offload.append(encode_batch(KVEventBatch(time.time(), offs, 0)))
    return payloads, offload


def cpu_time(fn) -> float:
    gc.collect()
    t = time.process_time()
    fn()
    return time.process_time() - t


def bench_ingest(rnd, n_batches, events, blocks, rounds, peer, tmp):
    """Rounds that each time decode-only, ``apply(decode_batch(...))``, ``apply_payload`` and
    Dynamo's ``apply_event`` (its own process, the same events) back to back, so a noisy
    neighbour hits all alike; per-round ratios, medians."""
    gpu, off = gpu_payloads(rnd, n_batches, events, blocks)
    n_events = n_batches * events
    if peer is not None:  # the same events, converted once (untimed)
        for name, payloads in (("gpu", gpu), ("off", off)):
            feed = dyn.Feed(os.path.join(tmp, f"ingest-{name}.bin"))
            for p in payloads:
                feed.add(0, decode_batch(p))
            if peer.call("load", name=name, path=feed.close())["events"] != n_events:
                raise SystemExit("Dynamo peer: event count differs after conversion")

    def decode_only(ps):
        for p in ps:
            decode_batch(p)

    def ingest_gpu(raw: bool):
        r = KVRouter(RouterConfig(model="m"))
        if raw:
            for p in gpu:
                r.apply_payload("pod", p)
        else:
            for p in gpu:
                r.apply("pod", decode_batch(p))
        return r

    def ingest_off(r, raw: bool):
        if raw:
            for p in off:
                r.apply_payload("pod", p)
        else:
            for p in off:
                r.apply("pod", decode_batch(p))

    def timed_off(raw: bool) -> float:
        r = ingest_gpu(raw)  # the GPU events the offloads join with (not timed)
        return cpu_time(lambda: ingest_off(r, raw))

    def peer_round(name, base=None):
        return None if peer is None else peer.call("ingest", name=name, base=base)["cpu"]

    rows = []
    for name, dec_fn, obj_fn, raw_fn, peer_fn in (  # each returns the CPU seconds of what it measures
        (f"GPU BlockStored ({blocks} x 16 tokens/event)", lambda: cpu_time(lambda: decode_only(gpu)),
         lambda: cpu_time(lambda: ingest_gpu(False)), lambda: cpu_time(lambda: ingest_gpu(True)),
         lambda: peer_round("gpu")),
        (f"offload BlockStored CPU ({blocks} hashes/event)", lambda: cpu_time(lambda: decode_only(off)),
         lambda: timed_off(False), lambda: timed_off(True), lambda: peer_round("off", "gpu")),
    ):
        dec, obj, raw, dy = [], [], [], []
        for _ in range(rounds):
            dec.append(dec_fn())
            obj.append(obj_fn())
            raw.append(raw_fn())
            dy.append(peer_fn())
        ratios = sorted(d / r for d, r in zip(dec, raw))
        row = [name, n_events / statistics.median(dec), n_events / statistics.median(obj),
               n_events / statistics.median(raw), statistics.median(ratios), ratios[0], ratios[-1], None]
        if peer is not None:
            vs = sorted(d / r for d, r in zip(dy, raw))  # ours per CPU-second / Dynamo's
            row[-1] = (n_events / statistics.median(dy), statistics.median(vs), vs[0], vs[-1])
        rows.append(row)
    return rows


def make_docs(rnd, n_blocks, doc_blocks=256):
    """Documents of ``doc_blocks`` blocks: (token ids, engine hashes)."""
    docs = [([rnd.randrange(150_000) for _ in range(doc_blocks * BS)], [rnd.getrandbits(63) for _ in range(doc_blocks)])
            for _ in range(n_blocks // doc_blocks)]
    return docs


def index_batches(docs, pods, rnd, doc_blocks=256):
    """(pod, batch) pairs: each document on 2 pods' GPU (one of them cut short) and on a third
    pod's CPU (its GPU copy of the first half evicted)."""
    for tokens, hashes in docs:
        hashes = [int.from_bytes(h.to_bytes(8, "little"), "little") for h in hashes]  # fresh ints, as decoded
        step = 16  # events of 16 blocks, chained
        events = [BlockStored(hashes[i:i + step], hashes[i - 1] if i else None, tokens[i * BS:(i + step) * BS],
                              BS, None, "GPU", None) for i in range(0, doc_blocks, step)]
        p1, p2, p3 = rnd.sample(range(pods), 3)
        yield p1, KVEventBatch(0.0, events, 0)
        cut = rnd.randrange(doc_blocks // 2, doc_blocks)
        yield p2, KVEventBatch(0.0, events, 0)
        yield p2, KVEventBatch(0.0, [BlockRemoved(hashes[cut:], "GPU")], 0)
        yield p3, KVEventBatch(0.0, events + [BlockStored(hashes, None, [], 0, None, "CPU", None),
                                             BlockRemoved(hashes[: doc_blocks // 2], "GPU")], 0)


def build_index(docs, pods, seed):
    r = KVRouter(RouterConfig(model="m", max_entries=1 << 24))
    for p, batch in index_batches(docs, pods, random.Random(seed)):
        r.apply(f"pod{p}", batch)
    for p in range(pods):  # every pod known even if it got no document
        r.apply(f"pod{p}", KVEventBatch(0.0, [], 0))
    return r


def make_prompts(docs, rnd, n_queries):
    prompts = []
    for i in range(n_queries):
        doc = docs[rnd.randrange(len(docs))][0]
        if i % 2:  # half: a cached prefix then new tokens
            cut = rnd.randrange(1, len(doc))
            prompts.append(doc[:cut] + [rnd.randrange(150_000) for _ in range(len(doc) - cut)])
        else:
            prompts.append(doc)
    return prompts


def score_latencies(r, prompts):
    lat = []
    for prompt in prompts:
        best = float("inf")
        for _ in range(3):  # min of 3: drops preemption and cache-cold noise on a shared machine
            t = time.perf_counter()
            r.score(prompt)
            best = min(best, time.perf_counter() - t)
        lat.append(best)
    return lat


def pct(lat, q):
    lat = sorted(lat)
    return lat[min(len(lat) - 1, int(len(lat) * q))] * 1e6


def check_matches(r, peer, prompts, n_sample):
    """Both sides' match length, in blocks, for every (pod, tier) of a sample of prompts; any
    difference stops the run (the conversion would be wrong, and so every Dynamo figure)."""
    idx = list(range(0, len(prompts), max(1, len(prompts) // n_sample)))
    theirs = peer.call("matches", indices=idx)["matches"]
    nonzero = 0
    for i, got in zip(idx, theirs):
        ours = {}
        for pod, exps in r.explain(prompts[i]).items():
            for e in exps:
                for tier, toks in e.alone.items():
                    if toks and tier in dyn.TIERS:
                        ours[2 * int(pod[3:]) + dyn.TIERS[tier]] = toks // BS
        dy = {w: n for w, _rank, n in got if n}
        if ours != dy:
            diff = {w: (ours.get(w), dy.get(w)) for w in sorted(set(ours) | set(dy)) if ours.get(w) != dy.get(w)}
            raise SystemExit(f"Dynamo conversion check FAILED on prompt {i}: worker -> (ours, Dynamo) blocks {diff}")
        nonzero += len(ours)
    if not nonzero:
        raise SystemExit("Dynamo conversion check matched nothing on either side: the check proves nothing")
    return len(idx), nonzero


def bench_keys(rnd):
    toks = [rnd.randrange(150_000) for _ in range(4096)]
    n = 300
    t = time.process_time()
    for _ in range(n):
        chain_keys(toks, 1, BS)
    ours = (time.process_time() - t) / n * 1e6
    t = time.process_time()
    for _ in range(n):
        chain_keys_py(toks, 1, BS)
    pure = (time.process_time() - t) / n * 1e6

    def blake():
        k = b"\0" * 8
        for i in range(0, 4096, BS):
            k = hashlib.blake2b(k + repr(toks[i:i + BS]).encode(), digest_size=8).digest()

    t = time.process_time()
    for _ in range(n // 3):
        blake()
    peer = (time.process_time() - t) / (n // 3) * 1e6
    try:  # what handing the tokens to numpy alone costs (a vectorised hash would start there)
        import numpy as np
    except ImportError:  # pragma: no cover
        return ours, pure, peer, None
    t = time.process_time()
    for _ in range(n):
        np.fromiter(toks, dtype=np.int64, count=len(toks))
    conv = (time.process_time() - t) / n * 1e6
    return ours, pure, peer, conv


def start_peer(flag):
    """(peer or None, what its cells say)."""
    python = dyn.find_python(flag)
    if python is None or not os.path.exists(python):
        return None, "skipped: not installed"
    try:
        peer = dyn.DynamoPeer(python)
    except (dyn.PeerError, OSError) as e:
        return None, f"skipped: {e}"
    return peer, f"ai-dynamo-runtime {peer.hello['version']} ({python})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--blocks", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=9, help="interleaved ingest rounds (default 9)")
    ap.add_argument("--queries", type=int, default=None, help="score prompts (default 2,000; --quick 400)")
    ap.add_argument("--dynamo-python", default=None,
                    help="Dynamo's interpreter (else $KVEVENTS_DYNAMO_PY, else ../peers/dynamo/bin/python)")
    args = ap.parse_args()
    where = pin_one_core()  # before the peer starts: it inherits the core
    peer, peer_note = start_peer(args.dynamo_python)
    slot = {"peer": peer}  # run() swaps in a fresh peer process for the index
    try:
        with tempfile.TemporaryDirectory(prefix="kvrouter-bench-") as tmp:
            run(args, where, slot, peer_note, tmp)
    finally:
        if slot["peer"] is not None:
            slot["peer"].close()
    if any(m == "dynamo" or m.startswith("dynamo.") for m in sys.modules):
        raise SystemExit("this process imported dynamo: the peer must run in its own interpreter only")


def run(args, where, slot, peer_note, tmp) -> None:
    peer = slot["peer"]
    rnd = random.Random(7)
    n_blocks = args.blocks or (65_536 if args.quick else 1 << 20)
    print(f"# router benchmark ({where}; {n_blocks} indexed blocks, 64 pods; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())})")
    print(f"peer: Dynamo RadixTree: {peer_note}")
    skip = peer_note if peer is None else None

    ours, pure, blake, conv = bench_keys(rnd)
    print(f"\nkeys for a 4,096-token prompt: chain_keys {ours:.1f} us (pure-Python tuple-hash chain {pure:.0f} us), "
          f"blake2b chain {blake:.0f} us"
          + ("" if conv is None else f"; np.fromiter of the tokens alone {conv:.0f} us"))

    rounds = 3 if args.quick else args.rounds
    print(f"\ningest path: {fastpath_status()}; {rounds} interleaved rounds, medians of CPU time (ratio: median of "
          "the per-round ratios [min..max]); Dynamo: `apply_event` of one pre-built JSON event per call, in its "
          "own process")
    print("\n| ingest | decode-only events/s (limit) | decode + apply() events/s | apply_payload() events/s | "
          "ingest / decode-only | target | met | Dynamo apply_event() events/s | apply_payload / Dynamo |")
    print("| --- | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: |")
    nb = 300 if args.quick else 2000
    for name, dec, obj, raw, ratio, lo, hi, dy in bench_ingest(rnd, nb, 4, 4, rounds, peer, tmp):
        dcell = (f"{dy[0]:,.0f} ({1e6 / dy[0]:.2f} us CPU/event) | {dy[1]:.2f}x [{dy[2]:.2f}..{dy[3]:.2f}]"
                 if dy else f"{skip} | -")
        print(f"| {name} | {dec:,.0f} | {obj:,.0f} ({obj / dec:.0%}) | {raw:,.0f} | {ratio:.0%} [{lo:.0%}..{hi:.0%}] "
              f"| >= 80% | {'yes' if ratio >= 0.8 else 'NO'} | {dcell} |")

    docs = make_docs(rnd, n_blocks)
    seed = rnd.getrandbits(32)
    prompts = make_prompts(docs, rnd, args.queries or (400 if args.quick else 2000))
    if peer is not None:  # a fresh process for the index (its RSS not reused from the ingest rounds' trees);
        peer.close()  # the same events and prompts, written before anything is measured
        slot["peer"] = None
        peer = slot["peer"] = dyn.DynamoPeer(peer.python)
        feed = dyn.Feed(os.path.join(tmp, "index.bin"))
        for p, batch in index_batches(docs, 64, random.Random(seed)):
            feed.add(p, batch)
        peer.call("prompts", path=dyn.write_prompts(os.path.join(tmp, "prompts.bin"), prompts))
        built = peer.call("build", path=feed.close())
    gc.collect()
    rss0 = dyn.rss(trim=True)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    t = time.process_time()
    r = build_index(docs, 64, seed)
    build_s = time.process_time() - t
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    rss_ours = dyn.rss() - rss0
    entries = r.entries()
    rep = r.memory_report()
    print(f"\nindex: {rep['keys']:,} keys, {entries:,} (block, pod, tier) entries, {rep['learned']:,} learned "
          f"engine hashes; built in {build_s:.1f} s CPU (under tracemalloc)")
    if peer is not None:
        n, nz = check_matches(r, peer, prompts, 64)
        print(f"Dynamo: {built['events']:,} JSON events (worker = 2 x pod + tier) built its tree in {built['cpu']:.1f} s "
              f"CPU (conversion included); conversion check: {n} prompts, {nz} (pod, tier) match lengths equal")

    lat, dlat, dfind, ratios = [], [], [], []
    chunk = max(1, len(prompts) // 8)  # ours and Dynamo alternate on chunks of the same prompts
    for i in range(0, len(prompts), chunk):
        mine = score_latencies(r, prompts[i:i + chunk])
        lat += mine
        if peer is not None:
            got = peer.call("score", start=i, stop=i + chunk)
            dlat += got["full"]
            dfind += got["find"]
            ratios.append(pct(got["full"], 0.5) / pct(mine, 0.5))
    p50, p99 = pct(lat, 0.5), pct(lat, 0.99)
    bpe = used / entries

    def vs(theirs, mine, better, worse):
        return f"{theirs / mine:.2f}x {better}" if theirs >= mine else f"{mine / theirs:.2f}x {worse}"

    ratios.sort()
    print(f"\nscore: {len(prompts):,} prompts of 4,096 tokens (half a cached document, half a cached prefix then new "
          f"tokens), best of 3 each, {len(range(0, len(prompts), chunk))} alternating chunks; ours `KVRouter.score` "
          "(64 pods x 2 tiers, tier-staged), Dynamo `find_matches(compute_block_hash_for_seq(tokens, 16))` "
          "(128 workers)")
    print("\n| measure | ours | target | met | Dynamo RadixTree | ours vs Dynamo |")
    print("| --- | ---: | --- | --- | ---: | ---: |")
    if dlat:
        d50, d99 = pct(dlat, 0.5), pct(dlat, 0.99)
        print(f"| score p50, 4,096 tokens, 64 pods x 2 tiers | {p50:.0f} us | | | {d50:.0f} us (find_matches alone "
              f"{pct(dfind, 0.5):.0f}) | {vs(d50, p50, 'faster', 'slower')} (per chunk [{ratios[0]:.2f}..{ratios[-1]:.2f}]) |")
        print(f"| score p99 | {p99:.0f} us | <= 200 us | {'yes' if p99 <= 200 else 'NO'} | {d99:.0f} us (find_matches "
              f"alone {pct(dfind, 0.99):.0f}) | {vs(d99, p99, 'faster', 'slower')} |")
    else:
        print(f"| score p50, 4,096 tokens, 64 pods x 2 tiers | {p50:.0f} us | | | {skip} | - |")
        print(f"| score p99 | {p99:.0f} us | <= 200 us | {'yes' if p99 <= 200 else 'NO'} | {skip} | - |")
    dcell = (f"{built['heap_delta'] / entries:.1f} (glibc malloc_info, every arena) | "
             f"{vs(built['heap_delta'], used, 'less', 'more')}" if peer is not None else f"{skip} | -")
    print(f"| bytes per (block, pod, tier) entry (ours tracemalloc, everything) | {bpe:.1f} | <= 64 | "
          f"{'yes' if bpe <= 64 else 'NO'} | {dcell} |")
    dcell = (f"{built['rss_delta'] / entries:.1f} | {vs(built['rss_delta'], rss_ours, 'less', 'more')}"
             if peer is not None else f"{skip} | -")
    print(f"| RSS growth while building, per entry | {rss_ours / entries:.1f} | | | {dcell} |")
    print(f"| bytes per entry (getsizeof estimate: masks {rep['bytes_masks'] / entries:.1f}, parents "
          f"{rep['bytes_parents'] / entries:.1f}, learned {rep['bytes_learned'] / entries:.1f}; "
          f"{rep['distinct_masks']:,} distinct masks) | {rep['bytes_per_entry']:.1f} | | | | |")


if __name__ == "__main__":
    main()
