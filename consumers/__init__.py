"""consumers: the router index and scorer, record/replay tools, the contract kit."""

from ._accel import status as fastpath_status
from .keys import DEFAULT_BLOCK_SIZE, model_seed, request_keys
from .router import KVRouter, pod_from_topic
from .router_config import RouterConfig, RouterInputError, RouterStats
from .score import Explanation, Score, TierMatch

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "Explanation",
    "KVRouter",
    "RouterConfig",
    "RouterInputError",
    "RouterStats",
    "Score",
    "TierMatch",
    "fastpath_status",
    "model_seed",
    "pod_from_topic",
    "request_keys",
]
