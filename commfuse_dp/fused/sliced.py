"""The ``"slicing"`` schedule: data-slicing overlap on the same rings and the same GEMM pieces as ``"fused"``.

[Note: the slicing schedule]
This is the strongest layer-level overlap we build on our transport, kept so that every benchmark compares the
CommFuse idea itself against it, in one run:
- forward of layer i: its weight was all-gathered during layer i-1 (prefetch, on the ring thread); layer i+1's
  all-gather starts before layer i computes. The gathered weights are dropped after use (reshard after forward),
  except the last layer's, which the backward needs first.
- backward of layer i: its weight was re-gathered during layer i+1's backward; layer i-1's all-gather starts before
  layer i computes; layer i's gradient reduce-scatter runs on the ring thread during layer i-1's backward, and all
  of them are waited for once, when autograd finishes the backward (the tail: nothing hides the last one).
The order of layers is the one recorded in the previous step (the first step runs without prefetch).
Compute is exactly the fused schedule's pieces (``_forward_run``, ``_dx_run`` over runs of ``piece_shards``
gathered shards, one each by default; ``_grad_piece``), so the two schedules differ only in when communication
happens.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from ..ring import transport
from ..ring.collectives import ring_all_gather, ring_reduce_scatter
from ..ring.transport import RingCommError
from .linear import (PARAMS_AT, Call, InputGrad, _dx_run, _forward_run, _grad_piece, accumulates, finish_forward,
                     prepare_forward, unpack_grads)

if TYPE_CHECKING:
    from ..engine import Engine
    from .modules import FusedGroupState
    from .step import StepState


class Gathered(NamedTuple):
    work: dist.Work | None
    flat: torch.Tensor  # (N, numel): every rank's packed shards
    started: float


class Reducing(NamedTuple):
    work: dist.Work | None
    shard: torch.Tensor  # (numel,): this rank's summed gradient shards
    state: FusedGroupState
    grad_dtypes: tuple[torch.dtype, ...]
    train: tuple[bool, ...]
    started: float


class SlicingScheduler:
    def __init__(self, engine: Engine, steps: StepState) -> None:
        self.engine, self.steps = engine, steps
        self.dtype_hint: torch.dtype | None = None  # compute dtype under autocast, for the prefetched gathers
        self._order: list[FusedGroupState] = []  # forward order of the previous step
        self._current: list[FusedGroupState] = []
        self._prefetched: dict[tuple[int, str], tuple[Gathered, list[torch.Tensor]]] = {}
        self._reducing: list[Reducing] = []
        self.prefetch_hits = 0  # gathers that were already in flight when their layer asked for them
        self.gathers = 0  # gathers started
        self._backward_gathers: dict[int, bool] = {}  # per group: does its backward need the weight (dx)?

    def begin_step(self) -> None:
        if self._current:
            self._order, self._current = self._current, []
        self._prefetched.clear()  # started on every rank alike but not used: the ring thread finishes them

    def start_first(self, phase: str) -> None:
        """(Fused schedule only: here each layer's gather prefetches the next one's.)"""

    def reset(self) -> None:
        """Drop everything of an aborted step: in-flight gathers and reduce-scatters are waited for (every rank
        started them alike) and their results dropped; the layer order is forgotten."""
        works = [g.work for g, _ in self._prefetched.values()] + [r.work for r in self._reducing]
        self._prefetched.clear()
        self._reducing = []
        for work in works:
            if work is not None:
                try:
                    work.wait()
                except RingCommError:  # a broken ring has said so already, where it broke
                    pass
        self._order, self._current = [], []
        self._backward_gathers.clear()

    # -- all-gather with prefetch ----------------------------------------------------------------------

    def _start_gather(self, state: FusedGroupState, params: list[torch.Tensor], dtype: torch.dtype,
                      phase: str) -> Gathered:
        ring = self.engine.ring
        self.gathers += 1
        packed = state.layout.pack(state.pairs(params), dtype)
        flat = packed.new_empty(ring.size, state.layout.numel)
        op = self.steps.ring_op(state.op, phase)
        work = ring_all_gather(flat.view(-1), packed, ring.group, async_op=True, tag=op.tag, label=op,
                               **self.engine.config.ring_kwargs)
        return Gathered(work, flat, time.perf_counter())

    def _wait(self, started: float, work: dist.Work | None) -> None:
        began = time.perf_counter()
        if work is not None:
            work.wait()
        if self.engine.stats.enabled:
            self.engine.stats.ring_step(started, began, time.perf_counter())

    def gather(self, state: FusedGroupState, params: list[torch.Tensor], dtype: torch.dtype,
               phase: str, backward_gathers: bool = True) -> torch.Tensor:
        """Every rank's shards of ``state``'s group; prefetched if the previous step's order predicted it, and
        the next group's gather of this phase started before returning. ``backward_gathers`` (forward only):
        whether this group's backward will need its weight again (it does not when its input needs no grad)."""
        recompute = phase == "forward" and torch._C._current_graph_task_id() != -1  # checkpointing, in backward
        if phase == "forward" and not recompute:
            self._current.append(state)
            self._backward_gathers[id(state)] = backward_gathers
        got = self._prefetched.pop((id(state), phase), None)
        self.prefetch_hits += got is not None
        gathered = got[0] if got is not None else self._start_gather(state, params, dtype, phase)
        following = self._following(state, phase) if not recompute else None
        if following is not None and (id(following[0]), phase) not in self._prefetched:
            nxt_state, nxt_params = following
            nxt_dtype = self.dtype_hint or self.engine.compute_dtype(nxt_params[0].dtype)  # as its layer will ask
            self._prefetched[(id(nxt_state), phase)] = (
                self._start_gather(nxt_state, nxt_params, nxt_dtype, phase), nxt_params)
        self._wait(gathered.started, gathered.work)
        if phase == "forward" and backward_gathers and self._order and state is self._order[-1] and not recompute:
            self._prefetched[(id(state), "backward")] = (Gathered(None, gathered.flat, time.perf_counter()), params)
        return gathered.flat

    def _following(self, state: FusedGroupState, phase: str) -> tuple[FusedGroupState, list[torch.Tensor]] | None:
        order = self._order if phase == "forward" else self._order[::-1]
        for i, s in enumerate(order):
            if s is state:
                for nxt in order[i + 1:]:
                    if phase == "forward" or self._backward_gathers.get(id(nxt), True):
                        return nxt, nxt.local_params()
                return None
        return None

    # -- reduce-scatter in the background, waited at the end of backward ------------------------------------

    def reduce_scatter(self, state: FusedGroupState, parts: torch.Tensor, grad_dtypes: tuple[torch.dtype, ...],
                       train: tuple[bool, ...]) -> None:
        ring = self.engine.ring
        shard = parts.new_empty(state.layout.numel)
        op = self.steps.ring_op(state.op, "backward")
        work = ring_reduce_scatter(shard, parts.view(-1), ring.group, dist.ReduceOp.SUM, async_op=True,
                                   tag=op.tag, label=op, **self.engine.config.ring_kwargs)
        self._reducing.append(Reducing(work, shard, state, grad_dtypes, train, time.perf_counter()))

    def reduce_scatter_now(self, state: FusedGroupState, parts: torch.Tensor) -> torch.Tensor:
        """The same reduce-scatter, waited for at once (the gradients must be returned through autograd)."""
        shard = parts.new_empty(state.layout.numel)
        op = self.steps.ring_op(state.op, "backward")
        began = time.perf_counter()
        ring_reduce_scatter(shard, parts.view(-1), self.engine.ring.group, dist.ReduceOp.SUM, tag=op.tag, label=op,
                            **self.engine.config.ring_kwargs)
        if self.engine.stats.enabled:
            self.engine.stats.blocking(began, time.perf_counter())
        _, post = self.engine.divide_factors()
        shard = shard.div_(post) if post != 1.0 else shard
        if self.engine.replicas is not None:  # HSDP: it goes back through autograd, so it crosses the copies now
            shard = self.engine.replicas.exchange_now(shard, f"the gradient of {state.name}")
        return shard

    def end_backward(self) -> None:
        """At the end of the backward (``StepState``'s callback): wait for the reduce-scatters and put the
        gradients in place."""
        _, post = self.engine.divide_factors()
        pending, self._reducing = self._reducing, []
        for red in pending:
            self._wait(red.started, red.work)
            if post != 1.0:
                red.shard.div_(post)
            red.state.accumulate_grads(red.shard, red.grad_dtypes, red.train)


def _runs(world: int, size: int) -> list[tuple[int, int]]:
    """``piece_shards``: the gathered shards in runs of ``size`` (inclusive bounds), in shard order."""
    return [(low, min(low + size, world) - 1) for low in range(0, world, size)]


class SlicedLinearFn(torch.autograd.Function):
    """Same contract as ``FusedRingLinearFn``. Under ``loss.backward()`` the gradients of the weights arrive when the
    backward finishes; under ``torch.autograd.grad`` they are reduce-scattered at once and returned."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, state: FusedGroupState, call: Call, *params: torch.Tensor):
        layout, engine = state.layout, state.engine
        x2, outs, outs2 = prepare_forward(state, x, call.cdt)
        with record_function("commfuse::sliced_forward"):
            flat = state.steps.schedule.gather(state, list(params), call.cdt, "forward",
                                               backward_gathers=x.requires_grad)
            if transport._OBSERVERS:
                transport.notify("compute_begin", "forward", 0)
            for low, high in _runs(engine.ring.size, engine.config.piece_shards):
                _forward_run(layout, flat, low, high, x2, outs2)
            if transport._OBSERVERS:
                transport.notify("compute", "forward", 0)
        return finish_forward(ctx, state, call, x, x2, params, outs)

    @staticmethod
    def backward(ctx, *grad_outs: torch.Tensor):
        x2, *params = ctx.saved_tensors
        state = ctx.state
        state.steps.backward_begins()
        layout, engine, sched = state.layout, state.engine, state.steps.schedule
        world, cdt = engine.ring.size, x2.dtype
        members = layout.members
        dys = [None if g is None else g.reshape(-1, m.out_features).to(cdt) for g, m in zip(grad_outs, members)]
        needs = ctx.needs_input_grad[PARAMS_AT:]
        train = tuple(dy is not None and any(needs[i] for i in state.param_index(j)) for j, dy in enumerate(dys))
        dx, grads = None, [None] * len(params)
        with record_function("commfuse::sliced_backward"):
            flat = sched.gather(state, params, cdt, "backward") if ctx.needs_input_grad[0] else None
            if transport._OBSERVERS:
                transport.notify("compute_begin", "backward", 0)
            if flat is not None:
                dx = InputGrad(x2)
                for low, high in _runs(world, engine.config.piece_shards):
                    _dx_run(layout, flat, low, high, dys, dx)
                dx = dx.result()
            if any(train):
                parts = x2.new_zeros(world, layout.numel, dtype=ctx.call.rdt)
                for t in range(world):
                    _grad_piece(layout, parts[t], dys, list(train), x2, t)
                if not engine.requires_grad_sync:
                    for t in range(world):
                        state.keep_unsynced(t, parts[t], world)
                else:
                    pending = state.take_unsynced()
                    if pending is not None:
                        parts.add_(pending)
                    pre, _ = engine.divide_factors()
                    if pre != 1.0:
                        parts.div_(pre)
                    if accumulates(state, ctx.call):
                        sched.reduce_scatter(state, parts, tuple(p.dtype for p in params), train)
                    else:
                        grads = unpack_grads(state, sched.reduce_scatter_now(state, parts), params, train, needs)
            if transport._OBSERVERS:
                transport.notify("compute", "backward", 0)
        if dx is not None:
            dx = dx.view(ctx.x_shape).to(ctx.x_dtype)
        return (dx, None, None, *grads)
