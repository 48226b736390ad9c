"""The ring-fused linear: the all-gather of the weight and the reduce-scatter of its gradient run as hops,
each beside a shard-sized piece of the layer's own GEMM.

[Note: the fused schedule]  (docs/design.md §3-4; N ranks, rank r, ``next = r+1``, ``prev = r-1`` mod N)

Forward, ``y = x Wᵀ + b`` with W row-sharded (rank j owns rows R_j)::

    buf = W_r                                   # own shard: the first piece waits for nothing
    for k in 0 .. N-1:
        s = (r - k) mod N                       # shard in buf
        if k < N-1: start send(buf -> next), recv(nbuf <- prev)
        y[:, R_s] = x @ buf.T + b[R_s]          # compute piece k while hop k is in flight
        if k < N-1: wait; swap(buf, nbuf)

Backward, ``dx = dy W`` (all-gather ring again) and ``dW_r = Σ_ranks dy[:, R_r]ᵀ x`` (reduce-scatter ring),
both in one loop::

    for k in 0 .. N-1:
        s = (r - k) mod N ; t = (r - k - 1) mod N
        start: send(wbuf -> next), recv(nwbuf <- prev)            if k < N-1
               send(acc_{k-1} -> next), recv(racc <- prev)        if k > 0
        dx += dy[:, R_s] @ wbuf                                   # piece of dx
        part_k = dy[:, R_t]ᵀ @ x  (and db: Σ_tokens dy[:, R_t])  # this rank's share of shard t of dW
        wait; acc_k = part_k + racc  (part_k at k = 0)
    dW_r = acc_{N-1}                            # t == r at k == N-1: complete, nothing sent after it

Across layers (``runtime/schedule.py``): when each hop is requested and which buffers hold the shards. Lockstep
(``lookahead_mb=0``) is the pseudocode above, with hop 0 of the next layers requested during this layer's last
piece and the last gradient hop landing during the next layer's first piece (``Gradients.land``): two weight-shard and
two gradient-shard buffers live, never the full W, except for the last layer of the forward (the lm_head), which
keeps all N shards from its forward for its backward (``FusedSchedule.keeps_weight``) and then sends gradient
partials only. Elastic (the default on 2 ranks or more): the weight ring of a layer is requested ahead, into an
``(N, S)`` buffer, and the gradient hops lag (``Gradients.land``). The loop is the one every schedule's layer call
runs ([Note: one layer call], ``runtime/layer_call.py``), for both and for the slicing schedule
(``runtime/slicing.py``): ``piece_hops`` requests piece k's own hops and returns what to wait for at its end; the
call's ``before_piece`` and ``after_piece`` add other layers' hops beside it and take in the gradient rings that
landed; this module gives it each piece's compute. With ``piece_shards`` = G > 1 and a whole gathered buffer, the forward's outputs and
the backward's dx are computed G landed shards at a time (``ShardRuns``: fewer, wider GEMMs); the hops requested
and waited stay those of the loop. The reduction order is fixed by the ring and by G, so results repeat bit for
bit. All members of a fused group (q/k/v, gate/up) ride the same hops in one flat buffer
(``runtime/layout.py``). When gradient sync is off (accumulation micro-batches), the backward keeps each shard's
partial sum locally, sends no gradient bytes, and adds them into the parts of the next synced backward.

Words, here and in the runtime: a *step* is a training step (one forward of the sharded root, and its backward); a
*hop* is one exchange with the neighbours (every rank sends to ``next`` and receives from ``prev``), k in the loops
above; a *piece* is the GEMM work beside it; ``compute_dtype`` is what the pieces compute in, ``reduce_dtype`` what
the gradient ring carries; a *ring operation* (``RingOp``) is one layer's ring of N-1 or N hops in one phase.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..runtime.group import FusedGroupState
from ..runtime.layer_call import GradSpec
from ..runtime.layer_rings import WeightRing
from ..runtime.layout import GroupLayout, Member, MemberBlocks
from ..timeline import labelled


class Call(NamedTuple):
    """How one call of a fused group computes (decided in ``modules._apply``, outside the autograd Function)."""

    compute_dtype: torch.dtype  # compute dtype: autocast's when autocast is on, else ``param_dtype`` or the params' own
    reduce_dtype: torch.dtype  # of the gradient ring (the config's; under autocast the params' own, as AMP does)
    grad_nodes: tuple  # the parameters' AccumulateGrad nodes (None where a parameter needs no grad)


FIRST_PARAM = 3  # FusedRingLinearFn.apply(x, state, call, *params): where the parameters begin


class FusedRingLinearFn(torch.autograd.Function):
    """``outputs = FusedRingLinearFn.apply(x, state, call, *local_params)``; one output per member of the group.
    ``local_params`` are each member's local weight shard and, if it has one, local bias shard."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, state: FusedGroupState, call: Call, *params: torch.Tensor):
        x2, outs, outs2 = prepare_forward(state, x, call.compute_dtype)
        save_for_backward(ctx, state, call, x, x2, params)
        # A forward recomputed inside the backward (activation checkpointing) is no part of the layer order.
        recompute = torch._C._current_graph_task_id() != -1
        with labelled("commfuse::fused_forward"):
            ctx.full = forward_ring(state, params, call.compute_dtype, x2, outs2, x.requires_grad, recompute)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grad_outs: torch.Tensor):
        x2, *params = ctx.saved_tensors
        state = ctx.state
        state.steps.backward_begins()
        with labelled("commfuse::fused_backward"):
            dx, grads = backward_ring(state, x2, params, grad_outs, ctx.needs_input_grad[0],
                                      ctx.needs_input_grad[FIRST_PARAM:], ctx.call, ctx.full)
        ctx.full = None
        if dx is not None:
            dx = dx.view(ctx.x_shape).to(ctx.x_dtype)
        return (dx, None, None, *grads)


def prepare_forward(state: FusedGroupState, x: torch.Tensor,
                    compute_dtype: torch.dtype) -> tuple[torch.Tensor, list, list]:
    """The input as a contiguous ``(tokens, in)`` matrix in the compute dtype, one empty output per member in the
    input's leading shape (what the Function returns: not views, so that callers may write into them in place, as
    into nn.Linear's), and the same outputs as ``(tokens, out)`` matrices (what the pieces write)."""
    layout = state.layout
    x2 = x.reshape(-1, layout.in_features)
    x2 = x2.to(compute_dtype) if x2.dtype != compute_dtype else x2
    x2 = x2 if x2.is_contiguous() else x2.contiguous()
    lead = tuple(x.shape[:-1])
    outs = [x2.new_empty(*lead, m.out_features) for m in layout.members]
    return x2, outs, [y.view(-1, y.shape[-1]) for y in outs]


def save_for_backward(ctx, state: FusedGroupState, call: Call, x: torch.Tensor, x2: torch.Tensor, params) -> None:
    """Save what the backward needs (the outputs the forward fills in place are returned as they are)."""
    ctx.state, ctx.call, ctx.x_shape, ctx.x_dtype = state, call, x.shape, x.dtype
    ctx.save_for_backward(x2, *params)


def accumulates(state: FusedGroupState, call: Call) -> bool:
    """Whether this backward's gradients may be put into the parameters' ``.grad`` later, by us (a deferred hop,
    the slicing schedule's background reduce-scatter), instead of being returned through autograd now. Only under
    ``loss.backward()`` (not ``torch.autograd.grad`` or ``backward(inputs=...)`` without them: nothing is
    accumulated there) and only while no parameter of the group has a tensor hook (``register_hook``: autograd
    would call it at once, with no gradient). Post-accumulate-grad hooks are run by ``accumulate_grad``, except on
    a tied table, whose other gradient autograd accumulates (the hooks must run once, after both)."""
    params = state.params()
    if any(p._backward_hooks for p in params):
        return False
    if state.tied and any(getattr(p, "_post_accumulate_grad_hooks", None) for p in params):
        return False  # the ring embedding's gradient reaches the table through autograd: hooks once, after both
    try:
        return all(n is None or torch._C._will_engine_execute_node(n) for n in call.grad_nodes)
    except RuntimeError:  # autograd refuses the question for leaves under torch.autograd.grad: nothing accumulates
        return False


def forward_ring(state: FusedGroupState, params, compute_dtype: torch.dtype, x2: torch.Tensor, outs: list[torch.Tensor],
                 needs_dx: bool = True, recompute: bool = False) -> WeightRing | None:
    """The Note's forward loop over this rank's packed shards, writing every member's output columns: the
    schedule's call ([Note: one layer call]) runs it. Returns the ring, every shard gathered, when the group keeps
    them for its backward (``ScheduledCall.kept``), else None. ``needs_dx``: the backward will need the weight;
    ``recompute``: a forward recomputed during the backward, no part of the schedule's layer order."""
    call = state.steps.schedule.forward(state, params, compute_dtype, needs_dx, recompute)
    weights, runs = call.weights, call.runs

    def compute(k: int) -> None:
        if runs.piecewise:
            _forward_piece(state.layout, weights, k, x2, outs, weights.shard(k))
        elif (run := runs.add(k)) is not None:
            _forward_run(state.layout, weights.slots, *run, x2, outs)

    call.run(compute, runs.pieces)
    return call.kept


def _run_weight(m: Member, block: torch.Tensor, rows: int) -> torch.Tensor:
    """Member ``m``'s first ``rows`` weight rows across the consecutive slots ``block`` (``(G, numel)``): one
    ``(rows, in)`` matrix (a copy unless ``m`` is the slot's only part)."""
    return block[:, m.offset:m.offset + m.weight_numel].reshape(-1, m.in_features)[:rows]


def _forward_run(layout: GroupLayout, slots: torch.Tensor, low: int, high: int, x2: torch.Tensor,
                 outs: list[torch.Tensor]) -> None:
    """The output columns of shards ``low`` .. ``high`` (consecutive slots) in one GEMM per member."""
    block = slots[low:high + 1]
    block = block if block.dtype == x2.dtype else block.to(x2.dtype)
    for m, y in zip(layout.members, outs):
        lo, hi = m.rows(low)[0], m.rows(high)[1]
        if hi == lo:
            continue
        w = _run_weight(m, block, hi - lo)
        if m.has_bias:
            bias = block[:, m.offset + m.weight_numel:m.offset + m.numel].reshape(-1)[:hi - lo]
            torch.addmm(bias, x2, w.t(), out=y[:, lo:hi])
        else:
            torch.mm(x2, w.t(), out=y[:, lo:hi])


def _dx_run(layout: GroupLayout, slots: torch.Tensor, low: int, high: int, dys: list[torch.Tensor | None],
            dx: InputGrad) -> None:
    """The input gradient's part from shards ``low`` .. ``high`` (consecutive slots): one GEMM per member."""
    block = slots[low:high + 1]
    block = block if block.dtype == dx.dtype else block.to(dx.dtype)
    for m, dy in zip(layout.members, dys):
        lo, hi = m.rows(low)[0], m.rows(high)[1]
        if dy is not None and hi > lo:
            dx.add(dy[:, lo:hi], _run_weight(m, block, hi - lo))


class InputGrad:
    """``dx = Σ dy_piece @ w_piece`` over the pieces, in their order. The first product is written into the
    buffer rather than added to zeros (the same sums, without a zeroing pass and a read of zeros)."""

    __slots__ = ("buf", "fresh")

    def __init__(self, x2: torch.Tensor) -> None:
        self.buf, self.fresh = x2.new_empty(x2.shape), True

    @property
    def dtype(self) -> torch.dtype:
        return self.buf.dtype

    def add(self, dy: torch.Tensor, w: torch.Tensor) -> None:
        if self.fresh:
            torch.mm(dy, w, out=self.buf)
            self.fresh = False
        else:
            self.buf.addmm_(dy, w)

    def result(self) -> torch.Tensor:
        return self.buf.zero_() if self.fresh else self.buf  # (zero: no member had an output gradient)


def held_blocks(layout: GroupLayout, weights: WeightRing, k: int, dtype: torch.dtype
                ) -> tuple[tuple[MemberBlocks, ...], int]:
    """The members' weight blocks piece k computes with, in ``dtype``, and the row index in them."""
    blocks, index = weights.blocks(layout, k, dtype)
    if blocks[0].weight.dtype != dtype:  # prefetched before autocast changed the compute dtype (same on every rank)
        return layout.blocks(weights.held(k).to(dtype)), 0
    return blocks, index


def _forward_piece(layout: GroupLayout, weights: WeightRing, k: int, x2: torch.Tensor, outs: list[torch.Tensor],
                   shard: int) -> None:
    blocks, i = held_blocks(layout, weights, k, x2.dtype)
    for (lo, hi), b, y in zip(layout.spans[shard], blocks, outs):
        if hi == lo:
            continue
        w_t = b.weight_t[i] if hi - lo == b.chunk else b.weight_t[i, :, :hi - lo]
        if b.bias is not None:
            torch.addmm(b.bias[i, :hi - lo], x2, w_t, out=y[:, lo:hi])
        else:
            torch.mm(x2, w_t, out=y[:, lo:hi])


def backward_ring(state: FusedGroupState, x2: torch.Tensor, params: list[torch.Tensor],
                  grad_outs: tuple[torch.Tensor | None, ...], need_dx: bool,
                  params_need_grad: tuple[bool, ...], call: Call, full: WeightRing | None = None
                  ) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
    """The Note's backward loop: piece k adds its part of dx and writes this rank's share of shard t's dW while
    hop k brings the weight shard of piece k+1 and passes on the partial sum of piece k-1. ``full``: the
    forward's ring that kept every weight shard; then no weight shard travels."""
    bw = BackwardCall(state, x2, params, grad_outs, need_dx, params_need_grad, call, full)

    def compute(k: int) -> None:
        if bw.dx is not None:
            bw.dx_piece(k)
        if bw.grads is not None:
            bw.grad_piece(k)

    return bw.finish(bw.call.run(compute))


class BackwardCall:
    """One backward of a fused group: its output gradients, its call (from the schedule: its rings) and what each
    piece computes."""

    def __init__(self, state: FusedGroupState, x2: torch.Tensor, params: list[torch.Tensor],
                 grad_outs: tuple[torch.Tensor | None, ...], need_dx: bool, params_need_grad: tuple[bool, ...],
                 call: Call, full: WeightRing | None) -> None:
        engine, layout, sched = state.engine, state.layout, state.steps.schedule
        self.state, self.x2, self.params, self.needs = state, x2, params, params_need_grad
        self.layout, self.ring, self.sync = layout, engine.ring, engine.requires_grad_sync
        self.dys = [None if g is None else g.reshape(-1, m.out_features).to(x2.dtype)
                    for g, m in zip(grad_outs, layout.members)]
        self.train = [dy is not None and any(params_need_grad[i] for i in state.param_index(j))
                      for j, dy in enumerate(self.dys)]
        self.dys_t = [dy.t() if trainable else None for dy, trainable in zip(self.dys, self.train)]
        self.pre, self.post = engine.divide_factors() if self.sync else (1.0, 1.0)
        spec = None
        if any(self.train):
            # Every element of the gradient buffers is written before it is sent, except padding rows (out_features
            # not a multiple of N) and the regions of members without gradient; those are zeroed so that nothing
            # uninitialised travels the ring.
            zeroed = any(m.out_features % engine.ring.size for m in layout.members) or not all(self.train)
            spec = GradSpec(layout.numel, call.reduce_dtype, x2.device, zeroed, self.sync, accumulates(state, call),
                            self.post, tuple(p.dtype for p in params), tuple(self.train))
        self.call = sched.backward(state, params, x2.dtype, need_dx, full, spec)
        self.weights, self.grads = self.call.weights, self.call.grads
        # partials kept by no-sync backwards, added into this synced one's
        self.pending = state.take_unsynced() if self.grads is not None and self.sync else None
        self.dx = InputGrad(x2) if need_dx else None
        self.runs = self.call.runs

    def dx_piece(self, k: int) -> None:
        """dx += dy[:, R_s] @ W_s for the shard s held at piece k (or a run of them: ``piece_shards``)."""
        layout, dx = self.layout, self.dx
        if not self.runs.piecewise:
            if (run := self.runs.add(k)) is not None:
                _dx_run(layout, self.weights.slots, *run, self.dys, dx)
            return
        blocks, i = held_blocks(layout, self.weights, k, dx.dtype)
        for (lo, hi), b, dy in zip(layout.spans[self.weights.shard(k)], blocks, self.dys):
            if dy is not None and hi > lo:
                dx.add(dy[:, lo:hi], b.weight[i] if hi - lo == b.chunk else b.weight[i, :hi - lo])

    def grad_piece(self, k: int) -> None:
        """This rank's share of shard t's dW into ``part(k)``: kept while gradient sync is off, else with the kept
        partials added and divided by the pre-factor."""
        t, grads = self.ring.shard_reduced(k), self.grads
        part = grads.part(k)
        _grad_piece(self.layout, *grads.blocks(self.layout, k), self.dys_t, self.dys, self.train, self.x2, t)
        if not self.sync:
            self.state.keep_unsynced(t, part, self.ring.size)
            return
        if self.pending is not None:
            part.add_(self.pending[t])
        if self.pre != 1.0:
            part.div_(self.pre)

    def finish(self, final: torch.Tensor | None) -> tuple[torch.Tensor | None, list[torch.Tensor | None]]:
        """dx, and the gradients to return through autograd: from ``final``, the reduced shard the call closed
        with (None: no gradient, sync off, or the schedule puts it into the parameters' grads later)."""
        dx = self.dx.result() if self.dx is not None else None
        if final is None:
            return dx, [None] * len(self.params)
        return dx, unpack_grads(self.state, final, self.params, self.train, self.needs)


def unpack_grads(state: FusedGroupState, flat: torch.Tensor, params: list[torch.Tensor], train,
                 params_need_grad) -> list[torch.Tensor | None]:
    """Each parameter's gradient shard out of this rank's reduced flat buffer, to return through autograd."""
    grads: list[torch.Tensor | None] = [None] * len(params)
    for i, g in state.grad_shards(flat, params, [p.dtype for p in params], train):
        grads[i] = g if params_need_grad[i] else None
    return grads


def _grad_piece(layout: GroupLayout, blocks: tuple[MemberBlocks, ...], i: int, dys_t: list, dys: list,
                train: list[bool], x2: torch.Tensor, shard: int) -> None:
    """This rank's contribution to shard ``shard`` of every trainable member's dW (and db), into row ``i`` of the
    partials' ``blocks``. ``dys_t``: each output gradient transposed, ``(out, tokens)``."""
    for (lo, hi), b, dy_t, dy, trainable in zip(layout.spans[shard], blocks, dys_t, dys, train):
        if not trainable or hi == lo:
            continue
        w_out = b.weight[i] if hi - lo == b.chunk else b.weight[i, :hi - lo]
        if w_out.dtype == x2.dtype:
            torch.mm(dy_t[lo:hi], x2, out=w_out)
        else:
            w_out.copy_(torch.mm(dy_t[lo:hi], x2))
        if b.bias is not None:
            b.bias[i, :hi - lo].copy_(dy[:, lo:hi].sum(0))
