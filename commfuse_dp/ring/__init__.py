"""The peer-to-peer ring layer: neighbours, hops, bucketed all-gather / reduce-scatter, FSDP2 adapters."""

from .collectives import (
    ring_all_gather,
    ring_all_gather_coalesced,
    ring_reduce_scatter,
    ring_reduce_scatter_coalesced,
)
from .fsdp_comm import RingAllGather, RingReduceScatter, use_ring_collectives
from .topology import Ring, get_ring
from .transport import HopHandle, RingCommError, observe_ring, start_hop

__all__ = [
    "HopHandle", "Ring", "RingAllGather", "RingCommError", "RingReduceScatter", "get_ring", "observe_ring",
    "ring_all_gather", "ring_all_gather_coalesced", "ring_reduce_scatter", "ring_reduce_scatter_coalesced",
    "start_hop", "use_ring_collectives",
]
