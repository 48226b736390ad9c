"""FSDP2 ``Comm`` adapters: stock ``fully_shard`` all-gathers and reduce-scatters through the rings.

FSDP2 calls ``allocate`` for its flat buffers and ``__call__`` with them (``torch.distributed.fsdp``'s
``AllGather`` / ``ReduceScatter`` interfaces). The all-gather input is a view of the output at
``rank * numel``; the ring leaves it in place. FSDP2 waits on the all-gather's return value only when it is a
``dist.Work``: on CPU an ``async_op=True`` (prefetch) call returns one and the ring runs on the group's ring
thread meanwhile, which stock FSDP2 cannot do on CPU. The reduce-scatter's return value is ignored, so it is
complete when it returns (CPU) or ordered on FSDP2's reduce-scatter stream (CUDA).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from ..config import CommFuseConfig
from ..stats import StatsRecorder
from .collectives import ring_all_gather, ring_reduce_scatter


class _RingComm:
    def __init__(self, config: CommFuseConfig | None = None, recorder: StatsRecorder | None = None,
                 label: str | None = None) -> None:
        self.config = config if config is not None else CommFuseConfig()
        self.recorder = recorder if recorder is not None and recorder.enabled else None
        self.label = label  # the unit, named in ring errors

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)


class RingAllGather(_RingComm, AllGather):
    """``fully_shard``'s all-gather as a bucketed ring (``FSDPModule.set_custom_all_gather``)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        began = time.perf_counter()
        work = ring_all_gather(output_tensor, input_tensor, group, async_op=async_op, label=self.label,
                               bucket_mb=self.config.bucket_mb, timeout_s=self.config.timeout_s)
        if self.recorder is not None and work is None:
            self.recorder.blocking(began, time.perf_counter())
        return work


class RingReduceScatter(_RingComm, ReduceScatter):
    """``fully_shard``'s reduce-scatter as a bucketed ring (``FSDPModule.set_custom_reduce_scatter``)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op=dist.ReduceOp.AVG, async_op: bool = False) -> None:
        # Complete on return: FSDP2 ignores the return value of its reduce-scatter.
        began = time.perf_counter()
        ring_reduce_scatter(output_tensor, input_tensor, group, op, label=self.label,
                            bucket_mb=self.config.bucket_mb, timeout_s=self.config.timeout_s)
        if self.recorder is not None:
            self.recorder.blocking(began, time.perf_counter())
        return None


def use_ring_collectives(model: nn.Module, config: CommFuseConfig | None = None, *,
                         recorder: StatsRecorder | None = None) -> nn.Module:
    """Install ``RingAllGather`` / ``RingReduceScatter`` on every ``FSDPModule`` inside ``model`` (itself
    included) and return ``model``. Raises ``ValueError`` if no module was ``fully_shard``-ed, or if a module
    has several parameter groups (``shard_placement_fn`` with per-parameter meshes), which FSDP2's custom-comm
    hooks cannot serve; in both cases nothing is changed."""
    config = config if config is not None else CommFuseConfig()
    sharded = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not sharded:
        raise ValueError("use_ring_collectives: no module of this model was sharded with fully_shard; call "
                         "fully_shard(...) on its layers and on the root first, then use_ring_collectives(model)")
    for name, module in sharded:
        param_groups = module._get_fsdp_state()._fsdp_param_groups
        if len(param_groups) > 1:
            raise ValueError(
                f"use_ring_collectives: module '{name or '<root>'}' ({type(module).__name__}) has "
                f"{len(param_groups)} parameter groups (per-parameter meshes from shard_placement_fn); FSDP2 can "
                f"install a custom collective only on a module with one group. Shard that module's parameters on "
                f"one mesh, or leave it out of fully_shard's shard_placement_fn.")
    for name, module in sharded:
        if module._get_fsdp_state()._fsdp_param_groups:
            unit = f"FSDP2 unit {name or '(root)'}"
            module.set_custom_all_gather(RingAllGather(config, recorder, f"{unit} (all-gather)"))
            module.set_custom_reduce_scatter(RingReduceScatter(config, recorder, f"{unit} (reduce-scatter)"))
    return model
