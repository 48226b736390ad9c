"""FSDP2 ``Comm`` adapters: stock ``fully_shard`` all-gathers and reduce-scatters through the rings.

FSDP2 calls ``allocate`` for its flat buffers and ``__call__`` with them (``torch.distributed.fsdp``'s
``AllGather`` / ``ReduceScatter`` interfaces). The all-gather input is a view of the output at
``rank * numel``; the ring leaves it in place. FSDP2 waits on the all-gather's return value only when it is a
``dist.Work``: on CPU an ``async_op=True`` (prefetch) call returns one and the ring runs on the group's ring
thread meanwhile, which stock FSDP2 cannot do on CPU. The reduce-scatter's return value is ignored, so it is
complete when it returns (CPU) or ordered on FSDP2's reduce-scatter stream (CUDA).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from ..config import CommFuseConfig
from .collectives import ring_all_gather, ring_reduce_scatter


class _RingComm:
    def __init__(self, config: CommFuseConfig | None = None) -> None:
        self.config = config if config is not None else CommFuseConfig()

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)


class RingAllGather(_RingComm, AllGather):
    """``fully_shard``'s all-gather as a bucketed ring (``FSDPModule.set_custom_all_gather``)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        return ring_all_gather(output_tensor, input_tensor, group, async_op=async_op,
                               bucket_mb=self.config.bucket_mb, timeout_s=self.config.timeout_s)


class RingReduceScatter(_RingComm, ReduceScatter):
    """``fully_shard``'s reduce-scatter as a bucketed ring (``FSDPModule.set_custom_reduce_scatter``)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op=dist.ReduceOp.AVG, async_op: bool = False) -> None:
        # Complete on return: FSDP2 ignores the return value of its reduce-scatter.
        ring_reduce_scatter(output_tensor, input_tensor, group, op,
                            bucket_mb=self.config.bucket_mb, timeout_s=self.config.timeout_s)
        return None
