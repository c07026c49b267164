"""The fs tier at the disk's limit: ours vs vLLM's FileSystemTierManager vs a plain loop.

For each block shape (default 2,048 x 256 KiB and 8,192 x 64 KiB), in jobs of 64 blocks, each
system in the same run, rounds interleaved (ours, vLLM, plain, ours, ...), best of N rounds:

* store GB/s: every store job submitted at once, until the last one finished;
* store + sync GB/s: the same bytes over store time + ``os.sync()`` (what the page cache
  still held);
* cold load GB/s: page cache dropped (as root: ``sync; echo 3 > /proc/sys/vm/drop_caches``;
  the table says when that failed), the host buffer zeroed, every load job submitted at once.

The garbage collector runs a full collection before each timed phase, for every system: in
this process (vLLM and torch imported) one takes ~0.25 s, and one that fell inside a 0.3 s load
halved that round's figure. Every round's loaded bytes are compared with what was stored (a mismatch aborts). A round's
stores follow the previous round's deletion of its files, as a tier's stores follow its
evictions: on ext4 without a journal (this VM's root) a new file's inode search skips every
inode of its block group deleted in the last 60 s (``recently_deleted`` in fs/ext4/ialloc.c),
which is why the fs tier spreads its fan-out directories over block groups (``spread_dirs``).
The device row is the limit at this request size: one ``O_DIRECT`` request per block into
one preallocated file, no file per block. The ceiling row reads the device row's file back
buffered as one sequential stream, so readahead keeps multi-MiB disk requests in flight: the
best shape of ``benchmarks/fs_ceiling.py``'s grid (request sizes x queue depths x modes); the
summary prints the best cold load of any row as the ceiling, and where 1.2 x vLLM lies against it. ``--systems ...,jobfiles``
adds two rows of a sketch that is not the tier: a file per store job (its 64 blocks, a header
page before each), read back by one ``preadv`` per job, buffered or ``O_DIRECT`` (what a
multi-block layout would read at, before eviction, compaction, a scan and shared roots). The host
buffer is page-aligned, as a pinned host buffer is. vLLM 0.33 is the peer where ``import vllm``
works (``bash ../shared/peers/setup-vllm.sh DIR``; run this script in that venv with the
project installed editable or on PYTHONPATH); the plain loop is ``os.write`` / ``os.readv``
of each block into its own file (buffered, no header, no checksum, no rename) on 32 threads.

The last three columns (median round) say what a cold load cost: disk read requests per
block and bytes read per byte of payload, from ``/proc/diskstats`` for the device under
``--dir`` (the whole device: anything else reading at the time counts too; above 1 request
per block and 1.0 bytes: metadata (directory blocks, inode tables) and headers), and this
process's CPU seconds (user + system, all threads, ``os.times()``) per GB loaded.

``--backpressure``: the engine's step time with a tier throttled to a fraction of the store
rate, with the default store policy and with ``"unbounded"`` (see ``benchmarks/fs_backpressure.py``).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

if __package__ in (None, ""):  # `python benchmarks/fs_tier.py`: the project root before benchmarks/
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._fs_systems import (JOB, O_DIRECT, Device, JobFiles, JobFilesDirect, JobFilesPerBlock, JobFilesWillneed, Ours, Plain, Sequential, System,
                                    TierSystem, aligned_buffer, disk_reads)
from benchmarks._table import format_table
from manager import make_offload_key
from manager.tiering.fs import FileSystemSecondaryTierManager


def drop_caches() -> str | None:
    """None when the page cache was dropped, else why not."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return None
    except OSError as exc:
        return f"{type(exc).__name__}: {exc.strerror or exc}"


class VLLM(TierSystem):
    name = "vLLM 0.33 FileSystemTierManager (16+16 threads)"

    def setup(self, root: str, host: np.ndarray) -> None:
        from vllm.v1.kv_offload.tiering.base import TransferJob
        from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

        self.TransferJob = TransferJob
        # the parts of an OffloadingSpec its constructor reads (duck-typed: the real one
        # needs a whole vLLM config)
        cfg = SimpleNamespace(
            groups=[SimpleNamespace(tokens_per_block=16, layer_names=["layer0"])],
            parallel=SimpleNamespace(tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, rank=0,
                                     is_parallelism_agnostic=True),
            replicated_layout=False, canonical_layout=False, kv_cache_layout=None,
            model=SimpleNamespace(name="bench", dtype="float16"), cache=SimpleNamespace(tokens_per_hash=16),
        )
        spec = SimpleNamespace(config=cfg, blocks_per_chunk=1,
                               kv_events_config=SimpleNamespace(enable_kv_cache_events=False))
        self.tier = FileSystemTierManager(spec, memoryview(host), "fs", root)  # type: ignore[arg-type]

    def _run(self, keys: list[bytes], n: int, load: bool) -> None:
        t = self.tier
        ctx = SimpleNamespace(req_id="bench")
        jobs = set()
        for j, i in enumerate(range(0, n, JOB)):
            job = self.TransferJob(j, keys[i : i + JOB], np.arange(i, min(i + JOB, n), dtype=np.int64), load, ctx)
            (t.submit_load if load else t.submit_store)(job)
            jobs.add(j)
        while jobs:
            for r in t.get_finished_jobs():
                if not r.success:
                    raise RuntimeError(f"vLLM: job {r.job_id} failed")
                jobs.discard(r.job_id)
            if jobs:
                time.sleep(0.0005)


def one_round(system: System, base: str, host: np.ndarray, ref: np.ndarray, keys: list[bytes]) -> dict[str, float]:
    n, nbytes = host.shape
    total = n * nbytes
    root = tempfile.mkdtemp(prefix="fsbench-", dir=base)
    try:
        host[:] = ref
        system.setup(root, host)
        gc.collect()  # (a full collection of this process's heap, vLLM's included, is ~0.25 s: not in a timed phase)
        t0 = time.perf_counter()
        system.store(keys, n)
        t1 = time.perf_counter()
        os.sync()
        t2 = time.perf_counter()
        dropped = drop_caches()
        host[:] = 0
        gc.collect()
        d0 = disk_reads(root)
        c0 = os.times()
        t3 = time.perf_counter()
        system.load(keys, n)
        t4 = time.perf_counter()
        c1 = os.times()
        d1 = disk_reads(root)
        system.close()
        if not np.array_equal(host, ref):
            bad = int(np.count_nonzero((host != ref).any(axis=1)))
            raise SystemExit(f"{system.name}: {bad} of {n} blocks loaded with wrong bytes")
        reads = (d1[0] - d0[0]) / n if d0 and d1 else float("nan")
        read_bytes = (d1[1] - d0[1]) * 512 / total if d0 and d1 else float("nan")
        return {"store": total / (t1 - t0) / 1e9, "sync": total / (t2 - t0) / 1e9, "load": total / (t4 - t3) / 1e9,
                "reads": reads, "read_bytes": read_bytes,
                "cpu": (c1.user + c1.system - c0.user - c0.system) / (total / 1e9), "dropped": dropped is None, "why": dropped or ""}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _verdict(value: float, target: float) -> str:
    return f"{value:.2f}x (target >= {target:g}: {'met' if value >= target else 'MISSED'})"


def summarize(best: dict[str, dict[str, float]], rounds: dict[str, list[dict[str, float]]]) -> None:
    """Ratios of the best rounds against the targets, the per-round spread (rounds are
    interleaved, so round i of each system saw the same machine load), and whether the
    cold-load target lies above what the device gives at this request size."""
    ours, peer, plain, dev = (best.get(k) for k in ("ours", VLLM.name, Plain.name, Device.name))
    if ours and peer:
        print(f"  ours / vLLM: store {ours['store'] / peer['store']:.2f}x, store+sync {_verdict(ours['sync'] / peer['sync'], 1)}, "
              f"cold load {_verdict(ours['load'] / peer['load'], 1.2)}")
        per = [(a["sync"] / b["sync"], a["load"] / b["load"]) for a, b in zip(rounds["ours"], rounds[VLLM.name])]
        print(f"    per round: store+sync {min(p[0] for p in per):.2f}-{max(p[0] for p in per):.2f}x, "
              f"cold load {min(p[1] for p in per):.2f}-{max(p[1] for p in per):.2f}x")
    if ours and plain:
        print(f"  ours / plain loop: cold load {_verdict(ours['load'] / plain['load'], 0.9)}, "
              f"store+sync {ours['sync'] / plain['sync']:.2f}x")
    if ours and dev:
        print(f"  ours / device limit: cold load {ours['load'] / dev['load']:.2f}x, store+sync {ours['sync'] / dev['sync']:.2f}x")
        if peer:
            mine = [a["load"] / d["load"] for a, d in zip(rounds["ours"], rounds[Device.name])]
            theirs = [b["load"] / d["load"] for b, d in zip(rounds[VLLM.name], rounds[Device.name])]
            above = sum(1.2 * t > 1 for t in theirs)
            print(f"    per round, against that round's device row: ours {min(mine):.2f}-{max(mine):.2f}x, vLLM "
                  f"{min(theirs):.2f}-{max(theirs):.2f}x; 1.2 x vLLM above the device row in {above} of {len(theirs)} rounds")
        if peer and 1.2 * peer["load"] > dev["load"]:
            print(f"    1.2 x vLLM's cold load = {1.2 * peer['load']:.2f} GB/s is above the device's {dev['load']:.2f} GB/s "
                  "with one request per block: not reachable with a file per block")
    if Sequential.name in best:
        top_name, top = max(((k, b["load"]) for k, b in best.items()), key=lambda kv: kv[1])
        line = f"  ceiling (the best cold load of any row): {top:.2f} GB/s ({top_name.split(':')[0].split(' (')[0]})"
        if ours:
            line += f"; ours {ours['load'] / top:.2f}x of it"
        if peer:
            line += f"; 1.2 x vLLM = {1.2 * peer['load']:.2f} GB/s is {'below' if 1.2 * peer['load'] <= top else 'ABOVE'} it"
        print(line)
    jobs = [best[n] for n in (JobFiles.name, JobFilesPerBlock.name, JobFilesWillneed.name, JobFilesDirect.name) if n in best]
    if jobs and peer:
        print(f"  sketch (a file per job, the better of its rows) / vLLM: cold load "
              f"{max(b['load'] for b in jobs) / peer['load']:.2f}x")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="2048x256,8192x64", help="NxKiB,... (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the files go (default: a temp dir under /var/tmp)")
    ap.add_argument("--systems", default="ours,vllm,plain,device,ceiling",
                    help="comma list of ours, vllm, plain, device, ceiling, jobfiles (default %(default)s)")
    ap.add_argument("--ours", action="append", default=[],
                    help="extra configs of ours to compare, e.g. load_threads=8,store_threads=4 (repeatable)")
    ap.add_argument("--per-round", action="store_true", help="print every round's cold load and the median")
    args = ap.parse_args(argv)
    base = args.dir or tempfile.mkdtemp(prefix="fs_tier-", dir="/var/tmp")
    systems: list[System] = []
    want = args.systems.split(",")
    if "ours" in want:
        systems.append(Ours())
    for spec in args.ours:
        cfg: dict[str, Any] = {}
        for kv in spec.split(","):
            k, v = kv.split("=")
            cfg[k] = None if v == "None" else (v == "True" if v in ("True", "False") else int(v) if v.isdigit() else v)
        systems.append(Ours(**cfg))
    if "vllm" in want:
        try:
            import vllm.v1.kv_offload.tiering.fs.manager  # noqa: F401

            systems.append(VLLM())
        except Exception as exc:  # noqa: BLE001
            print(f"vLLM peer not available ({type(exc).__name__}: {exc}); run in the peer venv", file=sys.stderr)
    if "plain" in want:
        systems.append(Plain())
    if "device" in want and O_DIRECT:
        systems.append(Device())
    if "ceiling" in want and O_DIRECT:
        systems.append(Sequential())
    if "jobfiles" in want and O_DIRECT:
        systems += [JobFiles(), JobFilesPerBlock(), JobFilesWillneed(), JobFilesDirect()]
    probe = FileSystemSecondaryTierManager(root=os.path.join(base, "probe"), enable_events=False)
    print(f"directory {base}: O_DIRECT {'supported' if probe.o_direct else 'not supported'}; "
          f"checksum {probe.stats()['checksum']}; load path {'C (_fsio)' if probe.stats()['native_io'] else 'Python'}; "
          f"{os.cpu_count()} CPUs")
    probe.shutdown()
    notes = set()
    for shape in args.shapes.split(","):
        n, kib = (int(x) for x in shape.split("x"))
        nbytes = kib * 1024
        host = aligned_buffer(n, nbytes)
        rng = np.random.default_rng(n + kib)
        ref = rng.integers(0, 256, size=(n, nbytes), dtype=np.uint8)
        keys = [make_offload_key(rng.bytes(8), 0) for _ in range(n)]
        best: dict[str, dict[str, float]] = {s.name: {"store": 0.0, "sync": 0.0, "load": 0.0} for s in systems}
        rounds: dict[str, list[dict[str, float]]] = {s.name: [] for s in systems}
        for _ in range(args.rounds):
            for s in systems:
                r = one_round(s, base, host, ref, keys)
                if not r["dropped"]:
                    notes.add(f"page cache NOT dropped ({r['why']}): cold loads may be served from memory")
                rounds[s.name].append(r)
                for k in ("store", "sync", "load"):
                    best[s.name][k] = max(best[s.name][k], r[k])
        rows = []
        for s in systems:
            b = best[s.name]
            rs = sorted(r["reads"] for r in rounds[s.name])
            rb = sorted(r["read_bytes"] for r in rounds[s.name])
            cpu = sorted(r["cpu"] for r in rounds[s.name])
            rows.append([s.name, f"{b['store']:.2f}", f"{b['sync']:.2f}", f"{b['load']:.2f}",
                         f"{rs[len(rs) // 2]:.2f}", f"{rb[len(rb) // 2]:.3f}", f"{cpu[len(cpu) // 2]:.2f}"])
        title = (f"{n} x {kib} KiB blocks ({n * nbytes / 2**30:.2f} GiB), jobs of {JOB}, best of {args.rounds}, "
                 "bytes verified every round")
        print(format_table(title, ["system", "store GB/s", "store + sync GB/s", "cold load GB/s", "disk reads / block",
                                   "bytes read / stored", "load CPU s / GB"], rows))
        summarize(best, rounds)
        if args.per_round:
            print("  cold load GB/s per round (round i of every system ran back to back; disk reads per block), median:")
            for s in systems:
                loads = [r["load"] for r in rounds[s.name]]
                each = " ".join(f"{r['load']:5.2f} ({r['reads']:.2f})" for r in rounds[s.name])
                print(f"    {s.name:<50} {each}   {sorted(loads)[len(loads) // 2]:5.2f}")
    print("page cache: " + ("; ".join(sorted(notes)) if notes else
                            "dropped before every load (as root: sync; echo 3 > /proc/sys/vm/drop_caches)"))
    if not args.dir:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
