"""Where the fs tier's blocks live on disk: a file of their own, or a unit of a pack file
(:mod:`manager.tiering.fs_pack`); the names of new files and temp files, the fan-out
directories, and the deletions queued for after the tier's lock.

Every method but :meth:`BlockPlaces.flush` runs with the tier's lock held; ``flush`` takes it
itself around the queue, and does the unlinks and punches outside it, so that a slow disk
never holds the lock the scheduler's calls take.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence
from itertools import count

from kvevents.errors import ConfigError

from ..base import BlockIO, OffloadKey
from .fs_io import ALIGN, HEADER_SIZE
from .fs_pack import MAX_PACK, MAX_PACK_BYTES, Pack, pack_name, probe_punch, punch
from .fs_scan import ScanResult, block_path, make_fanout_dirs

__all__ = ["BlockPlaces", "PACK_BELOW", "Run", "check_pack_config", "sync_dir"]

#: blocks of this many bytes or more keep a file each by default: at 256 KiB one O_DIRECT request
#: per block file loads faster than a pack run, at 16 KiB packs load and store faster
#: (the runs: benchmarks/NOTES.md, "Pack files")
PACK_BELOW = 256 * 1024

Run = tuple[Pack, int, list[int]]  # (pack, first unit, job indexes in unit order)

#: a packed block's place is one int, ``pack number << UNIT_BITS | unit``: the index of every
#: packed block holds no object the garbage collector tracks (a tuple holding its Pack would
#: be one per block, and in an engine's large heap each store's worth of them brings the next
#: full collection nearer: one stalled a 64 KiB load for ~0.25 s in fs_tier.py)
UNIT_BITS = 10
UNIT_MASK = (1 << UNIT_BITS) - 1
assert MAX_PACK <= UNIT_MASK


def check_pack_config(pack_blocks: object, pack_below: object) -> None:
    if not isinstance(pack_blocks, int) or isinstance(pack_blocks, bool) or not 1 <= pack_blocks <= MAX_PACK:
        raise ConfigError(f"fs tier: pack_blocks must be an int in 1..{MAX_PACK}, got {pack_blocks!r}")
    if not isinstance(pack_below, int) or isinstance(pack_below, bool) or pack_below < 0:
        raise ConfigError(f"fs tier: pack_below must be an int >= 0 (bytes), got {pack_below!r}")


def sync_dir(path: str) -> None:
    """``fsync`` a directory: the entries made in it (renames) reach stable storage."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class BlockPlaces:
    """``pack_blocks`` > 1: store jobs of page-multiple blocks under ``pack_below`` bytes are
    packed, where the filesystem can punch holes (probed once: ``punch_holes``); else a file
    per block."""

    def __init__(self, root: str, token: str, sync: bool, pack_blocks: int = 1, pack_below: int = PACK_BELOW) -> None:
        self.root = root
        self.punch_holes = pack_blocks > 1 and probe_punch(root)
        self.pack_blocks = pack_blocks if self.punch_holes else 1
        self.pack_below = pack_below
        self.token = token  # the owner token in this tier's temp file and pack names
        self._tmp_ids = count()
        self._pack_ids = count()
        self.dirs: set[str] = set(make_fanout_dirs(root, sync))  # fan-out directories known to exist
        self.units: dict[OffloadKey, int] = {}  # packed keys -> pack number << UNIT_BITS | unit; others have a file
        self._packs: dict[int, Pack] = {}  # pack number -> the pack, while it has live units
        self._pack_nos = count()
        #: evicted or damaged, the file not unlinked (or the unit not punched) yet: a store of
        #: such a key is left out until then
        self.deleting: set[OffloadKey] = set()
        self._queue: list[tuple[OffloadKey | None, Pack | None, int]] = []  # (key, pack or None: its file, unit or -1: the pack)
        self.packs_written = 0
        self.packs_removed = 0  # unlinked with their last live unit
        self.units_punched = 0  # evicted or damaged pack units given back to the filesystem
        self.punch_errors = 0  # punches or pack unlinks that failed (the space stays taken until a restart's scan)

    def pack_size(self, io: BlockIO | None) -> int:
        """Blocks per pack file for a store job now (1: a file per block)."""
        if self.pack_blocks == 1 or io is None or not 0 < io.block_nbytes < self.pack_below or io.block_nbytes % ALIGN:
            return 1
        return max(1, min(self.pack_blocks, MAX_PACK_BYTES // (HEADER_SIZE + io.block_nbytes)))

    def file(self, key: OffloadKey) -> str:
        """The block file of ``key`` (where it is not packed)."""
        return block_path(self.root, key)

    def _dir(self, sub: str) -> str:
        """The fan-out directory ``sub``, created once per tier lifetime (not per block)."""
        if sub not in self.dirs:
            os.makedirs(os.path.join(self.root, sub), exist_ok=True)
            self.dirs.add(sub)
        return os.path.join(self.root, sub)

    def file_targets(self, todo: Iterable[tuple[OffloadKey, int]]) -> tuple[list[tuple[str, str, OffloadKey, int]], list[OffloadKey]]:
        """``(temp path, path, key, block id)`` to write each block of ``todo`` (key, block id)
        as a file of its own, and the keys whose directory could not be made."""
        items, failed = [], []
        for key, block_id in todo:
            path = self.file(key)
            try:
                self._dir(key[:1].hex()[:1])
            except OSError:
                failed.append(key)
                continue
            items.append((f"{path}.{self.token}.{next(self._tmp_ids)}.tmp", path, key, block_id))
        return items, failed

    def new_pack_path(self, units: int) -> str:
        """A fresh pack file name (packs spread over the fan-out directories); OSError where
        its directory cannot be made."""
        n = next(self._pack_ids)
        return os.path.join(self._dir(f"{n % 16:x}"), pack_name(self.token, n, units))

    def _register(self, pack: Pack) -> int:
        """The pack's number, the high bits of its units' places."""
        no = next(self._pack_nos)
        self._packs[no] = pack
        return no << UNIT_BITS

    def add_pack(self, pack: Pack, keys: Sequence[OffloadKey]) -> None:
        """A pack just written, unit i holding ``keys[i]``."""
        self.packs_written += 1
        base = self._register(pack)
        self.units.update(zip(keys, range(base, base + len(keys))))

    def delete(self, key: OffloadKey) -> None:
        """Queue the block's deletion: its file's unlink, or its pack unit's punch (the pack's
        unlink with its last live unit)."""
        self.deleting.add(key)
        where = self.units.pop(key, None)
        if where is None:
            self._queue.append((key, None, 0))
        else:
            self._drop_unit(key, where)

    def _drop_unit(self, key: OffloadKey | None, where: int) -> None:
        no, unit = where >> UNIT_BITS, where & UNIT_MASK
        pack = self._packs[no]
        pack.live -= 1
        if pack.live <= 0:
            del self._packs[no]
        self._queue.append((key, pack, unit if pack.live > 0 else -1))

    def flush(self, lock: threading.Condition) -> None:
        """(Lock not held.) Unlink the queued files, punch the queued units."""
        while True:
            with lock:
                if not self._queue:
                    return
                batch, self._queue = self._queue, []
            punched = removed = failed = 0
            for key, pack, unit in batch:
                try:
                    if pack is None:
                        os.unlink(self.file(key))  # type: ignore[arg-type]
                    elif unit < 0:
                        os.unlink(pack.path)
                        removed += 1
                    else:
                        punch(pack.path, unit * pack.stride, pack.stride)
                        punched += 1
                except FileNotFoundError:
                    pass
                except OSError:
                    failed += pack is not None
            with lock:
                self.deleting.difference_update(k for k, _p, _u in batch if k is not None)
                self.units_punched += punched
                self.packs_removed += removed
                self.punch_errors += failed

    def recover(self, res: ScanResult) -> list[OffloadKey]:
        """Take a start-up scan's blocks: their keys, oldest first; older copies of a key found
        twice, and packs left with no live unit, are queued for deletion."""
        packs = {path: Pack(path, stride, n, 0) for path, (stride, n) in res.packs.items()}
        bases = {path: self._register(pack) for path, pack in packs.items()}
        keys = []
        for _mtime, key, where in res.found:
            keys.append(key)
            if where is not None:
                packs[where[0]].live += 1
                self.units[key] = bases[where[0]] | where[1]
        for path, pack in packs.items():
            if not pack.live:
                del self._packs[bases[path] >> UNIT_BITS]
        for key, where in res.shadowed:
            self._queue.append((key, None, 0) if where is None else (None, packs[where[0]], where[1]))
        self._queue.extend((None, p, -1) for p in packs.values() if not p.live)
        return keys

    def plan_load(self, keys: Iterable[OffloadKey]) -> tuple[list[Run], list[int]]:
        """A load job's packed blocks as runs of consecutive units of one pack (one file open,
        one read each), and the indexes of its blocks that have a file of their own."""
        files: list[int] = []
        found: list[tuple[int, int]] = []  # (place, job index): sorted, a pack's units are consecutive places
        units = self.units
        for j, key in enumerate(keys):
            where = units.get(key)
            if where is None:
                files.append(j)
            else:
                found.append((where, j))
        found.sort()
        runs: list[Run] = []
        start = 0
        for i in range(1, len(found) + 1):
            if i == len(found) or found[i][0] != found[i - 1][0] + 1:
                first = found[start][0]
                runs.append((self._packs[first >> UNIT_BITS], first & UNIT_MASK, [j for _w, j in found[start:i]]))
                start = i
        return runs, files

    @property
    def packs(self) -> int:
        """Pack files holding live blocks (a registered pack leaves with its last live unit)."""
        return len(self._packs)

    def stats(self) -> dict[str, int | str]:
        return {"layout": "pack" if self.pack_blocks > 1 else "block", "pack_blocks": self.pack_blocks,
                "pack_below": self.pack_below, "packs": self.packs, "packs_written": self.packs_written, "packs_removed": self.packs_removed,
                "units_punched": self.units_punched, "punch_errors": self.punch_errors}
