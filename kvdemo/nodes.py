"""The simulated engines of the demo: a SimEngine over a real tiered manager (CPU primary plus
the ``fs`` tier in a directory of its own), optionally publishing over ZeroMQ."""

from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from pathlib import Path

from kvevents.events import KVEventBatch
from kvevents.publisher import ZmqEventPublisher
from manager.cpu import CPUOffloadingManager
from manager.engine_sim import SimEngine
from manager.spec_cpu import CPUOffloadingSpec
from manager.tiering import TieringOffloadingManager

__all__ = ["EngineSizing", "Node", "make_node"]


@dataclass(slots=True)
class EngineSizing:
    gpu_blocks: int = 192
    block_size: int = 16
    offload_block_size: int = 32
    cpu_blocks: int = 96  #: offloaded chunks the CPU primary holds
    fs_blocks: int = 384  #: offloaded chunks the fs tier holds
    max_num_seqs: int = 6
    max_tokens_per_step: int = 2048


class LiveDropper:
    """``drop_live`` fault injection: keeps a seeded fraction of batches off the live socket
    (they stay in the replay ring), never seq 0, and nothing once ``closing`` is set."""

    def __init__(self, rate: float, seed: int) -> None:
        self.rate = rate
        self._rng = random.Random(seed)
        self.closing = threading.Event()
        self.dropped = 0

    def __call__(self, seq: int) -> bool:
        if seq == 0 or self.rate <= 0 or self.closing.is_set():
            return False
        if self._rng.random() < self.rate:
            self.dropped += 1
            return True
        return False


@dataclass(slots=True, eq=False)
class Node:
    name: str
    engine: SimEngine
    manager: TieringOffloadingManager
    fs_dir: Path
    publisher: ZmqEventPublisher | None = None
    endpoint: str | None = None
    replay_endpoint: str | None = None
    topic: str | None = None
    dropper: LiveDropper | None = None
    admitted: int = 0
    prompt_tokens: int = 0

    @property
    def in_flight(self) -> int:
        return self.admitted - self.engine.requests_finished

    @property
    def primary(self) -> CPUOffloadingManager:
        return self.manager.primary  # type: ignore[return-value]

    @property
    def fs(self):
        return self.manager.tiers[0]

    def published(self) -> int:
        """Batches this node's publisher numbered (what a subscriber must account for)."""
        return self.publisher.next_seq if self.publisher is not None else 0

    def close_stream(self) -> None:
        """Stop injecting drops and publish one empty batch, so a dropped tail shows up as a gap."""
        if self.publisher is not None:
            if self.dropper is not None:
                self.dropper.closing.set()
            self.publisher.publish(KVEventBatch(ts=self.engine.clock(), events=[], data_parallel_rank=0))

    def shutdown_engine(self) -> None:
        self.engine.shutdown()
        self.manager.shutdown()


def make_node(name: str, root: Path, sizing: EngineSizing, *, model: str | None = None,
              drop_rate: float = 0.0, seed: int = 0, publish: bool = True, topic: str | None = None,
              endpoint: str | None = None, replay_endpoint: str | None = None, publisher=None) -> Node:
    """An engine called ``name`` with its fs tier under ``root/name-fs``; when ``publish``,
    a ZeroMQ publisher on ``endpoint`` (default ``ipc://root/name.pub``) with its replay socket
    on ``replay_endpoint`` (default beside it), on ``topic`` (default ``kv@name@model``; vLLM's
    default is ``""``). A ``publisher`` given is used as is (say, one EventPublisherFactory built
    from a vLLM-style ``--kv-events-config``)."""
    fs_dir = root / f"{name}-fs"
    spec = CPUOffloadingSpec(sizing.cpu_blocks, cache_policy="lru", enable_events=publish,
                             offloaded_block_size=sizing.offload_block_size,
                             secondary_tiers=[{"type": "fs", "root": str(fs_dir), "capacity_blocks": sizing.fs_blocks,
                                               "num_threads": 1}])
    pub = replay = dropper = None
    if publisher is not None:
        pub = publisher
    elif publish:
        endpoint = endpoint or f"ipc://{root}/{name}.pub"
        replay = replay_endpoint or f"ipc://{root}/{name}.replay"
        topic = f"kv@{name}@{model}" if topic is None else topic
        dropper = LiveDropper(drop_rate, seed)
        pub = ZmqEventPublisher(endpoint, replay, topic=topic, drop_live=dropper, replay_rate=200.0,
                                replay_burst=20)
    engine = SimEngine(spec, pub, gpu_blocks=sizing.gpu_blocks, block_size=sizing.block_size,
                       max_num_seqs=sizing.max_num_seqs, max_tokens_per_step=sizing.max_tokens_per_step,
                       use_torch=False)
    return Node(name, engine, engine.manager, fs_dir, pub, endpoint, replay, topic, dropper)  # type: ignore[arg-type]
