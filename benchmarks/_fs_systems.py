"""The systems benchmarks/fs_tier.py compares: ours, the plain loop, and the limit rows (the
device, the readahead ceiling, a file-per-job sketch). vLLM's row stays in fs_tier.py."""

from __future__ import annotations

import itertools
import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any, Callable

import numpy as np

from manager import NumpyBlockIO
from manager.tiering import JobMetadata
from manager.tiering.fs import FileSystemSecondaryTierManager

JOB = 64
O_DIRECT = getattr(os, "O_DIRECT", 0)


def disk_reads(path: str) -> tuple[int, int] | None:
    """(reads completed, sectors read) of the block device holding ``path``, from
    /proc/diskstats (the whole device: other processes' reads count too), or None."""
    dev = os.stat(path).st_dev
    try:
        with open("/proc/diskstats") as f:
            for line in f:
                p = line.split()
                if int(p[0]) == os.major(dev) and int(p[1]) == os.minor(dev):
                    return int(p[3]), int(p[5])
    except (OSError, ValueError, IndexError):
        pass
    return None


def aligned_buffer(nblocks: int, nbytes: int) -> np.ndarray:
    m = mmap.mmap(-1, nblocks * nbytes)
    return np.frombuffer(m, dtype=np.uint8).reshape(nblocks, nbytes)


class System:
    name = ""

    def setup(self, root: str, host: np.ndarray) -> None: ...

    def store(self, keys: list[bytes], n: int) -> None: ...

    def load(self, keys: list[bytes], n: int) -> None: ...

    def close(self) -> None: ...


class TierSystem(System):
    """A system driving a tier through jobs: ``_run(keys, n, load)`` and ``self.tier``."""

    tier: Any

    def _run(self, keys: list[bytes], n: int, load: bool) -> None:
        raise NotImplementedError

    def store(self, keys: list[bytes], n: int) -> None:
        self._run(keys, n, False)

    def load(self, keys: list[bytes], n: int) -> None:
        self._run(keys, n, True)

    def close(self) -> None:
        self.tier.shutdown()


class Ours(TierSystem):
    def __init__(self, **cfg: Any) -> None:
        self.cfg = cfg
        self.name = "ours" + ("" if not cfg else " " + ",".join(f"{k}={v}" for k, v in cfg.items()))

    def setup(self, root: str, host: np.ndarray) -> None:
        self.tier = FileSystemSecondaryTierManager(root=root, block_io=NumpyBlockIO(host), enable_events=False,
                                                   store_policy="unbounded", **self.cfg)

    def _run(self, keys: list[bytes], n: int, load: bool) -> None:
        t = self.tier
        for j, i in enumerate(range(0, n, JOB)):
            job = JobMetadata(j, keys[i : i + JOB], np.arange(i, min(i + JOB, n), dtype=np.int64), load)
            (t.submit_load if load else t.submit_store)(job)
        assert t.drain_jobs(timeout=600)
        bad = [r for r in t.get_finished_jobs() if not r.success]
        if bad:
            raise RuntimeError(f"ours: {len(bad)} jobs failed ({t.stats()})")


class Plain(System):
    name = "plain os.write/os.readv, 32 threads"

    def setup(self, root: str, host: np.ndarray) -> None:
        self.root, self.host = root, host
        self.pool = ThreadPoolExecutor(32)
        for i in range(256):
            os.makedirs(os.path.join(root, f"{i:02x}"), exist_ok=True)

    def _path(self, key: bytes) -> str:
        h = key.hex()
        return f"{self.root}/{h[-2:]}/{h}"

    def _store_job(self, keys: list[bytes], lo: int) -> None:
        for k, key in enumerate(keys):
            fd = os.open(self._path(key), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, self.host[lo + k])
            finally:
                os.close(fd)

    def _load_job(self, keys: list[bytes], lo: int) -> None:
        for k, key in enumerate(keys):
            fd = os.open(self._path(key), os.O_RDONLY)
            try:
                if os.readv(fd, [self.host[lo + k]]) != self.host.shape[1]:
                    raise RuntimeError("plain: short read")
            finally:
                os.close(fd)

    def _run(self, fn: Callable[[list[bytes], int], None], keys: list[bytes], n: int) -> None:
        futs = [self.pool.submit(fn, keys[i : i + JOB], i) for i in range(0, n, JOB)]
        wait(futs)
        for f in futs:
            f.result()

    def store(self, keys: list[bytes], n: int) -> None:
        self._run(self._store_job, keys, n)

    def load(self, keys: list[bytes], n: int) -> None:
        self._run(self._load_job, keys, n)

    def close(self) -> None:
        self.pool.shutdown()


class Device(Plain):
    """The device's limit at this request size: the same bytes as one request per block,
    ``O_DIRECT`` at page-aligned offsets of one preallocated file (no file per block, no
    metadata), 32 threads, in job order."""

    name = "device: O_DIRECT pwrite/preadv, 1 file, 32 threads"

    def setup(self, root: str, host: np.ndarray) -> None:
        self.root, self.host = root, host
        self.pool = ThreadPoolExecutor(32)
        self.fd = os.open(os.path.join(root, "device"), os.O_RDWR | os.O_CREAT | O_DIRECT, 0o644)
        os.posix_fallocate(self.fd, 0, host.size)

    def _store_job(self, keys: list[bytes], lo: int) -> None:
        nbytes = self.host.shape[1]
        for k in range(len(keys)):
            if os.pwrite(self.fd, self.host[lo + k], (lo + k) * nbytes) != nbytes:
                raise RuntimeError("device: short write")

    def _load_job(self, keys: list[bytes], lo: int) -> None:
        nbytes = self.host.shape[1]
        for k in range(len(keys)):
            if os.preadv(self.fd, [self.host[lo + k]], (lo + k) * nbytes) != nbytes:
                raise RuntimeError("device: short read")

    def close(self) -> None:
        super().close()
        os.close(self.fd)


class Sequential(Device):
    """The disk's ceiling (``benchmarks/fs_ceiling.py``'s best cell): the device row's file
    read back buffered as ONE sequential stream (32 threads, each taking the next block), so
    the kernel's readahead keeps multi-MiB disk requests in flight. No file per block, no
    header, no checksum, and a load order that is the store order: what a layout would read
    at only if a whole load were one contiguous run on disk."""

    name = "ceiling: 1 file, 1 sequential stream, buffered"

    def setup(self, root: str, host: np.ndarray) -> None:
        super().setup(root, host)
        self.path = os.path.join(root, "device")

    def load(self, keys: list[bytes], n: int) -> None:
        fd = os.open(self.path, os.O_RDONLY)
        nbytes, host, nxt = self.host.shape[1], self.host, itertools.count()

        def reader() -> None:
            while (i := next(nxt)) < n:
                if os.preadv(fd, [host[i]], i * nbytes) != nbytes:
                    raise RuntimeError("ceiling: short read")

        try:
            futs = [self.pool.submit(reader) for _ in range(32)]
            wait(futs)
            for f in futs:
                f.result()
        finally:
            os.close(fd)


class JobFiles(Plain):
    """A sketch of a multi-block layout (not the tier): each store job's blocks in one file,
    a 4 KiB header page (key, CRC32C of the payload) before each block, written with one
    ``O_DIRECT`` ``pwritev`` and renamed into place; a load job reads its file with one
    buffered ``preadv`` (readahead: multi-MiB disk requests) straight into the slots and
    checks every key and CRC. What such a layout would read at, before eviction, compaction,
    a scan and shared roots are paid for."""

    name = "sketch: a file per job (64 blocks), buffered"
    _HDR = 4096
    _flags = os.O_RDONLY
    _willneed = False
    _per_block = False

    def setup(self, root: str, host: np.ndarray) -> None:
        from manager.tiering import fs_io

        self.root, self.host = root, host
        self.pool = ThreadPoolExecutor(32)
        self.crc = fs_io.crc32c or fs_io.crc32c_python
        self.local = threading.local()

    def _headers(self, n: int) -> np.ndarray:
        h = getattr(self.local, "h", None)
        if h is None or h.shape[0] < n:
            h = self.local.h = aligned_buffer(max(n, JOB), self._HDR)
        return h

    def _path(self, key: bytes) -> str:
        return f"{self.root}/{key.hex()}.job"

    def _store_job(self, keys: list[bytes], lo: int) -> None:
        hdr = self._headers(len(keys))
        iov: list[Any] = []
        for k, key in enumerate(keys):
            hdr[k, :8] = np.frombuffer(self.crc(self.host[lo + k]).to_bytes(8, "big"), np.uint8)
            hdr[k, 8 : 8 + len(key)] = np.frombuffer(key, np.uint8)
            iov += [hdr[k], self.host[lo + k]]
        path = self._path(keys[0])
        fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_DIRECT, 0o644)
        try:
            if os.pwritev(fd, iov, 0) != len(keys) * (self._HDR + self.host.shape[1]):
                raise RuntimeError("job files: short write")
        finally:
            os.close(fd)
        os.rename(path + ".tmp", path)

    def _load_job(self, keys: list[bytes], lo: int) -> None:
        hdr = self._headers(len(keys))
        iov = [v for k in range(len(keys)) for v in (hdr[k], self.host[lo + k])]
        fd = os.open(self._path(keys[0]), self._flags)
        try:
            if self._willneed:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            if self._per_block:  # a read per block, in order: readahead runs ahead of them
                step = self._HDR + self.host.shape[1]
                for k in range(len(keys)):
                    if os.preadv(fd, iov[2 * k : 2 * k + 2], k * step) != step:
                        raise RuntimeError("job files: short read")
            elif os.preadv(fd, iov, 0) != len(keys) * (self._HDR + self.host.shape[1]):
                raise RuntimeError("job files: short read")
        finally:
            os.close(fd)
        for k, key in enumerate(keys):
            if hdr[k, 8 : 8 + len(key)].tobytes() != key or int.from_bytes(hdr[k, :8].tobytes(), "big") != self.crc(self.host[lo + k]):
                raise RuntimeError("job files: key or checksum mismatch")


class JobFilesWillneed(JobFiles):
    """The same files, buffered, the whole file ``posix_fadvise(WILLNEED)`` before the read
    (all its readahead queued at once)."""

    name = "sketch: a file per job (64 blocks), WILLNEED"
    _willneed = True


class JobFilesPerBlock(JobFiles):
    """The same files, buffered, one ``preadv`` per block in file order (the kernel's
    readahead runs ahead of the reads)."""

    name = "sketch: a file per job (64 blocks), buffered, a read per block"
    _per_block = True


class JobFilesDirect(JobFiles):
    """The same files read with ``O_DIRECT`` (one request of the job's blocks, scattered into the slots)."""

    name = "sketch: a file per job (64 blocks), O_DIRECT"
    _flags = os.O_RDONLY | O_DIRECT
