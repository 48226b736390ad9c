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

import torch

from ..ring import transport
from ..runtime.group import FusedGroupState
from ..timeline import labelled
from .linear import (FIRST_PARAM, Call, InputGrad, _dx_run, _forward_run, _grad_piece, accumulates, finish_forward,
                     prepare_forward, unpack_grads)


def _runs(world: int, size: int) -> list[tuple[int, int]]:
    """``piece_shards``: the gathered shards in runs of ``size`` (inclusive bounds), in shard order."""
    return [(low, min(low + size, world) - 1) for low in range(0, world, size)]


class SlicedLinearFn(torch.autograd.Function):
    """Same contract as ``FusedRingLinearFn``. Under ``loss.backward()`` the gradients of the weights arrive when the
    backward finishes; under ``torch.autograd.grad`` they are reduce-scattered at once and returned."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, state: FusedGroupState, call: Call, *params: torch.Tensor):
        layout, engine = state.layout, state.engine
        x2, outs, outs2 = prepare_forward(state, x, call.compute_dtype)
        with labelled("commfuse::sliced_forward"):
            flat = state.steps.schedule.gather(state, list(params), call.compute_dtype, "forward",
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
        world, compute_dtype = engine.ring.size, x2.dtype
        members = layout.members
        dys = [None if g is None else g.reshape(-1, m.out_features).to(compute_dtype)
               for g, m in zip(grad_outs, members)]
        needs = ctx.needs_input_grad[FIRST_PARAM:]
        train = tuple(dy is not None and any(needs[i] for i in state.param_index(j)) for j, dy in enumerate(dys))
        dx, grads = None, [None] * len(params)
        with labelled("commfuse::sliced_backward"):
            flat = sched.gather(state, params, compute_dtype, "backward") if ctx.needs_input_grad[0] else None
            if transport._OBSERVERS:
                transport.notify("compute_begin", "backward", 0)
            if flat is not None:
                dx = InputGrad(x2)
                for low, high in _runs(world, engine.config.piece_shards):
                    _dx_run(layout, flat, low, high, dys, dx)
                dx = dx.result()
            if any(train):
                parts = x2.new_zeros(world, layout.numel, dtype=ctx.call.reduce_dtype)
                blocks, dys_t = layout.blocks(parts), [dy.t() if dy is not None else None for dy in dys]
                for t in range(world):
                    _grad_piece(layout, blocks, t, dys_t, dys, list(train), x2, t)
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
