"""Sequence-parallel tensor parallelism whose activation rings run beside the GEMM's own pieces (TPSP, CommFuse's
other half), on the one layer call loop (``runtime/layer_call.py``) the data-parallel rings run.

[Note: TPSP on rings]  (N ranks of the tensor-parallel group, rank r; a sequence of S tokens, rank j holding the
rows R_j of it: ``seq_split``, the first S mod N ranks one row more, as ``torch.tensor_split`` splits)

A column-parallel linear (``ColumnParallelFn``: W row-sharded over its outputs, ``y = x Wᵀ``, the input
sequence-sharded) all-gathers the input's rows over the group: piece k computes ``y[R_s] = x_s W_rᵀ`` for the
shard s held at hop k, the rank's own rows first (nothing to wait for). Its backward reduce-scatters the input
gradient over the sequence, piece k writing this rank's contribution ``dy[R_t] W_r`` for the shard t the hop is
about to carry, the rank's own last; the weight gradient ``Σ_s dy[R_s]ᵀ x_s`` is summed beside the same pieces
from the input the forward gathered and kept (one full-sequence input per layer, in place of a second gather:
chosen for speed, as the activation memory of the gathered input is what DTensor's sequence parallelism keeps
too).

A row-parallel linear (``RowParallelFn``: W sharded over its inputs, the input feature-sharded as a
column-parallel linear leaves it) reduce-scatters its partial outputs to sequence shards: piece k writes
``y[R_t] W_rᵀ`` for the shard t of the next hop, the rank's own last, and the bias (replicated) is added to the
rows this rank keeps. Its backward all-gathers the output gradient's rows beside the pieces of ``dy[R_s] = g_s
W_r`` and of ``dW += g_sᵀ y[R_s]``.

A vocabulary-parallel embedding (``VocabEmbeddingFn``: the table's rows split over the ranks) looks up, for the
rows R_t of the next hop, the tokens whose rows this rank holds (zeros for the others), and reduce-scatters
those partial rows as a row-parallel linear does; its backward gathers the output gradient's rows and adds each
row to the table row of its token, where this rank holds it.

The sequence is the second to last dimension (``(..., S, features)``, a batch of sequences each sharded over the
ranks); one column-parallel call carries several members beside one gather (q, k and v; gate and up). The slots
a ring carries are ``max |R_j|`` rows of every rank, a shorter shard in the front of its slot; ``TPState`` is a
ring owner over the group (its engine's ring is the tensor-parallel group).
"""

from __future__ import annotations

import torch

from ..runtime.exchange import gather_into, reduce


class TPState:
    """A tensor-parallel layer's ring owner: the engine whose ring is the tensor-parallel group, the step state
    that names its ring operations, and its owner index there."""

    def __init__(self, steps, name: str, fused: bool = True) -> None:
        self.engine, self.steps, self.name = steps.engine, steps, name
        self.owner = steps.register(name)
        self.fused = fused  # False: the reference schedule (``_gather``, ``_reduce``)


def seq_split(seq: int, size: int) -> tuple[list[int], list[int]]:
    """The rows of a sequence of ``seq`` tokens each of ``size`` ranks holds: (counts, offsets), the first
    ``seq % size`` ranks one row more (``torch.tensor_split``'s split)."""
    base, extra = divmod(seq, size)
    counts = [base + (r < extra) for r in range(size)]
    offsets = [sum(counts[:r]) for r in range(size)]
    return counts, offsets


def _rows(t: torch.Tensor, offset: int, count: int) -> torch.Tensor:
    """Rows ``offset:offset+count`` of the ``(B, S, f)`` tensor ``t`` as a ``(B*count, f)`` matrix (a view when
    B is 1, else a copy)."""
    return t[:, offset:offset + count].reshape(-1, t.shape[-1])


def _filled(slot: torch.Tensor, rows: int, width: int, tail: bool) -> torch.Tensor:
    """The first ``rows`` rows of a flat ring slot as a ``(rows, width)`` matrix; with ``tail`` the rest of the
    slot (the padding of a shorter shard) is zeroed."""
    if tail:
        slot[rows * width:].zero_()
    return slot[:rows * width].view(rows, width)


class ColumnParallelFn(torch.autograd.Function):
    """``ys = ColumnParallelFn.apply(x_local, state, seq, w_1, b_1, w_2, b_2, ...)``: ``x_local`` this rank's
    sequence shard ``(B, |R_r|, in)`` of a sequence of ``seq`` tokens; each member ``i`` (q, k and v, or gate and
    up: one gather for all of them) its rows ``w_i`` ``(out_i/N, in)`` of its weight and ``b_i`` ``(out_i/N,)`` or
    None. ``ys``: one ``(B, seq, out_i/N)`` per member, the whole sequence."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, state: TPState, seq: int, *params):
        ring = state.engine.ring
        counts, offsets = seq_split(seq, ring.size)
        batch, width = x.shape[0], x.shape[-1]
        if x.dim() != 3 or x.shape[1] != counts[ring.rank]:
            raise ValueError(f"ColumnParallelFn: rank {ring.rank} got an input of shape {tuple(x.shape)}; it holds "
                             f"{counts[ring.rank]} of the {seq} rows of each sequence (batch, rows, features)")
        slot = batch * counts[0] * width
        gathered = x.new_empty(ring.size, slot)
        gathered[ring.rank, :x.numel()].view_as(x).copy_(x)
        members = list(zip(params[0::2], params[1::2]))
        ys = [x.new_empty(batch, seq, w.shape[0]) for w, _ in members]

        def piece(s: int) -> None:
            x_s = gathered[s, :batch * counts[s] * width].view(-1, width)
            for (w, b), y in zip(members, ys):
                if batch == 1:  # the output rows of shard s are one block: computed in place
                    out = y[0, offsets[s]:offsets[s] + counts[s]]
                    torch.addmm(b, x_s, w.t(), out=out) if b is not None else torch.mm(x_s, w.t(), out=out)
                else:
                    got = torch.addmm(b, x_s, w.t()) if b is not None else torch.mm(x_s, w.t())
                    y[:, offsets[s]:offsets[s] + counts[s]].copy_(got.view(batch, counts[s], w.shape[0]))

        _gather(state, gathered, "forward", piece)
        ctx.state, ctx.split, ctx.shape = state, (counts, offsets), (batch, width)
        ctx.biased = [b is not None for _, b in members]
        ctx.save_for_backward(gathered, *params[0::2])
        return tuple(ys)

    @staticmethod
    def backward(ctx, *dys: torch.Tensor):
        gathered, *weights = ctx.saved_tensors
        state, (counts, offsets), (batch, width) = ctx.state, ctx.split, ctx.shape
        ring = state.engine.ring
        dys = [None if dy is None else dy.contiguous() for dy in dys]
        dws = [torch.zeros_like(w) for w in weights]

        rows: dict[int, list] = {}  # shard -> each member's output-gradient rows (a copy when B > 1), used twice

        def weight_grads(t: int) -> None:
            x_t = gathered[t, :batch * counts[t] * width].view(-1, width)
            for dy_t, dw in zip(rows.pop(t), dws):
                if dy_t is not None:
                    dw.addmm_(dy_t.t(), x_t)

        def piece(k: int, part: torch.Tensor) -> None:
            t = ring.shard_reduced(k)
            part = _filled(part, batch * counts[t], width, counts[t] < counts[0])
            rows[t] = [None if dy is None else _rows(dy, offsets[t], counts[t]) for dy in dys]
            first = True
            for dy_t, w in zip(rows[t], weights):
                if dy_t is None:
                    continue
                if first:
                    torch.mm(dy_t, w, out=part)
                    first = False
                else:
                    part.addmm_(dy_t, w)
            if first:
                part.zero_()
            # the weight gradient of the shard before, beside this piece's hop (piece 0 has none beside it: only
            # its input gradient, which the first hop carries); the last piece also its own shard's
            if k > 0:
                weight_grads(ring.shard_reduced(k - 1))
            if k == ring.size - 1:
                weight_grads(t)

        dx = _reduce(state, (gathered.shape[1],), gathered.dtype, gathered.device, piece, "backward", by_piece=True)
        grads = []
        for dy, dw, biased in zip(dys, dws, ctx.biased):
            grads += [dw if dy is not None else None,
                      dy.sum((0, 1)) if biased and dy is not None else None]
        mine = counts[ring.rank]
        return (dx[:batch * mine * width].view(batch, mine, width), None, None, *grads)


class RowParallelFn(torch.autograd.Function):
    """``out_local = RowParallelFn.apply(y, state, weight, bias)``: ``y`` the ``(B, S, in/N)`` input a
    column-parallel linear leaves, ``weight`` this rank's ``(out, in/N)`` columns of W, ``bias`` the whole
    ``(out,)`` (replicated) or None; ``out_local`` is this rank's sequence shard ``(B, |R_r|, out)``."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, state: TPState, weight: torch.Tensor, bias: torch.Tensor | None):
        ring = state.engine.ring
        y = y.contiguous()
        batch, width = y.shape[0], weight.shape[0]
        counts, offsets = seq_split(y.shape[1], ring.size)

        def piece(t: int, part: torch.Tensor) -> None:
            out = _filled(part, batch * counts[t], width, counts[t] < counts[0])
            torch.mm(_rows(y, offsets[t], counts[t]), weight.t(), out=out)

        out = _mine(_reduce(state, (batch * counts[0] * width,), y.dtype, y.device, piece, "forward"),
                    batch, counts[ring.rank], width)
        if bias is not None:
            out = out + bias
        ctx.state, ctx.split, ctx.has_bias = state, (counts, offsets), bias is not None
        ctx.save_for_backward(y, weight)
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        y, weight = ctx.saved_tensors
        state, (counts, offsets) = ctx.state, ctx.split
        batch, width = y.shape[0], weight.shape[0]
        gathered = _gathered_rows(state, dout, counts[0])
        dy = torch.empty_like(y)
        dw = torch.zeros_like(weight)
        db = dout.new_zeros(width) if ctx.has_bias else None

        def piece(s: int) -> None:
            g_s = gathered[s, :batch * counts[s] * width].view(-1, width)
            dy[:, offsets[s]:offsets[s] + counts[s]].copy_(
                torch.mm(g_s, weight).view(batch, counts[s], weight.shape[1]))
            dw.addmm_(g_s.t(), _rows(y, offsets[s], counts[s]))
            if db is not None:
                db.add_(g_s.sum(0))

        _gather(state, gathered, "backward", piece)
        return dy, None, dw, db


class VocabEmbeddingFn(torch.autograd.Function):
    """``out_local = VocabEmbeddingFn.apply(ids, state, weight, start, padding_idx)``: ``ids`` the whole
    ``(B, S)`` token ids (every rank's the same), ``weight`` this rank's rows ``start:start+V_r`` of the table;
    ``out_local`` this rank's sequence shard ``(B, |R_r|, H)`` of the looked-up rows. The gradient of the row of
    ``padding_idx`` stays zero, as ``nn.Embedding``'s does."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, state: TPState, weight: torch.Tensor, start: int, padding_idx):
        ring = state.engine.ring
        batch, width = ids.shape[0], weight.shape[1]
        counts, offsets = seq_split(ids.shape[1], ring.size)
        local, held = _held(ids, start, weight.shape[0])

        def piece(t: int, part: torch.Tensor) -> None:
            out = _filled(part, batch * counts[t], width, counts[t] < counts[0])
            rows = slice(offsets[t], offsets[t] + counts[t])
            torch.mul(torch.nn.functional.embedding(local[:, rows].reshape(-1), weight),
                      held[:, rows].reshape(-1, 1), out=out)

        out = _mine(_reduce(state, (batch * counts[0] * width,), weight.dtype, weight.device, piece, "forward"),
                    batch, counts[ring.rank], width)
        ctx.state, ctx.split, ctx.padding_idx, ctx.start = state, (counts, offsets), padding_idx, start
        ctx.save_for_backward(ids, weight)
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        ids, weight = ctx.saved_tensors
        state, (counts, offsets) = ctx.state, ctx.split
        batch, width = ids.shape[0], weight.shape[1]
        local, held = _held(ids, ctx.start, weight.shape[0])
        if ctx.padding_idx is not None:
            held = held & (ids != ctx.padding_idx)
        gathered = _gathered_rows(state, dout, counts[0])
        dw = torch.zeros_like(weight)

        def piece(s: int) -> None:
            rows = slice(offsets[s], offsets[s] + counts[s])
            keep = held[:, rows].reshape(-1)
            g_s = gathered[s, :batch * counts[s] * width].view(-1, width)
            dw.index_add_(0, local[:, rows].reshape(-1)[keep], g_s[keep])

        _gather(state, gathered, "backward", piece)
        return None, None, dw, None, None


def _gather(state: TPState, gathered: torch.Tensor, phase: str, piece) -> None:
    """The all-gather of ``gathered``'s slots with ``piece(s)`` on each: fused, each piece beside the hop that
    brings the next slot; the reference (``state.fused`` False, DTensor's schedule on the same rings), every piece
    after the whole gather."""
    if state.fused:
        gather_into(state, gathered, phase, piece)
        return
    gather_into(state, gathered, phase)
    for s in range(state.engine.ring.size):
        piece(s)


def _reduce(state: TPState, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, piece,
            phase: str, by_piece: bool = False) -> torch.Tensor:
    """The reduce-scatter of the parts ``piece(t, part)`` writes for rank t (``by_piece``: ``piece(k, part)``, k
    the piece, whose part is for ``ring.shard_reduced(k)``): fused, each beside the hop that carries the one
    before; the reference, every part first and then the whole reduce-scatter."""
    ring = state.engine.ring
    if state.fused:
        if by_piece:
            return reduce(state, shape, dtype, device, piece, phase, by_piece=True)
        return reduce(state, shape, dtype, device, piece, phase)
    parts = torch.empty(ring.size, *shape, dtype=dtype, device=device)
    for k in range(ring.size):
        t = ring.shard_reduced(k)
        piece(k if by_piece else t, parts[t])
    return reduce(state, shape, dtype, device, lambda t, part: part.copy_(parts[t]), phase)


def _held(ids: torch.Tensor, start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's row in this rank's part of the table (0 where another rank holds it), and where this rank
    holds it."""
    local = ids - start
    held = (local >= 0) & (local < rows)
    return local.masked_fill(~held, 0), held


def _mine(flat: torch.Tensor, batch: int, rows: int, width: int) -> torch.Tensor:
    """This rank's ``(B, rows, width)`` shard from the front of its reduced slot."""
    return flat[:batch * rows * width].view(batch, rows, width)


def _gathered_rows(state: TPState, mine: torch.Tensor, slot_rows: int) -> torch.Tensor:
    """The ring slots of an all-gather of sequence shards, this rank's ``(B, |R_r|, f)`` rows in the front of its
    own (the others are filled by the ring)."""
    ring = state.engine.ring
    batch, width = mine.shape[0], mine.shape[-1]
    gathered = mine.new_empty(ring.size, batch * slot_rows * width)
    gathered[ring.rank, :mine.numel()].view_as(mine).copy_(mine)
    return gathered
