"""The transfer worker: round trips on CPU (torch and numpy), CUDA when present, typed errors,
failed jobs reported (never hung)."""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from manager.transfer import (  # noqa: E402
    BlockIdError,
    DuplicateJobError,
    NumpyTransferWorker,
    ShapeMismatchError,
    TorchTransferWorker,
    TransferError,
    WorkerClosedError,
    expand_block_ids,
)
from manager.spec import create_transfer_worker  # noqa: E402
from manager.transfer_base import contiguous_runs  # noqa: E402

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
    ),
]


def _dev_cache(device: str, n: int = 16, shape=(2, 3), dtype=torch.float32):
    numel = n * int(np.prod(shape))
    return torch.arange(numel, dtype=dtype).reshape(n, *shape).to(device)


@pytest.mark.parametrize("device", DEVICES)
def test_store_then_load_round_trip(device):
    dev = _dev_cache(device)
    original = dev.clone()
    w = TorchTransferWorker(dev, 10)
    try:
        if device == "cuda":
            assert w.host_cache.is_pinned()
        else:
            assert w.host_cache.device.type == "cpu"
        w.submit_store(1, [3, 4, 5], [0, 1, 2])  # one contiguous run
        w.submit_store(2, [9, 0, 15], [7, 3, 9])  # scattered
        assert w.wait(timeout=30)
        res = {r.job_id: r for r in w.get_finished()}
        assert set(res) == {1, 2} and all(r.success and r.direction == "store" for r in res.values())
        host = w.host_cache
        for d, h in [(3, 0), (4, 1), (5, 2), (9, 7), (0, 3), (15, 9)]:
            assert torch.equal(host[h], original[d].cpu())
        dev.zero_()
        w.submit_load(3, [0, 1, 2, 7, 3, 9], [3, 4, 5, 9, 0, 15])
        assert w.wait([3], timeout=30)
        [r] = w.get_finished()
        assert (r.job_id, r.success, r.direction, r.num_blocks) == (3, True, "load", 6)
        for b in [3, 4, 5, 9, 0, 15]:
            assert torch.equal(dev[b], original[b])
        assert int(dev[1].abs().sum()) == 0  # untouched rows stay untouched
        s = w.stats()
        assert s["jobs_succeeded"] == 3 and s["blocks_copied"] == 12 and s["jobs_in_flight"] == 0
        assert s["bytes_copied"] == 12 * 6 * 4
    finally:
        w.shutdown()


@pytest.mark.parametrize("device", DEVICES)
def test_given_host_buffer_is_used_and_checked(device):
    dev = _dev_cache(device, n=4)
    host = torch.zeros((6, 2, 3), dtype=torch.float32)
    w = TorchTransferWorker(dev, host)
    try:
        w.submit_store(0, [1, 2], [5, 4])
        w.wait(timeout=30)
        assert w.get_finished()[0].success
        assert torch.equal(w.host_cache[5], dev[1].cpu()) and torch.equal(w.host_cache[4], dev[2].cpu())
    finally:
        w.shutdown()
    with pytest.raises(ShapeMismatchError, match=r"host block shape \(3, 2\) != device block shape \(2, 3\)"):
        TorchTransferWorker(dev, torch.zeros((6, 3, 2)))
    with pytest.raises(ShapeMismatchError, match="dtype"):
        TorchTransferWorker(dev, torch.zeros((6, 2, 3), dtype=torch.float16))
    with pytest.raises(ShapeMismatchError):
        TorchTransferWorker(dev, torch.zeros((0, 2, 3)))
    with pytest.raises(ValueError):
        TorchTransferWorker(dev, 0)


def test_bad_block_ids_are_typed_and_say_what_is_wrong():
    w = TorchTransferWorker(_dev_cache("cpu", n=8), 4)
    try:
        with pytest.raises(BlockIdError, match=r"store job 1 device ids: block id 8 out of range \[0, 8\)"):
            w.submit_store(1, [7, 8], [0, 1])
        with pytest.raises(BlockIdError, match=r"load job 2 host ids: block id -1 out of range"):
            w.submit_load(2, [-1], [0])
        with pytest.raises(BlockIdError, match="load job 3 device ids: block id 9"):
            w.submit_load(3, [0], [9])
        with pytest.raises(BlockIdError, match="3 source block ids but 2 destination"):
            w.submit_store(4, [0, 1, 2], [0, 1])
        with pytest.raises(BlockIdError, match="must be 1-D"):
            w.submit_store(5, [[0, 1]], [[0, 1]])
        with pytest.raises(BlockIdError, match="must be integers"):
            w.submit_store(6, [0.5], [1])
        with pytest.raises(BlockIdError, match="duplicate destination"):
            w.submit_store(7, [0, 1], [2, 2])
        with pytest.raises(TypeError):
            w.submit_store("x", [0], [0])
        assert isinstance(BlockIdError("x"), TransferError)
        assert w.stats()["jobs_submitted"] == 0  # nothing half-submitted
        # numpy arrays and tensors are accepted as ids too
        w.submit_store(8, np.array([0, 1]), torch.tensor([2, 3]))
        assert w.wait(timeout=30) and w.get_finished()[0].success
    finally:
        w.shutdown()


def test_duplicate_in_flight_job_id_and_closed_worker():
    w = NumpyTransferWorker(np.zeros((4, 2)), 4)
    gate = threading.Event()
    original = w._copy

    def slow(job):
        gate.wait(30)
        original(job)

    w._copy = slow
    w.submit_store(1, [0], [0])
    with pytest.raises(DuplicateJobError, match="job id 1 is already in flight"):
        w.submit_store(1, [1], [1])
    gate.set()
    assert w.wait(timeout=30)
    w.submit_store(1, [1], [1])  # finished ids may be reused
    w.shutdown()
    with pytest.raises(WorkerClosedError):
        w.submit_load(2, [0], [0])


def test_a_failing_job_is_reported_failed_and_the_worker_goes_on():
    w = TorchTransferWorker(_dev_cache("cpu", n=4), 4)
    original = w._copy

    def flaky(job):
        if job.job_id == 2:
            raise RuntimeError("simulated DMA error")
        original(job)

    w._copy = flaky
    try:
        for j in (1, 2, 3):
            w.submit_store(j, [j], [j])
        assert w.wait(timeout=30)
        res = {r.job_id: r for r in w.get_finished()}
        assert res[1].success and res[3].success
        assert not res[2].success and "simulated DMA error" in res[2].error
        assert w.stats()["jobs_failed"] == 1
    finally:
        w.shutdown()


def test_shutdown_reports_jobs_that_never_ran_as_failed():
    w = NumpyTransferWorker(np.zeros((4, 2)), 4)
    started, gate = threading.Event(), threading.Event()
    original = w._copy

    def blocked(job):
        started.set()
        gate.wait(30)
        original(job)

    w._copy = blocked
    w.submit_store(1, [0], [0])
    w.submit_store(2, [1], [1])
    assert started.wait(30)
    assert not w.wait(timeout=0.01)  # a timeout answers False instead of hanging
    releaser = threading.Timer(0.05, gate.set)
    releaser.start()
    w.shutdown(timeout=0.0)  # job 1 is running, job 2 never starts
    releaser.join()
    res = {r.job_id: r for r in w.get_finished()}
    assert not res[2].success and res[2].error == "worker shut down"
    assert w.in_flight() <= {1}


def test_numpy_worker_round_trip_and_factory():
    dev = np.arange(24, dtype=np.int64).reshape(6, 4)
    w = create_transfer_worker(dev, 3)
    assert isinstance(w, NumpyTransferWorker)
    try:
        w.submit_store(5, [5, 0], [0, 2])
        w.wait(timeout=30)
        assert w.get_finished()[0].success
        assert (w.host_cache[0] == dev[5]).all() and (w.host_cache[2] == dev[0]).all()
        snapshot = dev.copy()
        dev[:] = 0
        w.submit_load(6, [0, 2], [5, 0])
        w.wait(timeout=30)
        assert w.get_finished()[0].success
        assert (dev[5] == snapshot[5]).all() and (dev[0] == snapshot[0]).all() and not dev[1].any()
    finally:
        w.shutdown()
    with pytest.raises(ShapeMismatchError):
        NumpyTransferWorker(dev, np.zeros((3, 5), dtype=np.int64))


def test_run_count_agrees_with_contiguous_runs():
    from manager.transfer_base import run_count

    rng = np.random.default_rng(3)
    for n in (0, 1, 2, 5, 40):
        for _ in range(20):
            src = np.sort(rng.choice(60, n, replace=False)) if rng.random() < 0.5 else rng.choice(60, n, replace=False)
            dst = src + 3 if rng.random() < 0.5 else rng.choice(60, n, replace=False)
            assert run_count(src, dst) == len(contiguous_runs(src, dst))


def test_expand_block_ids_and_runs():
    assert expand_block_ids([2, 0], 3).tolist() == [6, 7, 8, 0, 1, 2]
    assert expand_block_ids([2, 0], 3, skip=2).tolist() == [8, 0, 1, 2]
    assert expand_block_ids([4], 1).tolist() == [4]
    with pytest.raises(ValueError):
        expand_block_ids([1], 0)
    runs = contiguous_runs(np.array([0, 1, 2, 7, 8, 3]), np.array([5, 6, 7, 1, 2, 0]))
    assert runs == [(0, 5, 3), (7, 1, 2), (3, 0, 1)]
    assert contiguous_runs(np.array([], dtype=np.int64), np.array([], dtype=np.int64)) == []


@settings(max_examples=25, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.booleans(), st.lists(st.tuples(st.integers(0, 11), st.integers(0, 7)), min_size=1, max_size=6)),
        min_size=1,
        max_size=8,
    )
)
def test_random_job_sequences_match_a_numpy_model(ops):
    dev = torch.randn(12, 2, 2)
    w = TorchTransferWorker(dev, 8)
    model_dev, model_host = dev.numpy().copy(), np.zeros((8, 2, 2), dtype=np.float32)
    try:
        for job_id, (is_store, pairs) in enumerate(ops):
            pairs = list({(h if is_store else d): (d, h) for d, h in pairs}.values())  # unique destinations
            d_ids, h_ids = [p[0] for p in pairs], [p[1] for p in pairs]
            if is_store:
                w.submit_store(job_id, d_ids, h_ids)
                model_host[h_ids] = model_dev[d_ids]
            else:
                w.submit_load(job_id, h_ids, d_ids)
                model_dev[d_ids] = model_host[h_ids]
            assert w.wait([job_id], timeout=30)  # jobs run in order; check each one
        assert all(r.success for r in w.get_finished())
        np.testing.assert_array_equal(dev.numpy(), model_dev)
        np.testing.assert_array_equal(w.host_cache.numpy(), model_host)
    finally:
        w.shutdown()


def test_import_without_torch_says_how_to_install():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "try:\n    import manager.transfer\nexcept ImportError as e:\n    print(e)\n"
        "import manager.transfer_base, manager.engine_sim\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install 'kvevents[torch]'" in out.stdout
    assert "pip install torch==2.13.0" in out.stdout


@pytest.mark.parametrize(
    "dtype,shape,word",
    [
        (torch.float16, (4, 8), torch.int64),  # 64 bytes a block -> 8-byte words
        (torch.float16, (3,), torch.int16),  # 6 bytes -> 2-byte words
        (torch.float32, (3,), torch.int32),  # 12 bytes -> 4-byte words
        (torch.uint8, (5,), torch.uint8),  # 5 bytes -> bytes
        (torch.bfloat16, (2, 2, 4), torch.int64),
    ],
)
def test_block_rows_views_each_block_as_the_widest_words(dtype, shape, word):
    from manager.transfer import block_rows

    t = torch.arange(6 * int(np.prod(shape))).to(dtype).reshape(6, *shape)
    rows = block_rows(t)
    assert rows.dtype == word and rows.shape[0] == 6
    assert rows.data_ptr() == t.data_ptr()  # a view, not a copy
    assert rows.numel() * rows.element_size() == t.numel() * t.element_size()
    rows[2].zero_()
    assert int(t[2].float().abs().sum()) == 0 and int(t[3].float().abs().sum()) != 0


def test_gather_copy_matches_fancy_indexing():
    from manager.transfer import block_rows, gather_copy

    rng = np.random.default_rng(1)
    src = torch.randn(32, 3, 4)
    dst = torch.zeros(20, 3, 4)
    s_ids = rng.choice(32, 12, replace=False)
    d_ids = rng.choice(20, 12, replace=False)
    expect = dst.clone()
    expect[torch.as_tensor(d_ids)] = src[torch.as_tensor(s_ids)]
    gather_copy(block_rows(dst), block_rows(src), torch.as_tensor(s_ids), torch.as_tensor(d_ids))
    assert torch.equal(dst, expect)


def test_copy_mode_is_checked():
    with pytest.raises(ValueError, match="copy_mode must be one of auto, kernel, dma"):
        TorchTransferWorker(torch.zeros(4, 2), 4, copy_mode="fast")
    with pytest.raises(ValueError, match="dma_min_run_bytes"):
        TorchTransferWorker(torch.zeros(4, 2), 4, dma_min_run_bytes=-1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("mode", ["auto", "kernel", "dma"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.uint8])
def test_cuda_copy_modes_round_trip_scattered_and_contiguous_jobs(mode, dtype):
    n_dev, n_host = 64, 48
    dev = (torch.arange(n_dev * 2 * 6) % 251).to(dtype).reshape(n_dev, 2, 6).cuda()
    original = dev.clone()
    w = TorchTransferWorker(dev, n_host, copy_mode=mode, dma_min_run_bytes=1 << 20)
    try:
        assert w.host_cache.is_pinned()
        rng = np.random.default_rng(7)
        d_ids = rng.choice(n_dev, 40, replace=False)
        h_ids = rng.choice(45, 40, replace=False)  # 45..47 are job 2's
        w.submit_store(1, d_ids, h_ids)  # scattered
        w.submit_store(2, [60, 61, 62], [45, 46, 47])  # one run: always the copy engines
        assert w.wait(timeout=60)
        assert all(r.success for r in w.get_finished())
        host = w.host_cache
        assert torch.equal(host[torch.as_tensor(h_ids)], original[torch.as_tensor(d_ids)].cpu())
        assert torch.equal(host[45:48], original[60:63].cpu())
        dev.zero_()
        torch.cuda.synchronize()
        w.submit_load(3, h_ids, d_ids)
        assert w.wait([3], timeout=60)
        [r] = w.get_finished()
        assert r.success and r.num_blocks == 40
        assert torch.equal(dev[torch.as_tensor(d_ids)], original[torch.as_tensor(d_ids)])
        others = sorted(set(range(n_dev)) - set(d_ids.tolist()))
        assert int(dev[others].float().abs().sum()) == 0  # untouched rows stay untouched
        s = w.stats()
        if mode == "dma":
            assert s["kernel_jobs"] == 0 and s["dma_jobs"] == 3
        else:  # small scattered blocks go through the kernel in auto mode too
            assert s["kernel_jobs"] == 2 and s["dma_jobs"] == 1
        assert w.copy_mode == mode
    finally:
        w.shutdown()


LAYER_CASES = ["numpy", "cpu", pytest.param("cuda-kernel", marks=DEVICES[1].marks),
               pytest.param("cuda-dma", marks=DEVICES[1].marks)]


@pytest.mark.parametrize("case", LAYER_CASES)
def test_a_job_copies_its_block_ids_in_every_layer(case):
    """A KV cache given as layers (one tensor per layer, widths differ, as vLLM hands them):
    one job moves the same ids in each layer, and only those rows."""
    n_dev, n_host, widths = 24, 16, (8, 24, 40)
    rng = np.random.default_rng(3)
    if case == "numpy":
        layers = [rng.integers(-100, 100, (n_dev, w), dtype=np.int16) for w in widths]
        originals = [a.copy() for a in layers]
        w = NumpyTransferWorker(layers, n_host)
        hosts = [h for _, h in w.layers]
        equal = np.array_equal
    else:
        device = "cpu" if case == "cpu" else "cuda"
        layers = [torch.randint(-100, 100, (n_dev, wd), dtype=torch.int16).to(device) for wd in widths]
        originals = [t.clone() for t in layers]
        w = TorchTransferWorker(layers, n_host, copy_mode="auto" if case == "cpu" else case.split("-")[1])
        hosts = [h for _, h in w.layers]
        equal = torch.equal
    try:
        assert w.bytes_per_block == sum(widths) * 2
        d_ids, h_ids = [5, 0, 17, 9], [3, 11, 4, 0]
        w.submit_store(1, d_ids, h_ids)
        assert w.wait(timeout=30) and all(r.success for r in w.get_finished())
        for host, orig in zip(hosts, originals):
            for d, h in zip(d_ids, h_ids):
                assert equal(host[h], orig[d].cpu() if case.startswith("cuda") else orig[d])
        for t in layers:
            t[:] = 0
        w.submit_load(2, h_ids, [1, 2, 3, 20])
        assert w.wait(timeout=30) and all(r.success for r in w.get_finished())
        for t, orig in zip(layers, originals):
            for d_new, d_old in zip([1, 2, 3, 20], d_ids):
                assert equal(t[d_new], orig[d_old])
            untouched = sorted(set(range(n_dev)) - {1, 2, 3, 20})
            assert int(abs(t[untouched]).sum()) == 0
    finally:
        w.shutdown()


def test_layers_that_do_not_fit_together_are_refused_by_name():
    with pytest.raises(ShapeMismatchError, match="different numbers of device blocks"):
        TorchTransferWorker([torch.zeros(4, 2), torch.zeros(5, 2)], 4)
    with pytest.raises(ShapeMismatchError, match="2 host layers for 3 device layers"):
        NumpyTransferWorker([np.zeros((4, 2))] * 3, [np.zeros((4, 2))] * 2)
    with pytest.raises(ShapeMismatchError, match="host layers with different numbers of blocks"):
        TorchTransferWorker([torch.zeros(4, 2), torch.zeros(4, 3)], [torch.zeros(4, 2), torch.zeros(6, 3)])
    with pytest.raises(ShapeMismatchError, match="empty list of layers"):
        NumpyTransferWorker([], 4)
