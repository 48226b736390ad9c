"""The per-model runtime of a sharded model: its ring, link scheduler, config, gradient-sync flag and statistics.

``shard()`` makes one ``Engine`` per model; every fused layer reaches it. Its ``link`` (``runtime/link.py``) is
the only place where hops are requested and waited for on behalf of the fused layers, ring embeddings and
weight reads, so that ordering, the CUDA stream discipline and timing live in one spot. What a step leaves
between its phases (layer order, prefetched hops, deferred gradient hops, no-sync partials) is not here: it is
the ``StepState`` of ``runtime/step.py``, which has one ``reset()``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..config import CommFuseConfig
from ..feedback import Residuals
from ..ring.topology import Ring
from ..stats import StatsRecorder
from .link import Link


class RingOp(NamedTuple):
    """One ring operation of a fused layer or ring embedding: its message tag and what it is, for errors.

    The tag carries the operation's identity (``StepState.ring_op``), so ranks that call different layers do not
    pair up their bytes: their hops never match, and every rank raises ``RingCommError`` naming this."""

    tag: int
    name: str  # the module(s)
    phase: str  # "forward", "backward", "embedding ids", ...
    occurrence: int  # how many times this module ran this phase before, in this step
    step: int  # the model's forward count (a step begins at each forward of the root module)

    def __str__(self) -> str:
        return (f"{self.name} ({self.phase}, call {self.occurrence + 1} of this step, step {self.step}, "
                f"tag {self.tag})")


class Engine:
    """``mesh``: 1-D (the shard group) or 2-D ``(replicate, shard)`` (HSDP); ``ring`` runs over the shard dimension,
    ``world_ring`` over every rank of the mesh (checks that all ranks must agree on), ``replicas`` (HSDP only)
    sums gradient shards across the copies (``runtime/replicas.py``)."""

    def __init__(self, ring: Ring, mesh: DeviceMesh, config: CommFuseConfig, world_ring: Ring | None = None,
                 replicas=None, residuals: Residuals | None = None) -> None:
        if config.schedule == "auto" or config.piece_shards == "auto":  # (shard() resolves them: choose.py)
            config = config.replace(schedule="fused" if config.schedule == "auto" else config.schedule,
                                    piece_shards=1 if config.piece_shards == "auto" else config.piece_shards)
        self.ring, self.mesh, self.config = ring, mesh, config
        self.world_ring = world_ring or ring
        self.replicas = replicas
        self.residuals = (residuals if residuals is not None  # error feedback's (feedback.py)
                          else Residuals(config.error_feedback, config.feedback_torch_dtype))
        self.stats = StatsRecorder(config.stats)
        self.link = Link(ring, config.timeout_s, self.stats)
        self.requires_grad_sync = True
        self.scratch: dict[tuple, torch.Tensor] = {}  # rows that narrow weight rows are decoded into (layer_rings.py)

    def placements(self, dim: int) -> tuple:
        """A fused parameter's DTensor placements: ``Shard(dim)`` over the shard dimension, replicated across
        copies."""
        from torch.distributed.tensor import Replicate, Shard

        return (Shard(dim),) if self.mesh.ndim == 1 else (Replicate(), Shard(dim))

    def __deepcopy__(self, memo) -> None:
        raise RuntimeError(
            "copy.deepcopy of a model sharded with commfuse_dp.shard() is not supported: its parameters are shards "
            "bound to a process group and its layers to one ring. Copy the model before shard() (and shard the copy "
            "too), or save its state dict (torch.distributed.checkpoint) and load it into a new sharded model.")

    # -- numerics ---------------------------------------------------------------------------------------

    def compute_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        return self.config.param_dtype or param_dtype

    def reduce_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        return self.config.reduce_dtype or compute_dtype

    def divide_factors(self) -> tuple[float, float]:
        """(pre, post): the mean over the N·R data-parallel ranks divides the gradient before and after the ring
        sum (HSDP: the sum across the R copies follows, ``runtime/replicas.py``)."""
        world = float(self.ring.size * (self.replicas.size if self.replicas is not None else 1))
        if self.config.grad_divide == "pre":
            return world, 1.0
        if self.config.grad_divide == "split":
            return math.sqrt(world), math.sqrt(world)
        return 1.0, world
