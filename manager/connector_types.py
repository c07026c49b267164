"""The engine-side types the scheduler connector speaks: our own minimal model of a request,
a scheduler step's output, and the jobs the connector hands the transfer worker.

They mirror what an engine scheduler knows (no vLLM import): a request's block hashes and
token counts, which requests a step schedules (new ones with their GPU block ids, running
ones with the blocks they gained), how many tokens each computes, and which requests were
preempted or finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvevents.errors import KVEventsError

from .base import OffloadKey

LOAD = "load"
STORE = "store"


class ConnectorError(KVEventsError, ValueError):
    """The engine told the connector something inconsistent (the message says what)."""


@dataclass(slots=True, eq=False)
class EngineRequest:
    """A request as the scheduler sees it.

    ``block_hashes`` are the hashes of the request's full GPU blocks so far (the engine
    appends to the list as the request grows); ``num_tokens`` counts prompt and output
    tokens so far; ``num_computed_tokens`` those whose KV is computed.
    """

    req_id: str
    block_hashes: list[bytes]
    num_tokens: int
    num_prompt_tokens: int | None = None
    num_computed_tokens: int = 0
    lora_name: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    finished: bool = False

    def __post_init__(self) -> None:
        if self.num_prompt_tokens is None:
            self.num_prompt_tokens = self.num_tokens


@dataclass(slots=True)
class NewRequestData:
    """A request scheduled for the first time (or again after a preemption)."""

    request: EngineRequest
    block_ids: list[int]
    num_computed_tokens: int


@dataclass(slots=True)
class CachedRequestData:
    """A running request scheduled again: the GPU blocks it gained this step.

    ``resumed_from_preemption``: ``new_block_ids`` are all its blocks, replacing the old ones.
    """

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    resumed_from_preemption: bool = False


@dataclass(slots=True)
class SchedulerOutput:
    """One scheduler step: who runs, how many tokens each computes, who left."""

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)


@dataclass(slots=True)
class TransferJob:
    """One copy for the transfer worker, in device-block rows on both sides.

    A load copies host rows ``src_block_ids`` to GPU blocks ``dst_block_ids``; a store copies
    GPU blocks ``src_block_ids`` to host rows ``dst_block_ids``. ``keys`` are the offloaded
    blocks it covers (what the manager is told when the job completes).
    """

    job_id: int
    req_id: str
    kind: str
    keys: list[OffloadKey]
    src_block_ids: np.ndarray
    dst_block_ids: np.ndarray


@dataclass(slots=True)
class ConnectorMetadata:
    """What ``build_connector_meta`` hands the worker side for one step.

    ``jobs_to_flush``: jobs the worker must finish before the step's blocks may be reused
    (store jobs of preempted requests; every pending job once no request remains).
    """

    load_jobs: list[TransferJob] = field(default_factory=list)
    store_jobs: list[TransferJob] = field(default_factory=list)
    jobs_to_flush: set[int] = field(default_factory=set)


@dataclass(slots=True)
class ConnectorUpdate:
    """What ``update_connector_output`` concluded: requests whose load finished or failed,
    requests released (state dropped after ``on_request_finished``)."""

    loaded: set[str] = field(default_factory=set)
    failed_loads: set[str] = field(default_factory=set)
    released: set[str] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)
