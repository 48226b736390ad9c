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


class Ahead(NamedTuple):
    """A layer's first ring step, started during the previous layer (``prefetch_next``)."""

    step: InFlight
    buf: torch.Tensor  # the layer's packed weight shards being sent
    nbuf: torch.Tensor  # receiving the previous rank's shards
    tag: int
    full: torch.Tensor | None = None  # (N, numel) slots that buf and nbuf are part of, for a layer that keeps them


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
        self._prefetch = config.prefetch_next and config.schedule == "fused" and ring.size > 1
        self._order: list = []  # fused groups in the forward order of the previous step
        self._current: list = []
        self._ahead: dict[tuple[int, str], Ahead] = {}
        self._needs_dx: dict[int, bool] = {}  # per group: does its backward send weight shards (input needs grad)?
        self._kept: set[int] = set()  # groups of this step whose forward kept the gathered weight (keeps_weight)
        # A fused layer's last reduce-scatter step lands during the next layer's first backward piece instead of
        # during its own last piece (a window of a whole layer, not a piece); the grads are put in place then,
        # or when the backward ends.
        self.defer_last_reduce = self._prefetch
        self.keep_last_weight = self._prefetch  # see keeps_weight
        self._deferred: list = []
        self._deferred_callback = False

    def begin_step(self) -> None:
        self.stats.begin_step()
        if self.slicing is not None:
            self.slicing.begin_step()
        if self._current:
            self._order, self._current = self._current, []
        self._kept.clear()
        for ahead in self._ahead.values():  # started on every rank alike but not used (another path was taken)
            ahead.step.handle.wait()
        self._ahead.clear()
        self.finish_deferred()  # a backward that ended without its end-of-backward callback (an error in it)

    # -- a layer's last gradient step, finished during the next layer ---------------------------------------

    def defer(self, deferred) -> None:
        """Keep ``deferred`` (a ``DeferredReduce``) in flight until the next fused backward's first piece ends
        or the backward finishes, whichever comes first."""
        self._deferred.append(deferred)
        if not self._deferred_callback:
            self._deferred_callback = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._deferred_callback = False
        self.finish_deferred()

    def finish_deferred(self) -> None:
        pending, self._deferred = self._deferred, []
        for deferred in pending:
            self.wait(deferred.step)
            deferred.complete()

    # -- across layers: the next layer's first ring step starts during this layer's last piece -------------

    def entered(self, state, needs_dx: bool) -> None:
        """A fused group's forward begins (records the order for the next step's prefetch)."""
        if self._prefetch:
            self._current.append(state)
            self._needs_dx[id(state)] = needs_dx

    def keeps_weight(self, state) -> bool:
        """Whether ``state``'s forward keeps every gathered weight shard for its own backward: the last fused group
        of the forward (the lm_head) when a backward follows. Its backward then sends gradient partials only, like
        FSDP2's root that is not resharded after forward; it holds the full weight from its forward to its
        backward (one layer's worth of memory, while the loss is computed)."""
        return (self.keep_last_weight and bool(self._order) and self._order[-1] is state
                and self._needs_dx.get(id(state), False))

    def kept(self, state) -> None:
        self._kept.add(id(state))

    def take_ahead(self, state, phase: str) -> Ahead | None:
        return self._ahead.pop((id(state), phase), None) if self._prefetch else None

    def start_next(self, state, phase: str) -> None:
        """Keep the first ring step of the ``prefetch_depth`` groups that follow ``state`` in ``phase`` in flight
        (if the order is known); a group whose step is already in flight counts without starting anything. After
        the last group of the forward, the backward's first groups follow (their weight shards land during the
        loss) when a backward can follow (the last group's input needed grad: not under ``no_grad``)."""
        if not self._prefetch:
            return
        order = self._order if phase == "forward" else self._order[::-1]
        try:
            at = order.index(state)
        except ValueError:
            return
        self._start_following(order, at, phase)
        if phase == "forward" and at == len(order) - 1 and self._needs_dx.get(id(state), False):
            self._start_following(order[::-1], -1, "backward")

    def start_first(self, phase: str) -> None:
        """Before the first fused group of a forward (from a ring embedding, once its own exchange is under way):
        start that group's first ring step and those of the following ones."""
        if self._prefetch and phase == "forward" and not self._current and self._order:
            self._start_following(self._order, -1, phase)

    def _start_following(self, order: list, at: int, phase: str) -> None:
        wanted = self.config.prefetch_depth
        for following in order[at + 1:]:
            if wanted == 0:
                break
            if phase == "backward" and (not self._needs_dx.get(id(following), False) or id(following) in self._kept):
                continue  # its backward sends no weight shards: nothing to start early
            wanted -= 1
            key = (id(following), phase)
            if key in self._ahead:
                continue
            params = following.local_params()
            keep = phase == "forward" and self.keeps_weight(following)
            buf, nbuf, full = self.first_buffers(following, params, self.compute_dtype(params[0].dtype), keep)
            tag = self.ring.next_tag()
            self._ahead[key] = Ahead(self.start([buf], [nbuf], tag, phase, 0), buf, nbuf, tag, full)

    def first_buffers(self, state, params, cdt: torch.dtype, keep: bool):
        """(buf, nbuf, full) for a group's weight ring: its packed shards and the buffer that receives the previous
        rank's; with ``keep`` both are slots of ``full`` (N, numel), where every shard stays (``keeps_weight``)."""
        layout, ring = state.layout, self.ring
        if keep:
            full = torch.empty(ring.size, layout.numel, dtype=cdt, device=params[0].device)
            return layout.pack(state.pairs(params), cdt, out=full[ring.rank]), full[ring.shard_held(1)], full
        buf = layout.pack(state.pairs(params), cdt)
        return buf, (torch.empty_like(buf) if ring.size > 1 else None), None

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
