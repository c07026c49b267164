"""kill -9 of a process whose fs tier is storing packs and punching out evicted units: a tier
restarted on the same root finds every block whose store was reported and whose eviction was
not (an evicted block whose unit was not punched yet may come back: its bytes are still whole),
loads every block it indexes with exactly the bytes stored, leaves no temp file behind,
and holds on disk exactly the units it indexes."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from manager import NumpyBlockIO, make_offload_key
from manager.tiering import JobMetadata, fs_pack
from manager.tiering.fs import FileSystemSecondaryTierManager
from manager.tiering.fs_io import HEADER_SIZE

BLOCK = 8192
JOB = 32
CAPACITY = 100  # evictions from the fourth job on, cutting packs in the middle (punches) as well as emptying them

pytestmark = pytest.mark.skipif(not fs_pack.probe_punch("/tmp"), reason="this filesystem cannot punch holes")

CHILD = f"""
import sys
import numpy as np
from manager import NumpyBlockIO, make_offload_key
from manager.tiering import JobMetadata
from manager.tiering.fs import FileSystemSecondaryTierManager

io = NumpyBlockIO.allocate({JOB}, {BLOCK})
t = FileSystemSecondaryTierManager(root=sys.argv[1], block_io=io, capacity_blocks={CAPACITY}, pack_blocks=12)
t.take_events()
i = job = 0
while True:
    for s in range({JOB}):
        io.write_block(s, np.random.default_rng(i + s).integers(0, 256, {BLOCK}, dtype=np.uint8).tobytes())
    t.submit_store(JobMetadata(job, [make_offload_key((i + s).to_bytes(8, "big"), 0) for s in range({JOB})],
                               np.arange({JOB}, dtype=np.int64), False))
    t.drain_jobs()
    t.get_finished_jobs()
    for e in t.take_events():
        print(("E " if e.removed else "S ") + " ".join(str(int.from_bytes(k[:8], "big")) for k in e.keys), flush=True)
    i += {JOB}
    job += 1
"""


def payload(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, BLOCK, dtype=np.uint8).tobytes()


def K(i: int) -> bytes:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def live_units(root: Path) -> int:
    n = 0
    for p in root.rglob("*.kvp"):
        raw = p.read_bytes()
        n += sum(1 for off in range(0, len(raw), HEADER_SIZE + BLOCK) if raw[off : off + HEADER_SIZE].count(0) != HEADER_SIZE)
    return n


@pytest.mark.parametrize("lines", [3, 7, 12, 20])
def test_kill_9_while_storing_and_punching_loses_nothing_reported(tmp_path: Path, lines: int) -> None:
    root = tmp_path / "fs"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(root)], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[2])
    seen: list[str] = []
    try:
        for _ in range(lines):  # the child goes on meanwhile: the kill lands in a later job
            line = child.stdout.readline()  # type: ignore[union-attr]
            assert line, "the child died on its own"
            seen.append(line)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    # Every whole line it printed before it died, in order: S (a store job committed: its blocks
    # are whole files) and E (blocks evicted: their units punched, or their packs unlinked).
    seen += [x for x in child.stdout.read().splitlines(keepends=True) if x.endswith("\n")]  # type: ignore[union-attr]
    stored: list[int] = []
    gone: set[int] = set()
    for line in seen:
        kind, *words = line.split()
        if kind == "S":
            stored += map(int, words)
        else:
            gone.update(map(int, words))
    live = [i for i in stored if i not in gone]
    assert live, "nothing was stored before the kill"
    # The job in flight at the kill may have evicted the oldest JOB live blocks (LRU: store order)
    # before its removal event was printed: those may be gone; every other one must be there.
    must = set(live[JOB:])

    io = NumpyBlockIO.allocate(JOB, BLOCK)
    # (no capacity: a restart over capacity would evict the oldest blocks, reported or not)
    t = FileSystemSecondaryTierManager(root=root, block_io=io, pack_blocks=12)
    try:
        held = {int.from_bytes(k[:8], "big") for k in t.cached_keys()}
        assert must <= held, f"reported stored, not evicted, and lost: {sorted(must - held)[:10]}"
        ids = sorted(held)
        for j in range(0, len(ids), JOB):
            chunk = ids[j : j + JOB]
            t.submit_load(JobMetadata(j, [K(i) for i in chunk], np.arange(len(chunk), dtype=np.int64), True))
            assert t.drain_jobs(timeout=30)
            (res,) = t.get_finished_jobs()
            assert res.success, f"an indexed block did not load ({t.stats()})"
            for s, i in enumerate(chunk):
                assert bytes(io.read_block(s)) == payload(i), f"block {i}: other bytes"
        assert not list(root.rglob("*.tmp"))  # the dead writer's temp pack is gone
        assert live_units(root) == len(held) and t.stats()["corrupt_files"] == 0
    finally:
        t.shutdown()
