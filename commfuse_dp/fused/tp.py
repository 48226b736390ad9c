"""Sequence-parallel tensor parallelism whose activation rings run beside the GEMM's own pieces (TPSP, CommFuse's
other half), on the one layer call loop (``runtime/layer_call.py``) the data-parallel rings run.

[Note: TPSP on rings]  (N ranks of the tensor-parallel group, rank r; T tokens, each rank holding rows R_j of them)

A column-parallel linear (``ColumnParallelFn``: W row-sharded over its outputs, ``y = x Wᵀ``, the input
sequence-sharded) all-gathers the input's rows over the group: piece k computes ``y[R_s] = x_s W_rᵀ`` for the
shard s held at hop k, the rank's own rows first (nothing to wait for). Its backward reduce-scatters the input
gradient over the sequence, piece k writing this rank's contribution ``dy[R_t] W_r`` for the shard t the hop is
about to carry, the rank's own last; the weight gradient ``Σ_s dy[R_s]ᵀ x_s`` is summed beside the same pieces
from the input the forward gathered and kept (one full-sequence input per layer, in place of a second gather).

A row-parallel linear (``RowParallelFn``: W sharded over its inputs, the input feature-sharded as a
column-parallel linear leaves it) reduce-scatters its partial outputs to sequence shards: piece k writes
``y[R_t] W_rᵀ`` for the shard t of the next hop, the rank's own last, and the bias (replicated) is added to the
rows this rank keeps. Its backward all-gathers the output gradient's rows beside the pieces of ``dy[R_s] = g_s
W_r`` and of ``dW += g_sᵀ y[R_s]``.

The rows a ring carries are activations, every rank's the same shape (tokens divisible by N); ``TPState`` is a
ring owner over the group (its engine's ring is the tensor-parallel group).
"""

from __future__ import annotations

import torch

from ..runtime.exchange import gather_into, reduce


class TPState:
    """A tensor-parallel layer's ring owner: the engine whose ring is the tensor-parallel group, the step state
    that names its ring operations, and its owner index there."""

    def __init__(self, steps, name: str) -> None:
        self.engine, self.steps, self.name = steps.engine, steps, name
        self.owner = steps.register(name)


def _rows(x: torch.Tensor, world: int, what: str) -> int:
    if x.shape[0] % world:
        raise ValueError(f"{what}: {x.shape[0]} tokens do not divide into {world} sequence shards; pad the "
                         f"sequence to a multiple of the tensor-parallel size")
    return x.shape[0] // world


class ColumnParallelFn(torch.autograd.Function):
    """``y = ColumnParallelFn.apply(x_local, state, weight, bias)``: ``x_local`` this rank's ``(T/N, in)`` rows,
    ``weight`` its ``(out/N, in)`` rows of W, ``bias`` its ``(out/N,)`` or None; ``y`` is ``(T, out/N)``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, state: TPState, weight: torch.Tensor, bias: torch.Tensor | None):
        ring = state.engine.ring
        x = x.contiguous()
        rows = x.shape[0]
        gathered = x.new_empty(ring.size, x.numel())
        gathered[ring.rank].copy_(x.view(-1))
        y = x.new_empty(ring.size * rows, weight.shape[0])

        def piece(s: int) -> None:
            x_s = gathered[s].view(rows, -1)
            if bias is not None:
                torch.addmm(bias, x_s, weight.t(), out=y[s * rows:(s + 1) * rows])
            else:
                torch.mm(x_s, weight.t(), out=y[s * rows:(s + 1) * rows])

        gather_into(state, gathered, "forward", piece)
        ctx.state, ctx.rows, ctx.has_bias = state, rows, bias is not None
        ctx.save_for_backward(gathered, weight)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        gathered, weight = ctx.saved_tensors
        state, rows = ctx.state, ctx.rows
        dy = dy.contiguous()
        dw = torch.zeros_like(weight)

        def piece(t: int, part: torch.Tensor) -> None:
            dy_t = dy[t * rows:(t + 1) * rows]
            torch.mm(dy_t, weight, out=part)
            dw.addmm_(dy_t.t(), gathered[t].view(rows, -1))

        dx = reduce(state, (rows, weight.shape[1]), dy.dtype, dy.device, piece, "backward")
        return dx, None, dw, dy.sum(0) if ctx.has_bias else None


class RowParallelFn(torch.autograd.Function):
    """``out_local = RowParallelFn.apply(y, state, weight, bias)``: ``y`` the ``(T, in/N)`` input a column-parallel
    linear leaves, ``weight`` this rank's ``(out, in/N)`` columns of W, ``bias`` the whole ``(out,)`` (replicated)
    or None; ``out_local`` is this rank's ``(T/N, out)`` rows."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, state: TPState, weight: torch.Tensor, bias: torch.Tensor | None):
        ring = state.engine.ring
        y = y.contiguous()
        rows = _rows(y, ring.size, "RowParallelFn")

        def piece(t: int, part: torch.Tensor) -> None:
            torch.mm(y[t * rows:(t + 1) * rows], weight.t(), out=part)

        out = reduce(state, (rows, weight.shape[0]), y.dtype, y.device, piece, "forward")
        if bias is not None:
            out = out + bias
        ctx.state, ctx.rows, ctx.has_bias = state, rows, bias is not None
        ctx.save_for_backward(y, weight)
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        y, weight = ctx.saved_tensors
        state, rows = ctx.state, ctx.rows
        ring = state.engine.ring
        dout = dout.contiguous()
        gathered = dout.new_empty(ring.size, dout.numel())
        gathered[ring.rank].copy_(dout.view(-1))
        dy = y.new_empty(y.shape)
        dw = torch.zeros_like(weight)

        def piece(s: int) -> None:
            g_s = gathered[s].view(rows, -1)
            torch.mm(g_s, weight, out=dy[s * rows:(s + 1) * rows])
            dw.addmm_(g_s.t(), y[s * rows:(s + 1) * rows])

        gather_into(state, gathered, "backward", piece)
        db = gathered.view(ring.size * rows, -1).sum(0) if ctx.has_bias else None
        return dy, None, dw, db
