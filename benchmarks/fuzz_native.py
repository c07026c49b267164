"""Coverage-guided fuzzing of the router's C payload parser under AddressSanitizer.

    python benchmarks/fuzz_native.py                    # 1,000,000 inputs (the chaos target)
    python benchmarks/fuzz_native.py --inputs 50000     # a shorter run

What it does:

1. builds ``consumers/_fastpath.c`` into a scratch directory with ``-fsanitize=address`` and
   gcc's ``-fsanitize-coverage=trace-pc``, linked with a small uninstrumented shim that turns
   every basic block the parser enters into a bit of a 64 KiB coverage map;
2. runs a worker process with ``LD_PRELOAD=libasan`` that imports that build (its ``consumers``
   copy first on ``sys.path``) and loops: take a corpus entry, mutate it, feed it to
   ``KVRouter.apply_payload`` and to ``kvevents.decode_batch``; an input that lights a new
   coverage bit joins the corpus. Every input is checked against the typed decoder (the C parser
   raises DecodeError exactly where ``decode_batch`` does; a batch both accept leaves the same
   public counters as ``apply(decode_batch(...))`` every ``--state-every`` inputs);
3. a sanitizer report (or any crash) ends the worker: the parent counts it, keeps the report
   and the input that caused it, and starts a new worker from the saved corpus.

It prints inputs tried, crashes, sanitizer reports, mismatches, hangs (a worker silent for
``--hang-s``), corpus size and coverage bits, beside the targets (>= 10^6 inputs, 0 crashes,
0 sanitizer reports, 0 mismatches). Needs gcc with libasan (Debian: gcc, libasan8).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_INPUT = 1 << 20
sys.path.insert(0, str(ROOT))

SHIM = r"""
#include <stdint.h>
#define MAP (1u << 16)
static unsigned char seen[MAP];
static int fresh, total;
void __sanitizer_cov_trace_pc(void) {
    uintptr_t pc = (uintptr_t)__builtin_return_address(0);
    unsigned i = (pc ^ (pc >> 16)) & (MAP - 1);
    if (!seen[i]) { seen[i] = 1; fresh++; total++; }
}
/* edges (hashed pcs) never lit before, since the last call */
int kvfuzz_new_bits(void) { int n = fresh; fresh = 0; return n; }
int kvfuzz_total_bits(void) { return total; }
"""

def build(out: Path) -> Path:
    """The sanitized, coverage-instrumented extension inside ``out/consumers`` (a copy of the package)."""
    pkg = out / "consumers"
    shutil.copytree(ROOT / "consumers", pkg, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    inc = sysconfig.get_paths()["include"]
    (out / "shim.c").write_text(SHIM)
    cc = ["gcc", "-fPIC", "-g", "-O1", "-fno-omit-frame-pointer", "-fsanitize=address"]
    subprocess.run(["gcc", "-fPIC", "-O2", "-c", str(out / "shim.c"), "-o", str(out / "shim.o")], check=True)
    subprocess.run(cc + ["-fsanitize-coverage=trace-pc", f"-I{inc}", "-c", str(pkg / "_fastpath.c"),
                         "-o", str(out / "fastpath.o")], check=True)
    so = pkg / f"_fastpath{suffix}"
    subprocess.run(cc + ["-shared", str(out / "fastpath.o"), str(out / "shim.o"), "-o", str(so)], check=True)
    return so


def libasan() -> str:
    path = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    return os.path.realpath(path)


# ---- the worker (runs under ASan) --------------------------------------------------------------


def worker(args: argparse.Namespace) -> None:
    import ctypes

    sys.path.insert(0, args.build)  # the sanitized consumers copy first
    import consumers
    from consumers import KVRouter
    from kvevents import DecodeError, decode_batch

    from tests.chaos import oracles

    assert consumers.__file__.startswith(args.build), consumers.__file__
    assert consumers.fastpath_status().startswith("C fast path"), consumers.fastpath_status()
    so = next(Path(args.build, "consumers").glob("_fastpath*.so"))
    cov = ctypes.CDLL(str(so))
    corpus_dir = Path(args.corpus)
    corpus = [p.read_bytes() for p in sorted(corpus_dir.iterdir())]
    rnd = random.Random(args.seed)
    stats = {"inputs": 0, "mismatches": 0, "new_corpus": 0, "mismatch_examples": []}
    router = KVRouter(model="m", block_size=2)
    cov.kvfuzz_new_bits()
    last_report = time.monotonic()
    import mmap

    with open(args.current, "wb") as f:  # the input in flight, for the parent to keep if we crash
        f.write(bytes(8 + MAX_INPUT))
    cur_f = open(args.current, "r+b")
    current = mmap.mmap(cur_f.fileno(), 8 + MAX_INPUT)
    for i in range(args.inputs):
        data = oracles.mutate(rnd.choice(corpus), rnd, 6)[:MAX_INPUT]
        current[:8] = len(data).to_bytes(8, "little")
        current[8:8 + len(data)] = data
        if i % args.state_every == 0:
            try:
                oracles.check_apply_payload(data)
            except oracles.Crash as exc:
                stats["mismatches"] += 1
                if len(stats["mismatch_examples"]) < 5:
                    stats["mismatch_examples"].append([data.hex(), str(exc)[:300]])
        else:
            try:
                decode_batch(data)
                want = None
            except DecodeError:
                want = DecodeError
            try:
                router.apply_payload("p", data)
                got = None
            except DecodeError:
                got = DecodeError
            except Exception as exc:  # a refusal of a decoded value: compared in the state rounds
                got = type(exc) if want is None else exc
            if (want is DecodeError) != (got is DecodeError):
                stats["mismatches"] += 1
                if len(stats["mismatch_examples"]) < 5:
                    stats["mismatch_examples"].append([data.hex(), f"decode_batch {want}, apply_payload {got}"])
            if router.entries() > 200_000:
                router = KVRouter(model="m", block_size=2)
        stats["inputs"] += 1
        if cov.kvfuzz_new_bits():
            corpus.append(data)
            stats["new_corpus"] += 1
            (corpus_dir / f"w{args.seed}-{i:08d}").write_bytes(data)
        if time.monotonic() - last_report > 1.0:
            last_report = time.monotonic()
            print(json.dumps({"progress": stats["inputs"], "bits": cov.kvfuzz_total_bits()}), flush=True)
    stats["bits"] = cov.kvfuzz_total_bits()
    stats["corpus"] = len(corpus)
    print(json.dumps({"done": stats}), flush=True)


# ---- the parent ----------------------------------------------------------------------------------


def _keep_current(work: Path, name: str) -> None:
    raw = (work / "current.bin").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    (work / name).write_bytes(raw[8:8 + n])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--inputs", type=int, default=1_000_000)
    ap.add_argument("--chunk", type=int, default=100_000, help="inputs per worker process")
    ap.add_argument("--state-every", type=int, default=50, help="full state comparison every N inputs")
    ap.add_argument("--hang-s", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--keep", metavar="DIR", help="keep the build, corpus and reports here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--build", help=argparse.SUPPRESS)
    ap.add_argument("--corpus", help=argparse.SUPPRESS)
    ap.add_argument("--current", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    from benchmarks._table import print_table
    from tests.chaos import oracles

    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="kvfuzz-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    build(work / "build")
    corpus = work / "corpus"
    corpus.mkdir(exist_ok=True)
    for i, p in enumerate(oracles.seed_payloads()):
        (corpus / f"seed-{i:03d}").write_bytes(p)
    env = dict(os.environ, LD_PRELOAD=libasan(), PYTHONPATH=str(ROOT),
               ASAN_OPTIONS=f"detect_leaks=0:abort_on_error=0:log_path={work}/asan")
    done = crashes = hangs = mismatches = reports = 0
    bits = corpus_n = 0
    examples: list = []
    chunk = 0
    while done < args.inputs:
        n = min(args.chunk, args.inputs - done)
        cmd = [sys.executable, __file__, "--worker", "--build", str(work / "build"), "--corpus", str(corpus),
               "--current", str(work / "current.bin"), "--inputs", str(n),
               "--state-every", str(args.state_every), "--seed", str(args.seed * 1000 + chunk)]
        chunk += 1
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        progress, result = 0, None
        last = time.monotonic()
        os.set_blocking(proc.stdout.fileno(), False)
        while True:
            line = proc.stdout.readline()
            if line:
                last = time.monotonic()
                msg = json.loads(line)
                progress = msg.get("progress", progress)
                result = msg.get("done", result)
                continue
            if proc.poll() is not None:
                rest = proc.stdout.read()
                for line in (rest or "").splitlines():
                    msg = json.loads(line)
                    result = msg.get("done", result)
                break
            if time.monotonic() - last > args.hang_s:
                hangs += 1
                proc.kill()
                proc.wait()
                _keep_current(work, f"hang-{hangs}.bin")
                break
            time.sleep(0.05)  # waiting on a child's output
        if result is not None:
            done += result["inputs"]
            mismatches += result["mismatches"]
            examples += result["mismatch_examples"]
            bits, corpus_n = result["bits"], result["corpus"]
        else:
            done += progress + 1  # the input that crashed counts
            if proc.returncode not in (None, 0):
                crashes += 1
                _keep_current(work, f"crash-{crashes}.bin")
        reports = len(list(work.glob("asan*")))
        print(f"  {done:,} inputs, {crashes} crashes, {reports} sanitizer reports, {mismatches} mismatches, "
              f"{bits} coverage bits, {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    elapsed = time.monotonic() - t0
    rows = [
        ["inputs tried", done, ">= 1,000,000", "met" if done >= 1_000_000 else "short run"],
        ["crashes", crashes, "0", "met" if crashes == 0 else "NOT MET"],
        ["sanitizer (ASan) reports", reports, "0", "met" if reports == 0 else "NOT MET"],
        ["C parser vs typed decoder mismatches", mismatches, "0", "met" if mismatches == 0 else "NOT MET"],
        ["hangs (worker silent > %.0f s)" % args.hang_s, hangs, "0", "met" if hangs == 0 else "NOT MET"],
        ["coverage bits, last worker (64 KiB map)", bits, "-", ""],
        ["corpus (seeds + inputs with new coverage)", corpus_n, "-", ""],
        ["wall time (s)", round(elapsed), "-", ""],
    ]
    print_table(f"Coverage-guided fuzzing of consumers/_fastpath.c under ASan (gcc trace-pc, {done / elapsed:,.0f} inputs/s)",
                ["figure", "value", "target", ""], rows)
    for hexdata, why in examples[:5]:
        print(f"mismatch: {why}\n  input {hexdata[:200]}")
    print(f"(build, corpus and any reports in {work})")


if __name__ == "__main__":
    main()
