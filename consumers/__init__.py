"""consumers: the router index and scorer, record/replay tools, the contract kit."""

from ._accel import status as fastpath_status
from .keys import DEFAULT_BLOCK_SIZE, model_seed, request_keys
from .router import KVRouter, pod_from_topic
from .index import INDEX_BACKENDS, Index
from .router_config import PodRefused, RouterConfig, RouterInputError, RouterStats
from .score import Explanation, Score, TierMatch, best
from .snapshot import SnapshotError, SnapshotInfo

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "Explanation",
    "INDEX_BACKENDS",
    "Index",
    "KVRouter",
    "PodRefused",
    "RouterConfig",
    "RouterInputError",
    "RouterStats",
    "Score",
    "SnapshotError",
    "SnapshotInfo",
    "TierMatch",
    "best",
    "fastpath_status",
    "model_seed",
    "pod_from_topic",
    "request_keys",
]
