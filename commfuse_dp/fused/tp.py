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

The sequence is the second to last dimension (``(..., S, features)``, a batch of sequences each sharded into
N equal parts); one column-parallel call carries several members beside one gather (q, k and v; gate and up).
The rows a ring carries are activations, every rank's the same shape; ``TPState`` is a ring owner over the
group (its engine's ring is the tensor-parallel group).
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


def _seq(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], int]:
    """``x`` (..., S, features) as a contiguous ``(B, S, features)``, its leading shape, and S."""
    lead = tuple(x.shape[:-2])
    return x.contiguous().view(-1, x.shape[-2], x.shape[-1]), lead, x.shape[-2]


class ColumnParallelFn(torch.autograd.Function):
    """``ys = ColumnParallelFn.apply(x_local, state, w_1, b_1, w_2, b_2, ...)``: ``x_local`` this rank's sequence
    shard ``(..., S/N, in)``; each member ``i`` (q, k and v, or gate and up: one gather for all of them) its rows
    ``w_i`` ``(out_i/N, in)`` of its weight and ``b_i`` ``(out_i/N,)`` or None. ``ys``: one ``(..., S, out_i/N)`` per
    member, the whole sequence."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, state: TPState, *params):
        ring = state.engine.ring
        x3, lead, rows = _seq(x)
        batch, width = x3.shape[0], x3.shape[2]
        gathered = x3.new_empty(ring.size, batch * rows * width)
        gathered[ring.rank].view(batch, rows, width).copy_(x3)
        members = list(zip(params[0::2], params[1::2]))
        ys = [x3.new_empty(batch, ring.size, rows, w.shape[0]) for w, _ in members]

        def piece(s: int) -> None:
            x_s = gathered[s].view(batch * rows, width)
            for (w, b), y in zip(members, ys):
                if batch == 1 and b is not None:  # the output rows of shard s are one block: computed in place
                    torch.addmm(b, x_s, w.t(), out=y[0, s])
                elif batch == 1:
                    torch.mm(x_s, w.t(), out=y[0, s])
                else:
                    got = torch.addmm(b, x_s, w.t()) if b is not None else torch.mm(x_s, w.t())
                    y[:, s].copy_(got.view(batch, rows, -1))

        gather_into(state, gathered, "forward", piece)
        ctx.state, ctx.shape, ctx.lead = state, (batch, rows, width), lead
        ctx.biased = [b is not None for _, b in members]
        ctx.save_for_backward(gathered, *params[0::2])
        return tuple(y.view(*lead, ring.size * rows, y.shape[-1]) for y in ys)

    @staticmethod
    def backward(ctx, *dys: torch.Tensor):
        gathered, *weights = ctx.saved_tensors
        state, (batch, rows, width) = ctx.state, ctx.shape
        ring = state.engine.ring
        dys = [None if dy is None else dy.contiguous().view(batch, ring.size, rows, -1) for dy in dys]
        dws = [torch.zeros_like(w) for w in weights]

        def piece(t: int, part: torch.Tensor) -> None:
            part = part.view(batch * rows, width)
            x_t = gathered[t].view(batch * rows, width)
            first = True
            for dy, w, dw in zip(dys, weights, dws):
                if dy is None:
                    continue
                dy_t = dy[:, t].reshape(batch * rows, -1)
                if first:
                    torch.mm(dy_t, w, out=part)
                    first = False
                else:
                    part.addmm_(dy_t, w)
                dw.addmm_(dy_t.t(), x_t)
            if first:
                part.zero_()

        dx = reduce(state, (batch, rows, width), gathered.dtype, gathered.device, piece, "backward")
        grads = []
        for dy, dw, biased in zip(dys, dws, ctx.biased):
            grads += [dw if dy is not None else None,
                      dy.sum((0, 1, 2)) if biased and dy is not None else None]
        return (dx.view(*ctx.lead, rows, width), None, *grads)


class RowParallelFn(torch.autograd.Function):
    """``out_local = RowParallelFn.apply(y, state, weight, bias)``: ``y`` the ``(..., S, in/N)`` input a
    column-parallel linear leaves, ``weight`` this rank's ``(out, in/N)`` columns of W, ``bias`` the whole
    ``(out,)`` (replicated) or None; ``out_local`` is this rank's sequence shard ``(..., S/N, out)``."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, state: TPState, weight: torch.Tensor, bias: torch.Tensor | None):
        ring = state.engine.ring
        y3, lead, seq = _seq(y)
        if seq % ring.size:
            raise ValueError(f"RowParallelFn: a sequence of {seq} tokens does not divide into {ring.size} shards; "
                             f"pad the sequence to a multiple of the tensor-parallel size")
        batch, rows = y3.shape[0], seq // ring.size
        y4 = y3.view(batch, ring.size, rows, -1)

        def piece(t: int, part: torch.Tensor) -> None:
            torch.mm(y4[:, t].reshape(batch * rows, -1), weight.t(), out=part.view(batch * rows, -1))

        out = reduce(state, (batch, rows, weight.shape[0]), y.dtype, y.device, piece, "forward")
        if bias is not None:
            out = out + bias
        ctx.state, ctx.shape, ctx.has_bias = state, (batch, rows), bias is not None
        ctx.save_for_backward(y4, weight)
        return out.view(*lead, rows, weight.shape[0])

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        y4, weight = ctx.saved_tensors
        state, (batch, rows) = ctx.state, ctx.shape
        ring = state.engine.ring
        width = weight.shape[0]
        gathered = dout.new_empty(ring.size, batch * rows * width)
        gathered[ring.rank].view(batch, rows, width).copy_(dout.contiguous().view(batch, rows, width))
        dy = y4.new_empty(y4.shape)
        dw = torch.zeros_like(weight)

        def piece(s: int) -> None:
            g_s = gathered[s].view(batch * rows, width)
            dy[:, s].copy_(torch.mm(g_s, weight).view(batch, rows, -1))
            dw.addmm_(g_s.t(), y4[:, s].reshape(batch * rows, -1))

        gather_into(state, gathered, "backward", piece)
        db = gathered.view(-1, width).sum(0) if ctx.has_bias else None
        lead = dout.shape[:-2]
        return dy.view(*lead, ring.size * rows, -1), None, dw, db
