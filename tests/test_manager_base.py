"""manager.base: keys, specs, BlockIO, and that importing manager does not import torch."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from manager import (
    LoadStoreSpec,
    LookupResult,
    NumpyBlockIO,
    OffloadingEvent,
    OffloadPolicy,
    RequestOffloadingContext,
    make_offload_key,
    split_offload_key,
)


@pytest.mark.parametrize("group", [0, 1, 15, 16, 255, 2**32 - 1])
def test_offload_key_round_trip(group: int) -> None:
    h = bytes(range(32))
    key = make_offload_key(h, group)
    assert key[:32] == h and len(key) == 36
    assert key[32:] == group.to_bytes(4, "big")
    assert split_offload_key(key) == (h, group)


def test_offload_key_errors() -> None:
    with pytest.raises(TypeError, match="block_hash must be bytes"):
        make_offload_key(12345, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="out of range"):
        make_offload_key(b"x", 2**32)
    with pytest.raises(ValueError, match="not an offload key"):
        split_offload_key(b"ab")


def test_defaults_and_spec_dtype() -> None:
    assert RequestOffloadingContext().policy is OffloadPolicy.BLOCK_LEVEL
    spec = LoadStoreSpec("CPU", [3, 1, 2])  # type: ignore[arg-type]
    assert spec.block_ids.dtype == np.int64 and spec.block_ids.tolist() == [3, 1, 2] and len(spec) == 3
    ev = OffloadingEvent([b"k"], "CPU", False)
    assert not hasattr(ev, "block_size")
    assert {r.name for r in LookupResult} == {"HIT", "MISS", "RETRY"}


def test_numpy_block_io() -> None:
    arr = np.zeros((4, 2, 3), dtype=np.float32)
    io = NumpyBlockIO(arr)
    assert io.block_nbytes == 24 and io.num_blocks == 4
    payload = np.arange(6, dtype=np.float32).tobytes()
    io.write_block(2, payload)
    assert arr[2].ravel().tolist() == [0, 1, 2, 3, 4, 5]
    view = io.read_block(2)
    assert bytes(view) == payload and view.readonly
    with pytest.raises(ValueError, match="got 3 bytes"):
        io.write_block(0, b"abc")
    with pytest.raises(IndexError):
        io.read_block(4)
    with pytest.raises(TypeError):
        NumpyBlockIO(arr[:, :, ::2])


def test_import_manager_does_not_import_torch() -> None:
    code = (
        "import sys, manager; manager.CPUOffloadingManager; manager.TieringOffloadingManager;"
        "manager.FileSystemSecondaryTierManager; assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
