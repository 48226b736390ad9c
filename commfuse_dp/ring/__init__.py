"""The peer-to-peer ring layer: neighbours, ring steps, bucketed all-gather / reduce-scatter, FSDP2 adapters."""

from .collectives import (
    ring_all_gather,
    ring_all_gather_coalesced,
    ring_reduce_scatter,
    ring_reduce_scatter_coalesced,
)
from .fsdp_comm import RingAllGather, RingReduceScatter, use_ring_collectives
from .topology import Ring, get_ring
from .transport import RingCommError, StepHandle, observe_ring, start_step

__all__ = [
    "Ring", "RingAllGather", "RingCommError", "RingReduceScatter", "StepHandle", "get_ring", "observe_ring",
    "ring_all_gather", "ring_all_gather_coalesced", "ring_reduce_scatter", "ring_reduce_scatter_coalesced",
    "start_step", "use_ring_collectives",
]
