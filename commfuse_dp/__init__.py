"""commfuse_dp: sharded data parallelism whose collectives run as peer-to-peer rings fused with compute.

Public names: ``CommFuseConfig``; the ring layer in ``commfuse_dp.ring``; the integrations in
``commfuse_dp.integrations`` (``fsdp.use_ring_collectives`` today); ``shard(model, config)`` and
``step_stats(model)`` for the fused engine; ``describe(model)`` for what ``shard()`` fused and what each part moves;
``tensor_parallel(model, group)`` for sequence-parallel tensor parallelism on rings (``commfuse_dp.tp``).
"""

from .config import CommFuseConfig
from .describe import ShardReport, describe
from .shard import shard, step_stats
from .stats import StepStats
from .tp import tensor_parallel
from .ring import (
    RingAllGather,
    RingCommError,
    RingReduceScatter,
    ring_all_gather,
    ring_all_gather_coalesced,
    ring_reduce_scatter,
    ring_reduce_scatter_coalesced,
)

__version__ = "0.1.0.dev0"

__all__ = [
    "CommFuseConfig", "ShardReport", "StepStats", "describe", "shard", "step_stats", "tensor_parallel", "RingAllGather", "RingCommError", "RingReduceScatter", "ring_all_gather",
    "ring_all_gather_coalesced", "ring_reduce_scatter", "ring_reduce_scatter_coalesced",
]
