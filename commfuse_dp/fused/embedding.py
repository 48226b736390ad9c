"""The ring embedding: a row-sharded ``nn.Embedding`` whose ranks exchange looked-up rows instead of the table.

Rank j owns rows ``[j·c, (j+1)·c)`` of the ``(V, H)`` table, ``c = ceil(V / N)`` (``torch.chunk``), as a
``Shard(0)`` DTensor. Each call picks the cheaper of two exchanges, the same choice on every rank (it depends only
on what the ranks swap first: how many of each rank's tokens fall in each shard):

- *rows* (while it moves fewer bytes than the table ring, ``rows_cheaper``: for ids spread over the shards, about
  while the tokens of a rank are fewer than the table's rows, ``T ≤ N·c``):

  forward: the ranks' token ids are all-gathered (with the count swap: how many of each rank's tokens fall in
  each shard, so every rank knows every message's size). Then one direct exchange: this rank sends each peer
  the rows it owns of that peer's tokens, and receives from each peer the rows of its own tokens that the peer
  owns; it copies them into place. Every row comes from exactly one rank, so the result is exact.

  backward: the reverse exchange: this rank sends each peer the output-gradient rows ``dY`` of its tokens whose
  ids that peer owns, and adds what it receives into the gradient of the table rows it owns (``index_add``, the
  ranks in ring order: its own first, then ``r-1``, ``r-2``, ...). Padding-index rows get no gradient.

- *table* (otherwise): the classic ZeRO-3 path, an all-gather of the table shards, a plain lookup, and a
  reduce-scatter of the dense table gradient. The backward needs no table, so nothing is gathered twice.

Per rank and per step, rows receives at most ``T·H`` elements each way (the rows of its tokens owned elsewhere:
about ``(N-1)/N·T·H`` for ids spread over the shards) and sends the rows of its shard that the others' tokens use,
in one round whatever N; table moves ``(N-1)·c·H`` in N-1 hops. The gradient is exchanged even inside
``no_sync()`` (the rows of the other ranks are needed to form this rank's shard at all); its sum over ranks is
divided as ``CommFuseConfig.grad_divide`` says, like every other gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..runtime.exchange import gather as _gather, gather_into as _gather_into, reduce as _reduce, swap as _swap
from ..runtime.replicas import autograd_grad, grad_node
from ..runtime.step import StepState
from ..timeline import labelled
from .modules import shard_parameter
from .reads import guarded_class


class EmbeddingState:
    """What the ring embedding's Function needs: the engine and step state, its ring-op identity, the table's row
    count and this rank's row range."""

    def __init__(self, steps: StepState, module: nn.Embedding, num_embeddings: int, name: str) -> None:
        engine = self.engine = steps.engine
        self.steps, self.name = steps, name
        self.owner = steps.register(name)
        world, rank = engine.ring.size, engine.ring.rank
        self.num_embeddings = num_embeddings
        self.chunk = -(-num_embeddings // world)  # rows per shard (torch.chunk)
        self.lo = min(rank * self.chunk, num_embeddings)
        self.rows = min(self.chunk, num_embeddings - self.lo)
        self.width = module.weight.shape[1]
        padding = module.padding_idx
        self.padding_idx = None if padding is None else padding % num_embeddings


class RingEmbeddingFn(torch.autograd.Function):
    """``y = RingEmbeddingFn.apply(ids, state, local_weight, (param, its AccumulateGrad node))``."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, state: EmbeddingState, weight: torch.Tensor, owner=None) -> torch.Tensor:
        ctx.owner = owner
        engine = state.engine
        compute_dtype = engine.compute_dtype(weight.dtype)
        flat = ids.reshape(-1).to(torch.int64)
        with labelled("commfuse::embedding_forward"):
            # The only host read of the step here (a CUDA host synchronisation): every rank's token count sizes the
            # buffers, and whether any rank has an id out of range makes every rank raise, not only that one.
            bad = ((flat < 0) | (flat >= state.num_embeddings)).any().to(torch.int64)
            # and how many of this rank's tokens each shard owns: the sizes of the rows exchange's messages
            owners = flat.clamp(0, state.num_embeddings - 1) // state.chunk
            per_shard = owners.new_zeros(engine.ring.size).scatter_add_(0, owners, torch.ones_like(owners))
            mine = torch.cat([torch.stack([torch.full_like(bad, flat.numel()), bad]), per_shard])
            counts = _gather(state, mine, "embedding counts").cpu()
            if counts[:, 1].any():  # every rank raises, not only the one with the bad ids
                ranks = counts[:, 1].nonzero().flatten().tolist()
                raise IndexError(f"embedding: token ids out of range [0, {state.num_embeddings}) on rank(s) {ranks} "
                                 f"(group ranks); check the tokenizer's vocabulary against the model's "
                                 f"{state.num_embeddings} embedding rows")
            most = int(counts[:, 0].max())
            ctx.state = state
            itemsize = torch.empty((), dtype=compute_dtype).element_size()
            ctx.rows_mode = rows_cheaper(state, counts[:, 2:], most, itemsize)
            if ctx.rows_mode:
                padded = flat.new_full((most,), -1)
                padded[:flat.numel()] = flat
                ids_all = _gather(state, padded, "embedding ids")
                ctx.held = held = _Held(state, ids_all, counts[:, 2:])
                out = _rows_forward(state, weight, held, compute_dtype)
            else:
                out = _table_forward(state, weight, flat, compute_dtype)
                ctx.save_for_backward(flat)
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
        hidden = grad_out.shape[-1]
        reduce_dtype = engine.reduce_dtype(engine.compute_dtype(ctx.weight_dtype))
        pre, post = engine.divide_factors()
        dy = grad_out.reshape(-1, hidden).to(reduce_dtype)
        with labelled("commfuse::embedding_backward"):
            if ctx.rows_mode:
                grad = _rows_backward(state, ctx.held, dy, pre)
            else:
                grad = _table_backward(state, ctx.saved_tensors[0], dy, reduce_dtype, pre)
        if post != 1.0:
            grad.div_(post)
        grad = grad.to(ctx.weight_dtype)
        if ctx.owner is not None:  # HSDP: pending until it crossed the copies (replicas.py)
            grad = autograd_grad(engine, ctx.owner[0], ctx.owner[1], grad, f"the gradient of {state.name}")
        return None, None, grad, None


# ---- the two exchanges ----------------------------------------------------------------------------------

def rows_cheaper(state: EmbeddingState, per_shard: torch.Tensor, most: int, itemsize: int) -> bool:
    """Whether the rows exchange moves no more bytes on the busiest rank than the table ring moves on every one:
    the rows it sends or receives (``per_shard[p, s]``: rank p's tokens in shard s; a host tensor), whichever is
    more, plus the ids all-gather, against ``(N-1)·c`` table rows. The same on every rank (every rank has every
    count)."""
    world, width = state.engine.ring.size, state.width
    if world == 1:
        return True
    elsewhere = per_shard.clone().fill_diagonal_(0)  # tokens looked up in another rank's shard
    rows = int(torch.maximum(elsewhere.sum(0), elsewhere.sum(1)).max())  # sent by shard s / received by rank s
    return rows * width * itemsize + (world - 1) * most * 8 <= (world - 1) * state.chunk * width * itemsize


class _Held:
    """Where the tokens this rank exchanges rows for are: ``order[p]`` lists rank p's token positions grouped by
    owning shard, each group in token order (a stable sort, on the device: no host read); from the count swap's
    ``per_shard`` (host), the sizes and starts of this rank's own groups (``mine``) and of every rank's group in
    this rank's shard (``theirs``)."""

    def __init__(self, state: EmbeddingState, ids_all: torch.Tensor, per_shard: torch.Tensor) -> None:
        world, rank = state.engine.ring.size, state.engine.ring.rank
        owner = torch.where(ids_all < 0, world, ids_all // state.chunk)  # padding (-1) after every shard
        self.ids_all, self.lo, self.rank = ids_all, state.lo, rank
        self.order = torch.sort(owner, dim=1, stable=True).indices
        starts = per_shard.cumsum(1) - per_shard
        self.mine = per_shard[rank].tolist(), starts[rank].tolist()  # indexed by shard
        self.theirs = per_shard[:, rank].tolist(), starts[:, rank].tolist()  # indexed by rank

    def own(self, s: int) -> torch.Tensor:
        """Positions among this rank's tokens of those whose ids shard s owns, in token order."""
        count, start = self.mine[0][s], self.mine[1][s]
        return self.order[self.rank, start:start + count]

    def local_ids(self, p: int) -> torch.Tensor:
        """This rank's table rows for those of rank p's tokens it owns, in token order."""
        count, start = self.theirs[0][p], self.theirs[1][p]
        return self.ids_all[p].index_select(0, self.order[p, start:start + count]) - self.lo


def _rows_forward(state: EmbeddingState, weight: torch.Tensor, held: _Held, compute_dtype: torch.dtype) -> torch.Tensor:
    ring = state.engine.ring
    mine, theirs = held.mine[0], held.theirs[0]

    def rows_for(p: int) -> torch.Tensor:  # the rows this rank owns of rank p's tokens
        return weight.index_select(0, held.local_ids(p)).to(compute_dtype)

    out = weight.new_empty(sum(mine), weight.shape[1], dtype=compute_dtype)
    sends = {p: rows_for(p) for p in ring.peers if theirs[p]}
    recvs = {p: out.new_empty(mine[p], out.shape[1]) for p in ring.peers if mine[p]}
    hop = _swap(state, sends, recvs, "embedding forward", then=_prefetch_layers(state))
    out.index_copy_(0, held.own(ring.rank), rows_for(ring.rank))
    if hop is not None:
        hop.wait()
    for p, rows in recvs.items():
        out.index_copy_(0, held.own(p), rows)
    return out


def _rows_backward(state: EmbeddingState, held: _Held, dy: torch.Tensor, pre: float) -> torch.Tensor:
    ring = state.engine.ring
    rank, mine, theirs = ring.rank, held.mine[0], held.theirs[0]
    if state.padding_idx is not None:  # padding tokens give their rows no gradient
        dy = dy.masked_fill((held.ids_all[rank, :dy.shape[0]] == state.padding_idx).unsqueeze(1), 0)
    if pre != 1.0:
        dy = dy / pre
    sends = {p: dy.index_select(0, held.own(p)) for p in ring.peers if mine[p]}
    recvs = {p: dy.new_empty(theirs[p], dy.shape[1]) for p in ring.peers if theirs[p]}
    hop = _swap(state, sends, recvs, "embedding backward")
    grad = dy.new_zeros(state.rows, dy.shape[1])
    for k in range(ring.size):  # the ring's order, as the sum of a ring would add them
        s = ring.shard_held(k)
        if s == rank:
            grad.index_add_(0, held.local_ids(rank), dy.index_select(0, held.own(rank)))
            if hop is not None:
                hop.wait()
        elif s in recvs:
            grad.index_add_(0, held.local_ids(s), recvs[s])
    return grad


def _table_forward(state: EmbeddingState, weight: torch.Tensor, flat: torch.Tensor, compute_dtype: torch.dtype):
    engine = state.engine
    world, rank = engine.ring.size, engine.ring.rank
    table = weight.new_empty(world, state.chunk, weight.shape[1], dtype=compute_dtype)
    table[rank, :state.rows].copy_(weight)
    table[rank, state.rows:].zero_()
    _gather_into(state, table, "embedding forward", then=_prefetch_layers(state))
    full = table.view(world * state.chunk, -1)[:state.num_embeddings]
    return F.embedding(flat, full, state.padding_idx)


def _table_backward(state: EmbeddingState, flat: torch.Tensor, dy: torch.Tensor, reduce_dtype: torch.dtype,
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

    return _reduce(state, dense.shape[1:], reduce_dtype, dy.device, take, "embedding backward")[:state.rows]


def _prefetch_layers(state: EmbeddingState) -> Callable[[], None]:
    """Queued behind the embedding's last hop: the first fused layers' first hops (``prefetch_next``)."""
    return lambda: state.steps.schedule.start_first("forward")


# ---- the module ------------------------------------------------------------------------------------------

@torch.compiler.disable  # a hop cannot be traced: torch.compile breaks the graph here and runs it eagerly
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

    num_embeddings = module.weight.shape[0]
    if table is not None:
        assert tuple(table.shape) == tuple(module.weight.shape), "a tied table has one shape"
        module.weight = param = table
    else:
        param = shard_parameter(module, "weight", 0, steps.engine)
    module._cf_embedding = EmbeddingState(steps, module, num_embeddings, name)
    module.__class__ = RingEmbedding
    return param
