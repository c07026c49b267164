"""Transfer worker: host<->device block copy rate against a plain copy of the same bytes.

    python benchmarks/transfer.py [--device cuda|cpu] [--blocks 2048] [--block-kib 256] [--job-blocks 64]

Each job copies ``--job-blocks`` blocks by id (random, so runs of contiguous ids vary) between a
device KV-cache tensor ``[num_blocks, block_elems]`` and a host buffer (pinned on CUDA), through
``manager.transfer.TorchTransferWorker``: submit every job, then wait for all. The reference is
one plain ``copy_`` of the same total bytes between one contiguous pinned host tensor and one
device tensor (``non_blocking=True`` + synchronize on CUDA) — the physical limit of the link as
torch reaches it. Target (issue 3, on a GPU machine): the worker reaches >= 80% of that rate
in both directions. On a CPU-only machine it measures the CPU path (memcpy-bound).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._table import print_table  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument("--blocks", type=int, default=2048, help="device and host blocks")
    ap.add_argument("--block-kib", type=int, default=256, help="KiB per block")
    ap.add_argument("--job-blocks", type=int, default=64, help="blocks per job")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--copy-mode", default="auto", choices=("auto", "kernel", "dma"),
                    help="the CUDA worker's copy mode (see manager.transfer)")
    args = ap.parse_args()

    import numpy as np
    import torch

    from manager.transfer import TorchTransferWorker

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    elems = args.block_kib * 1024 // 2  # float16
    dev = torch.zeros((args.blocks, elems), dtype=torch.float16, device=device)
    worker = TorchTransferWorker(dev, args.blocks, copy_mode=args.copy_mode)
    host = worker.host if hasattr(worker, "host") else None
    rng = np.random.default_rng(0)
    n_jobs = args.blocks // args.job_blocks
    perm_dev = rng.permutation(args.blocks)
    perm_host = rng.permutation(args.blocks)
    total_bytes = n_jobs * args.job_blocks * elems * 2

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def run_worker(direction: str) -> float:
        sync()
        t0 = time.perf_counter()
        for j in range(n_jobs):
            d = perm_dev[j * args.job_blocks:(j + 1) * args.job_blocks]
            h = perm_host[j * args.job_blocks:(j + 1) * args.job_blocks]
            if direction == "store":
                worker.submit_store(j + run_worker.base, d, h)
            else:
                worker.submit_load(j + run_worker.base, h, d)
        assert worker.wait(timeout=120), "transfer jobs did not finish"
        dt = time.perf_counter() - t0
        results = worker.get_finished()
        assert all(r.success for r in results), "a transfer job failed"
        run_worker.base += n_jobs
        return total_bytes / dt

    run_worker.base = 0
    pin = device == "cuda"
    plain_host = torch.empty((n_jobs * args.job_blocks, elems), dtype=torch.float16, pin_memory=pin)
    plain_dev = torch.empty_like(plain_host, device=device)

    def run_plain(direction: str) -> float:
        sync()
        t0 = time.perf_counter()
        if direction == "store":
            plain_host.copy_(plain_dev, non_blocking=pin)
        else:
            plain_dev.copy_(plain_host, non_blocking=pin)
        sync()
        return total_bytes / (time.perf_counter() - t0)

    rows = []
    for direction, label in (("store", "device -> host (store)"), ("load", "host -> device (load)")):
        run_worker(direction)
        run_plain(direction)  # warm-up
        ours = max(run_worker(direction) for _ in range(args.repeat))
        plain = max(run_plain(direction) for _ in range(args.repeat))
        ratio = ours / plain
        rows.append([label, ours / 1e9, plain / 1e9, f"{ratio:.0%}", "met" if ratio >= 0.8 else "NOT met"])
    stats = worker.stats()
    worker.shutdown()
    del host
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    print(f"# transfer: {n_jobs} jobs x {args.job_blocks} blocks x {args.block_kib} KiB "
          f"({total_bytes / 2**20:.0f} MiB per direction), random block ids, device {name}, best of {args.repeat}; "
          f"copy mode {getattr(worker, 'copy_mode', 'cpu thread')} "
          f"({stats.get('kernel_jobs', 0)} kernel jobs, {stats.get('dma_jobs', 0)} copy-engine jobs); "
          f"plain = one contiguous copy_ of the same bytes{' from pinned memory' if pin else ''}")
    print_table("transfer worker vs plain copy_", ["direction", "worker GB/s", "plain copy_ GB/s", "ratio",
                                                  "target >= 80%"], rows)


if __name__ == "__main__":
    main()
