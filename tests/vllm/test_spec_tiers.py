"""A tier written for vLLM's SecondaryTierManager (``vllm-kvblockd``'s) in our tiering manager.

kvblockd's client package is replaced by an in-memory stand-in of its server (the modules
``kvblockd.client`` / ``protocol`` / ``errors`` / ``hashing`` that ``vllm_kvblockd`` imports);
``vllm_kvblockd``'s own tier class runs unchanged, built with vLLM's signature by
``kvevents_vllm.vllm_tiers.VllmTier``.
"""

from __future__ import annotations

import enum
import importlib.util
import os
import sys
import threading
import types

import numpy as np
import pytest

from manager.base import LookupResult, NumpyBlockIO, ReqContext, make_offload_key
from manager.spec_cpu import CPUOffloadingSpec

from ..service_helpers import wait_for

if importlib.util.find_spec("vllm_kvblockd") is None:
    if os.environ.get("KVEVENTS_REQUIRE_VLLM") == "1":  # the real-engine run (tests/vllm/setup-venv.sh installs it)
        raise ImportError("vllm-kvblockd is not installed (pip install --no-deps vllm-kvblockd==0.1.0)")
    pytest.skip("vllm-kvblockd not installed (pip install --no-deps vllm-kvblockd==0.1.0)", allow_module_level=True)

BLOCK = 256
CPU_BLOCKS = 4


class FakeServer:
    """kvblockd's daemon, in memory: key -> blob."""

    def __init__(self) -> None:
        self.blobs: dict[bytes, bytes] = {}
        self.lock = threading.Lock()
        self.puts = self.gets = self.exists_calls = 0


def _stand_in(server: FakeServer) -> dict[str, types.ModuleType]:
    pkg = types.ModuleType("kvblockd")
    pkg.__path__ = []  # a package

    protocol = types.ModuleType("kvblockd.protocol")

    class Status(enum.Enum):
        OK = 0
        NOT_FOUND = 1

    protocol.Status = Status
    protocol.TOUCH_RECENCY = 1

    errors = types.ModuleType("kvblockd.errors")

    class ConnectionLost(Exception):
        pass

    errors.ConnectionLost = ConnectionLost

    hashing = types.ModuleType("kvblockd.hashing")

    class DeterminismError(Exception):
        pass

    hashing.DeterminismError = DeterminismError
    hashing.startup_determinism_check = lambda: None

    client = types.ModuleType("kvblockd.client")

    class Client:
        def __init__(self, addr, **kw) -> None:
            self.addr = addr

        def put(self, key: bytes, data) -> None:
            with server.lock:
                server.puts += 1
                server.blobs.setdefault(bytes(key), bytes(data))  # write-once, as kvblockd

        def batch_exists(self, keys):
            with server.lock:
                server.exists_calls += 1
                return 0, [k in server.blobs for k in keys]

        def batch_get_scatter(self, keys, prefix_len, alloc, deadline=None):
            out = []
            for i, k in enumerate(keys):
                with server.lock:
                    blob = server.blobs.get(bytes(k))
                    server.gets += 1
                dst = None if blob is None else alloc(i, b"", len(blob))
                if dst is None:
                    out.append(Status.NOT_FOUND)
                    continue
                dst[:] = blob
                out.append(Status.OK)
            return out

        def touch_lease(self, keys, mode) -> None:
            pass

        def close(self) -> None:
            pass

    client.Client = Client
    pkg.protocol, pkg.errors, pkg.hashing, pkg.client = protocol, errors, hashing, client
    return {"kvblockd": pkg, "kvblockd.protocol": protocol, "kvblockd.errors": errors,
            "kvblockd.hashing": hashing, "kvblockd.client": client}


@pytest.fixture
def server(monkeypatch):
    srv = FakeServer()
    for name, mod in _stand_in(srv).items():
        monkeypatch.setitem(sys.modules, name, mod)
    for name in [n for n in sys.modules if n.startswith("vllm_kvblockd")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setenv("KVBLOCKD_SKIP_HASHSEED_CHECK", "1")
    from kvevents_vllm.vllm_tiers import register_vllm_tiers

    register_vllm_tiers()
    return srv


def K(i: int) -> bytes:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def until(pred, m, what: str, timeout: float = 120.0):
    """:func:`wait_for` with the manager stepped between looks (a scheduler step ended, the
    tier's jobs waited for): the tier answers EXISTS on its own thread."""

    def stepped():
        v = pred()
        if not v:
            m.on_schedule_end()
            m.drain_jobs(timeout=10)
        return v

    return wait_for(stepped, timeout, lambda: f"{what}; tiering manager {m.stats()}")


def test_kvblockd_tier_stores_evicts_and_loads_back(server):
    spec = CPUOffloadingSpec(CPU_BLOCKS, secondary_tiers=[{
        "type": "vllm", "module_path": "vllm_kvblockd.tier_manager", "class_name": "KvblockdTierManager",
        "n_read_threads": 1, "n_write_threads": 1}])
    m = spec.get_manager()
    io = NumpyBlockIO.allocate(CPU_BLOCKS, BLOCK)
    m.bind_block_io(io)
    tier = m.tiers[0]
    assert type(tier.inner).__name__ == "KvblockdTierManager"  # vLLM's signature: (spec, view, type)
    ctx = ReqContext("r1")
    m.on_new_request(ctx)
    rng = np.random.default_rng(0)
    data = {}
    for i in range(2 * CPU_BLOCKS):  # twice the CPU tier: the first half is evicted from it
        out = m.prepare_store([K(i)], ctx)
        until(lambda: out is not None, m, "room in the CPU tier")
        b = int(out.store_spec.block_ids[0])
        data[i] = rng.integers(0, 256, BLOCK, dtype=np.uint8).tobytes()
        io.write_block(b, data[i])
        m.complete_store([K(i)], ctx)
        until(lambda: not m.has_pending_work(), m, "the cascade store to kvblockd")
    assert len(server.blobs) == 2 * CPU_BLOCKS  # every block reached the (stand-in) server
    assert set(server.blobs.values()) == set(data.values())
    # block 0 left the CPU tier; kvblockd holds it: promoted back, then a HIT with its bytes
    assert m.primary.lookup(K(0), ctx) is LookupResult.MISS
    io.array[:] = 0
    until(lambda: m.lookup(K(0), ctx) is LookupResult.HIT, m, "K(0) promoted from kvblockd")
    spec_out = m.prepare_load([K(0)], ctx)
    assert io.read_block(int(spec_out.block_ids[0])).tobytes() == data[0]
    m.complete_load([K(0)], ctx)
    # a key kvblockd never had stays a MISS (after its EXISTS round trip)
    until(lambda: m.lookup(K(99), ctx) is LookupResult.MISS, m, "K(99) a miss")
    m.on_request_finished(ctx)
    m.shutdown()


def test_vllm_tier_type_errors_name_the_problem(server):
    from kvevents.errors import ConfigError
    from manager.tiering import SecondaryTierFactory

    with pytest.raises(ConfigError, match="no_such_module"):
        SecondaryTierFactory.create_secondary_tier({"type": "vllm", "module_path": "no_such_module",
                                                    "class_name": "X"})
    with pytest.raises(ConfigError, match="not a vLLM SecondaryTierManager"):
        SecondaryTierFactory.create_secondary_tier({"type": "vllm", "module_path": "manager.tiering.fs",
                                                    "class_name": "FileSystemSecondaryTierManager"})
    with pytest.raises(ConfigError, match="knows no tier type 'nope'"):
        SecondaryTierFactory.create_secondary_tier({"type": "vllm", "vllm_type": "nope"})
