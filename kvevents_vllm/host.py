"""The CPU tier's host buffer, shared between vLLM's worker and scheduler sides.

vLLM builds our spec twice: on the worker side (it owns the KV-cache tensors and our transfer
worker copies them to and from the host buffer) and on the scheduler side (our manager, whose
secondary tiers read and write the same host blocks). The two may live in different processes,
so each worker rank keeps its host buffer in a file under ``/dev/shm`` named after vLLM's
engine id and the rank, with a small JSON layout beside it; the scheduler side maps every
rank's file once they all exist and sees one offloaded block as the concatenation of each
rank's and each KV tensor's rows of that block (:class:`RegionBlockIO`). Once the scheduler has
mapped them the files are removed; without secondary tiers nobody else reads the buffer and it
is private memory (no files).

Inside one rank's file, tensor ``t`` owns one contiguous region of ``num_chunks *
blocks_per_chunk`` rows of ``pages[t]`` bytes; offloaded block ``c`` is rows
``c*blocks_per_chunk .. +blocks_per_chunk`` of every region. The worker also removes its files
at shutdown (if the scheduler never mapped them).
"""

from __future__ import annotations

import json
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from manager.base import BlockIO

SHM_DIR = Path(os.environ.get("KVEVENTS_VLLM_SHM_DIR", "/dev/shm"))


def _stem(engine_id: str, rank: int) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", str(engine_id))[:120]
    return SHM_DIR / f"kvevents_vllm-{safe}-r{int(rank)}"


@dataclass(slots=True)
class HostRegions:
    """One rank's host buffer: per KV tensor a ``[rows, page]`` int8 array in a shared file."""

    path: Path
    layout_path: Path
    arrays: list[np.ndarray]
    _map: mmap.mmap | None

    def whole(self) -> np.ndarray:
        """The whole buffer as bytes (every tensor's region, in order): what is registered
        with CUDA once, so regions sharing a page are never registered twice."""
        return np.frombuffer(self._map, dtype=np.uint8) if self._map is not None else np.empty(0, np.uint8)

    def remove(self) -> None:
        for p in (self.layout_path, self.path):
            try:
                p.unlink()
            except FileNotFoundError:
                pass


def _map_file(path: Path, size: int, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def _arrays(mm: mmap.mmap, rows: int, pages: list[int]) -> list[np.ndarray]:
    out, off = [], 0
    for page in pages:
        out.append(np.frombuffer(mm, dtype=np.int8, count=rows * page, offset=off).reshape(rows, page))
        off += rows * page
    return out


def create_regions(engine_id: str, rank: int, num_chunks: int, blocks_per_chunk: int,
                   pages: list[int], *, shared: bool = True) -> HostRegions:
    """The worker side: a new zeroed host buffer for this rank (its layout written last).
    ``shared=False`` (no secondary tier will read it): private memory, no files."""
    stem = _stem(engine_id, rank)
    path, layout_path = stem.with_suffix(".kv"), stem.with_suffix(".json")
    rows = num_chunks * blocks_per_chunk
    size = max(1, rows * sum(pages))
    if not shared:
        mm = mmap.mmap(-1, size)
        return HostRegions(path, layout_path, _arrays(mm, rows, pages), mm)
    mm = _map_file(path, size, create=True)
    layout = {"num_chunks": num_chunks, "blocks_per_chunk": blocks_per_chunk, "pages": list(pages)}
    tmp = layout_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(layout))
    os.replace(tmp, layout_path)
    return HostRegions(path, layout_path, _arrays(mm, rows, pages), mm)


def open_block_io(engine_id: str, world_size: int) -> RegionBlockIO | None:
    """The scheduler side: every rank's host buffer as one BlockIO; None until all exist. Once
    all are mapped their files are removed (the mappings stay): an engine that is killed later
    leaves nothing behind."""
    regions: list[np.ndarray] = []
    bpc = num_chunks = None
    stems = [_stem(engine_id, rank) for rank in range(world_size)]
    if not all(stem.with_suffix(".json").exists() for stem in stems):
        return None
    for stem in stems:
        layout_path = stem.with_suffix(".json")
        layout = json.loads(layout_path.read_text())
        num_chunks, bpc = int(layout["num_chunks"]), int(layout["blocks_per_chunk"])
        pages = [int(p) for p in layout["pages"]]
        rows = num_chunks * bpc
        mm = _map_file(stem.with_suffix(".kv"), max(1, rows * sum(pages)), create=False)
        regions.extend(_arrays(mm, rows, pages))
    for stem in stems:
        for p in (stem.with_suffix(".json"), stem.with_suffix(".kv")):
            p.unlink(missing_ok=True)
    assert bpc is not None and num_chunks is not None
    return RegionBlockIO(regions, bpc, num_chunks)


class RegionBlockIO(BlockIO):
    """Offloaded block ``c`` = rows ``c*k .. c*k+k-1`` of each region, concatenated."""

    def __init__(self, regions: list[np.ndarray], blocks_per_chunk: int, num_blocks: int) -> None:
        self.k = int(blocks_per_chunk)
        self.num_blocks = int(num_blocks)
        self.regions = [r.view(np.uint8) for r in regions]
        self._sizes = [self.k * r.shape[1] for r in self.regions]
        self.block_nbytes = sum(self._sizes)

    def contiguous(self) -> np.ndarray | None:
        """The buffer as one ``[num_blocks, block_nbytes]`` array where it is one (a single
        region on a single rank), else None."""
        if len(self.regions) != 1:
            return None
        return self.regions[0].reshape(self.num_blocks, -1)

    def _check(self, block_id: int) -> int:
        b = int(block_id)
        if not 0 <= b < self.num_blocks:
            raise IndexError(f"block id {b} out of range [0, {self.num_blocks})")
        return b

    def _rows(self, region: np.ndarray, b: int) -> np.ndarray:
        return region[b * self.k:(b + 1) * self.k].reshape(-1)

    def read_block(self, block_id: int) -> memoryview:
        b = self._check(block_id)
        if len(self.regions) == 1:
            return memoryview(self._rows(self.regions[0], b)).toreadonly()
        return memoryview(np.concatenate([self._rows(r, b) for r in self.regions])).toreadonly()

    def writable_block(self, block_id: int) -> memoryview | None:
        if len(self.regions) == 1:
            return memoryview(self._rows(self.regions[0], self._check(block_id)))
        return None

    def write_block(self, block_id: int, data: bytes | bytearray | memoryview) -> None:
        b = self._check(block_id)
        src = np.frombuffer(data, dtype=np.uint8)
        if src.size != self.block_nbytes:
            raise ValueError(f"write_block({block_id}): got {src.size} bytes, block holds {self.block_nbytes}")
        off = 0
        for region, size in zip(self.regions, self._sizes):
            self._rows(region, b)[:] = src[off:off + size]
            off += size
