"""The ring embedding: a row-sharded ``nn.Embedding`` whose ranks exchange looked-up rows instead of the table.

Rank j owns rows ``[j·c, (j+1)·c)`` of the ``(V, H)`` table, ``c = ceil(V / N)`` (``torch.chunk``), as a
``Shard(0)`` DTensor. Each call picks the cheaper of two exchanges, the same choice on every rank (it depends only
on the largest token count ``T`` of any rank, which the ranks swap first):

- *rows* (``T ≤ c``: the tokens of a rank are fewer than the rows of a shard, the usual case for large vocabularies):

  forward: the ranks' token ids go round the ring (all-gather, ``T`` ids per step); then a reduce-scatter ring
  of ``(T, H)`` partial outputs: at step k this rank looks up, for the tokens of rank ``t = (r - k - 1) mod N``,
  the rows it owns (zero elsewhere) and adds the partial sum received from ``prev``; after N-1 steps it holds the
  complete rows of its own tokens. Every output row has exactly one non-zero contribution, so the result is exact.

  backward: the output gradients ``dY`` go round the ring (all-gather); beside each step this rank adds the held
  rank's rows into the gradient of the table rows it owns (``index_add``). Padding-index rows get no gradient.

- *table* (``T > c``): the classic ZeRO-3 path, an all-gather of the table shards, a plain lookup, and a
  reduce-scatter of the dense table gradient. The backward needs no table, so nothing is gathered twice.

Per rank and per step, rows moves ``(N-1)·T·H`` elements each way and table ``(N-1)·c·H``. The gradient is
exchanged even inside ``no_sync()`` (the rows of the other ranks are needed to form this rank's shard at all);
its sum over ranks is divided as ``CommFuseConfig.grad_divide`` says, like every other gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.autograd.profiler import record_function

from .exchange import gather as _gather, gather_into as _gather_into, reduce as _reduce
from .reads import guarded_class
from .replicas import autograd_grad, grad_node
from .step import StepState


class EmbeddingState:
    """What the ring embedding's Function needs: the engine and step state, its ring-op identity, the table's row
    count and this rank's row range."""

    def __init__(self, steps: StepState, module: nn.Embedding, num_embeddings: int, name: str) -> None:
        engine = self.engine = steps.engine
        self.steps, self.name = steps, name
        self.op = steps.register(name)
        world, rank = engine.ring.size, engine.ring.rank
        self.num_embeddings = num_embeddings
        self.chunk = -(-num_embeddings // world)  # rows per shard (torch.chunk)
        self.lo = min(rank * self.chunk, num_embeddings)
        self.rows = min(self.chunk, num_embeddings - self.lo)
        padding = module.padding_idx
        self.padding_idx = None if padding is None else padding % num_embeddings


class RingEmbeddingFn(torch.autograd.Function):
    """``y = RingEmbeddingFn.apply(ids, state, local_weight, (param, its AccumulateGrad node))``."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, state: EmbeddingState, weight: torch.Tensor, owner=None) -> torch.Tensor:
        ctx.owner = owner
        engine = state.engine
        cdt = engine.compute_dtype(weight.dtype)
        flat = ids.reshape(-1).to(torch.int64)
        with record_function("commfuse::embedding_forward"):
            # The only host read of the step here (a CUDA host synchronisation): every rank's token count sizes the
            # buffers, and whether any rank has an id out of range makes every rank raise, not only that one.
            bad = ((flat < 0) | (flat >= state.num_embeddings)).any().to(torch.int64)
            mine = torch.stack([torch.full_like(bad, flat.numel()), bad])
            counts = _gather(state, mine, "embedding counts").tolist()
            if any(flag for _, flag in counts):  # every rank raises, not only the one with the bad ids
                ranks = [r for r, (_, flag) in enumerate(counts) if flag]
                raise IndexError(f"embedding: token ids out of range [0, {state.num_embeddings}) on rank(s) {ranks} "
                                 f"(group ranks); check the tokenizer's vocabulary against the model's "
                                 f"{state.num_embeddings} embedding rows")
            most = max(n for n, _ in counts)
            ctx.state, ctx.most = state, most
            if most <= state.chunk:
                padded = flat.new_full((most,), -1)
                padded[:flat.numel()] = flat
                ids_all = _gather(state, padded, "embedding ids")
                out = _rows_forward(state, weight, ids_all, cdt)
                ctx.save_for_backward(ids_all)
            else:
                out = _table_forward(state, weight, flat, cdt)
                ctx.save_for_backward(flat)
        ctx.rows_mode = most <= state.chunk
        ctx.weight_dtype = weight.dtype
        return out[:flat.numel()].view(*ids.shape, weight.shape[1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        if not ctx.needs_input_grad[2]:
            return None, None, None, None
        state = ctx.state
        engine = state.engine
        if engine.replicas is not None:  # the end of this backward sends its gradient across the copies
            state.steps.backward_begins()
        (saved,) = ctx.saved_tensors
        hidden = grad_out.shape[-1]
        rdt = engine.reduce_dtype(engine.compute_dtype(ctx.weight_dtype))
        pre, post = engine.divide_factors()
        dy = grad_out.reshape(-1, hidden).to(rdt)
        with record_function("commfuse::embedding_backward"):
            if ctx.rows_mode:
                grad = _rows_backward(state, saved, dy, ctx.most, rdt, pre)
            else:
                grad = _table_backward(state, saved, dy, rdt, pre)
        if post != 1.0:
            grad.div_(post)
        grad = grad.to(ctx.weight_dtype)
        if ctx.owner is not None:  # HSDP: pending until it crossed the copies (replicas.py)
            grad = autograd_grad(engine, ctx.owner[0], ctx.owner[1], grad, f"the gradient of {state.name}")
        return None, None, grad, None


# ---- the two exchanges ----------------------------------------------------------------------------------

def _rows_forward(state: EmbeddingState, weight: torch.Tensor, ids_all: torch.Tensor,
                  cdt: torch.dtype) -> torch.Tensor:
    index, mine = _owned(state, ids_all, skip_padding=False)

    def lookup(t: int, part: torch.Tensor) -> None:
        if index is None:
            part.zero_()
            return
        if weight.dtype == cdt:
            torch.index_select(weight, 0, index[t], out=part)
        else:
            part.copy_(weight.index_select(0, index[t]))
        part.masked_fill_(~mine[t].unsqueeze(1), 0)

    return _reduce(state, (ids_all.shape[1], weight.shape[1]), cdt, weight.device, lookup,
                   "embedding forward", then=_prefetch_layers(state))


def _rows_backward(state: EmbeddingState, ids_all: torch.Tensor, dy: torch.Tensor, most: int, rdt: torch.dtype,
                   pre: float) -> torch.Tensor:
    engine = state.engine
    world, rank = engine.ring.size, engine.ring.rank
    hidden = dy.shape[1]
    held = dy.new_empty(world, most, hidden)
    held[rank, :dy.shape[0]].copy_(dy)
    held[rank, dy.shape[0]:].zero_()
    if pre != 1.0:
        held[rank].div_(pre)
    index, mine = _owned(state, ids_all, skip_padding=True)
    grad = dy.new_zeros(state.rows, hidden)

    def add(s: int) -> None:
        if index is not None:  # rows of other shards add exact zeros
            grad.index_add_(0, index[s], held[s].masked_fill(~mine[s].unsqueeze(1), 0))

    _gather_into(state, held, "embedding backward", add)
    return grad


def _table_forward(state: EmbeddingState, weight: torch.Tensor, flat: torch.Tensor, cdt: torch.dtype):
    engine = state.engine
    world, rank = engine.ring.size, engine.ring.rank
    table = weight.new_empty(world, state.chunk, weight.shape[1], dtype=cdt)
    table[rank, :state.rows].copy_(weight)
    table[rank, state.rows:].zero_()
    _gather_into(state, table, "embedding forward", then=_prefetch_layers(state))
    full = table.view(world * state.chunk, -1)[:state.num_embeddings]
    return F.embedding(flat, full, state.padding_idx)


def _table_backward(state: EmbeddingState, flat: torch.Tensor, dy: torch.Tensor, rdt: torch.dtype,
                    pre: float) -> torch.Tensor:
    world = state.engine.ring.size
    dense = dy.new_zeros(world * state.chunk, dy.shape[1])
    keep = flat != state.padding_idx if state.padding_idx is not None else None
    if keep is None:
        dense.index_add_(0, flat, dy)
    else:
        dense.index_add_(0, flat[keep], dy[keep])
    if pre != 1.0:
        dense.div_(pre)
    dense = dense.view(world, state.chunk, -1)

    def take(t: int, part: torch.Tensor) -> None:
        part.copy_(dense[t])

    return _reduce(state, dense.shape[1:], rdt, dy.device, take, "embedding backward")[:state.rows]


def _prefetch_layers(state: EmbeddingState) -> Callable[[], None]:
    """Queued behind the embedding's last ring step: the first fused layers' first steps (``prefetch_next``)."""
    return lambda: state.steps.schedule.start_first("forward")


def _owned(state: EmbeddingState, ids_all: torch.Tensor, *,
           skip_padding: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """For every rank's ids (a row of ``ids_all``): the local row of each id, clamped into the shard, and whether
    this rank owns it. Dense, with no ``nonzero``: the lookups take every position and zero the ones not owned, so
    the host never waits for the GPU here. ``(None, None)`` when this rank owns no rows."""
    if state.rows == 0:
        return None, None
    local = ids_all - state.lo
    mine = (local >= 0) & (local < state.rows)
    if skip_padding and state.padding_idx is not None:
        mine &= ids_all != state.padding_idx
    return local.clamp_(0, state.rows - 1), mine


# ---- the module ------------------------------------------------------------------------------------------

@torch.compiler.disable  # a ring step cannot be traced: torch.compile breaks the graph here and runs it eagerly
def _ring_embedding_forward(self: nn.Embedding, ids: torch.Tensor) -> torch.Tensor:
    state = self._cf_embedding
    if state.engine.stats.enabled:
        state.engine.stats.mark()
    param = self._parameters["weight"]
    local = param.to_local()
    owner = (param, grad_node(local)) if state.engine.replicas is not None else None  # HSDP only (replicas.py)
    return RingEmbeddingFn.apply(ids, state, local, owner)


def _refuse_deepcopy(self: nn.Embedding, memo) -> None:
    self._cf_embedding.engine.__deepcopy__(memo)  # raises, saying why and what to do instead


# ``nn.Embedding`` with a row-sharded DTensor table and the ring exchange above (made by ``convert_embedding`` from
# an existing module; names, state-dict keys and ``isinstance(m, nn.Embedding)`` are kept).
RingEmbedding = guarded_class("RingEmbedding", nn.Embedding, {"forward": _ring_embedding_forward,
                                                              "__deepcopy__": _refuse_deepcopy})


def embedding_eligible(module: nn.Module) -> str | None:
    """Why ``module`` cannot be a ring embedding, or None if it can."""
    if type(module) is not nn.Embedding:
        return f"{type(module).__name__} is not nn.Embedding itself"
    if module.max_norm is not None:
        return "max_norm renormalises the table in place during the forward"
    if module.scale_grad_by_freq or module.sparse:
        return "scale_grad_by_freq / sparse gradients are not supported"
    return None


def convert_embedding(module: nn.Embedding, steps: StepState, name: str,
                      table: nn.Parameter | None = None) -> nn.Parameter:
    """Shard ``module``'s table by rows onto the engine's mesh and swap its class; returns the new parameter.
    ``table``: the row-sharded ``Shard(0)`` DTensor parameter of a fused lm_head tied to this table (same rows
    per rank, as ``torch.chunk`` splits both), used as it is instead of sharding the table a second time."""
    from .modules import shard_parameter

    num_embeddings = module.weight.shape[0]
    if table is not None:
        assert tuple(table.shape) == tuple(module.weight.shape), "a tied table has one shape"
        module.weight = param = table
    else:
        param = shard_parameter(module, "weight", 0, steps.engine)
    module._cf_embedding = EmbeddingState(steps, module, num_embeddings, name)
    module.__class__ = RingEmbedding
    return param
