"""The per-model runtime of a sharded model: its ring, config, gradient-sync flag and step statistics.

``shard()`` makes one ``Engine`` per model; every fused layer holds it. It is the only place where ring steps
are started and waited for on behalf of the fused layers, so that timing and the sync flag live in one spot.
"""

from __future__ import annotations

import math
import time
from typing import NamedTuple

import torch
from torch.distributed.device_mesh import DeviceMesh

from .config import CommFuseConfig
from .ring import transport
from .ring.topology import Ring
from .stats import StatsRecorder


class InFlight(NamedTuple):
    handle: transport.StepHandle
    started: float


class Engine:
    def __init__(self, ring: Ring, mesh: DeviceMesh, config: CommFuseConfig) -> None:
        self.ring, self.mesh, self.config = ring, mesh, config
        self.stats = StatsRecorder(config.stats)
        self.requires_grad_sync = True
        self._steps = ring.size
        self.slicing = None
        if config.schedule == "slicing":
            from .fused.sliced import SlicingScheduler

            self.slicing = SlicingScheduler(self)

    def begin_step(self) -> None:
        self.stats.begin_step()
        if self.slicing is not None:
            self.slicing.begin_step()

    # -- ring steps, timed -------------------------------------------------------------------------------

    def start(self, sends: list[torch.Tensor], recvs: list[torch.Tensor], tag: int, op: str, k: int) -> InFlight:
        started = time.perf_counter()
        handle = transport.start_step(self.ring, sends, recvs, tag=tag, op=op, step=k, steps=self._steps,
                                      timeout_s=self.config.timeout_s)
        return InFlight(handle, started)

    def wait(self, step: InFlight) -> None:
        wait_began = time.perf_counter()
        step.handle.wait()  # CPU/gloo: blocks until the step's bytes landed; CUDA: orders the stream only
        if self.stats.enabled:
            self.stats.ring_step(step.started, wait_began, time.perf_counter())

    # -- numerics ---------------------------------------------------------------------------------------

    def compute_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        return self.config.param_dtype or param_dtype

    def reduce_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        return self.config.reduce_dtype or compute_dtype

    def divide_factors(self) -> tuple[float, float]:
        """(pre, post): the mean over N ranks divides the gradient before and after the ring sum."""
        world = float(self.ring.size)
        if self.config.grad_divide == "pre":
            return world, 1.0
        if self.config.grad_divide == "split":
            return math.sqrt(world), math.sqrt(world)
        return 1.0, world
