"""The tensor-parallel modules a Hugging Face decoder's own are replaced with (``parallelize.py``): attention with
its heads split, the MLP, the vocabulary-parallel embedding and lm_head. Each keeps the original's parameter
names (``q_proj.weight`` ... hold this rank's rows or columns), so that optimizers, state dicts and PEFT see the
model they expect. Between them the hidden states are this rank's rows of the sequence ([Note: TPSP on rings]
in ``rings.py``); the norms in between run on those rows unchanged.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.nn as nn

from .rings import ColumnParallelFn, RowParallelFn, TPState, VocabEmbeddingFn, seq_split


class TPAttention(nn.Module):
    """A decoder's self-attention with this rank's heads: q, k and v column-parallel in one gather, rotary and
    the attention function (``config._attn_implementation``) on the whole sequence of these heads, o
    row-parallel. In: this rank's rows ``(B, |R_r|, H)``; out: the same rows and the attention weights of this
    rank's heads (or None)."""

    COPIED = ("config", "layer_idx", "head_dim", "num_key_value_groups", "scaling", "attention_dropout",
              "is_causal", "layer_type")

    def __init__(self, attn: nn.Module, tp, name: str, extra: dict) -> None:
        super().__init__()
        for attr in self.COPIED:
            if hasattr(attn, attr):
                setattr(self, attr, getattr(attn, attr))
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj
        self.tp, self.extra = tp, extra  # extra: the keywords the family's attention passes (sliding_window)
        self.qkv_ring, self.o_ring = TPState(tp.steps, f"{name}.qkv (tp)", tp.fused), TPState(tp.steps, f"{name}.o_proj (tp)", tp.fused)
        family = sys.modules[type(attn).__module__]
        self._rotary, self._eager = family.apply_rotary_pos_emb, family.eager_attention_forward

    def forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None,
                past_key_values=None, **kwargs):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        _called_as_is(self, self.q_proj, self.k_proj, self.v_proj, self.o_proj)
        batch, seq = hidden_states.shape[0], self.tp.seq
        q, k, v = ColumnParallelFn.apply(hidden_states, self.qkv_ring, seq,
                                         *_wb(self.q_proj), *_wb(self.k_proj), *_wb(self.v_proj))
        q, k, v = (t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        cos, sin = position_embeddings
        q, k = self._rotary(q, k, cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, self._eager)
        out, weights = attention(self, q, k, v, attention_mask,
                                 dropout=0.0 if not self.training else self.attention_dropout,
                                 scaling=self.scaling, **self.extra, **kwargs)
        out = out.reshape(batch, seq, -1).contiguous()
        return RowParallelFn.apply(out, self.o_ring, self.o_proj.weight, self.o_proj.bias), weights


class TPMLP(nn.Module):
    """A gated MLP (``down(act(gate(x)) * up(x))``): gate and up column-parallel in one gather, down
    row-parallel."""

    def __init__(self, mlp: nn.Module, tp, name: str) -> None:
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj, self.act_fn = mlp.gate_proj, mlp.up_proj, mlp.down_proj, mlp.act_fn
        self.tp = tp
        self.gate_up_ring = TPState(tp.steps, f"{name}.gate_up (tp)", tp.fused)
        self.down_ring = TPState(tp.steps, f"{name}.down_proj (tp)", tp.fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _called_as_is(self, self.gate_proj, self.up_proj, self.down_proj)
        gate, up = ColumnParallelFn.apply(x, self.gate_up_ring, self.tp.seq, *_wb(self.gate_proj), *_wb(self.up_proj))
        return RowParallelFn.apply(self.act_fn(gate) * up, self.down_ring, self.down_proj.weight,
                                   self.down_proj.bias)


class TPEmbedding(nn.Module):
    """The token embedding with this rank's rows of the table (``weight``: rows ``tp.vocab_start`` on), looked up
    beside the reduce-scatter that leaves each rank its rows of the sequence. Returns the whole ``(B, S, H)``
    frame, this rank's rows filled and the others zero, so that the model's masks and positions see the
    sequence's length; the first decoder layer takes this rank's rows from it (``parallelize.py``). A scale the
    original multiplies by (Gemma's ``embed_scale``) is kept."""

    def __init__(self, embedding: nn.Embedding, tp, name: str) -> None:
        super().__init__()
        self.weight = embedding.weight
        self.padding_idx = embedding.padding_idx
        self.embedding_dim = embedding.embedding_dim
        self.num_embeddings = tp.vocab_size
        if hasattr(embedding, "embed_scale"):
            self.embed_scale = embedding.embed_scale
            if hasattr(embedding, "scalar_embed_scale"):  # (its value, for a model taken off the meta device)
                self.scalar_embed_scale = embedding.scalar_embed_scale
        self.tp = tp
        self.ring = TPState(tp.steps, f"{name} (tp)", tp.fused)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.tp.check_same_batch(input_ids, "token ids")
        self.tp.embedded = True
        mine = VocabEmbeddingFn.apply(input_ids, self.ring, self.weight, self.tp.vocab_start, self.padding_idx)
        if getattr(self, "embed_scale", None) is not None:
            mine = mine * self.embed_scale.to(self.weight.dtype)
        start, rows = self.tp.rows_of(input_ids.shape[1])
        return nn.functional.pad(mine, (0, 0, start, input_ids.shape[1] - start - rows))


class TPLMHead(nn.Module):
    """The lm_head with this rank's rows of the vocabulary: column-parallel over the sequence's rows, giving this
    rank's ``(B, S, V_r)`` logits (the loss is ``loss.causal_lm_loss``)."""

    def __init__(self, head: nn.Linear, tp, name: str) -> None:
        super().__init__()
        self.weight, self.bias = head.weight, head.bias
        self.in_features, self.out_features = head.in_features, tp.vocab_size
        self.tp = tp
        self.ring = TPState(tp.steps, f"{name} (tp)", tp.fused)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        self.tp.head_ran = True
        keep = self.tp.keep
        if keep:
            return self._kept_logits(hidden_states, keep)
        rows = self.tp.rows_of(self.tp.seq)[1]
        if hidden_states.shape[1] != rows:
            raise ValueError(f"the tensor-parallel lm_head got {hidden_states.shape[1]} rows of the sequence where "
                             f"this rank holds {rows}; call the model with the whole sequence")
        return ColumnParallelFn.apply(hidden_states, self.ring, self.tp.seq, self.weight, self.bias)[0]

    def _kept_logits(self, mine: torch.Tensor, keep: int) -> torch.Tensor:
        """``logits_to_keep=k`` (what ``generate()`` asks for), without grad: the whole vocabulary's logits of the
        sequence's last ``k`` positions on every rank. The model's forward handed this rank the last ``k`` of its
        own rows (``mine``); the group gathers them, keeps the positions from ``seq - k`` on, projects them on
        this rank's vocabulary rows and gathers the vocabulary: plain collectives, ``(B, k, H)`` and
        ``(B, k, V)`` a rank."""
        if torch.is_grad_enabled():
            raise ValueError("the tensor-parallel lm_head: logits_to_keep is for generation, without grad (under "
                             "torch.no_grad(), as generate() runs); training computes the loss over every position")
        tp, seq = self.tp, self.tp.seq
        counts, offsets = seq_split(seq, tp.size)
        kept = [min(keep, c) for c in counts]
        if mine.shape[1] != kept[tp.rank]:
            raise ValueError(f"the tensor-parallel lm_head got {mine.shape[1]} rows for logits_to_keep={keep}; "
                             f"expected the last {kept[tp.rank]} of this rank's {counts[tp.rank]}")
        padded = mine.new_zeros(mine.shape[0], keep, mine.shape[2])
        padded[:, :kept[tp.rank]] = mine
        rows = [torch.empty_like(padded) for _ in range(tp.size)]
        dist.all_gather(rows, padded.contiguous(), group=tp.group)
        first = max(seq - keep, 0)
        pieces = []
        for r in range(tp.size):  # rank r's kept rows are positions offsets[r] + counts[r] - kept[r] onwards
            start = offsets[r] + counts[r] - kept[r]
            lo = max(first - start, 0)
            if lo < kept[r]:
                pieces.append(rows[r][:, lo:kept[r]])
        hidden = torch.cat(pieces, dim=1)
        local = nn.functional.linear(hidden, self.weight, self.bias)
        vocab = [local.new_empty(local.shape[0], local.shape[1], c) for c in seq_split(tp.vocab_size, tp.size)[0]]
        if len({v.shape for v in vocab}) == 1:
            dist.all_gather(vocab, local.contiguous(), group=tp.group)
        else:  # (a vocabulary that does not divide: gather padded to the widest)
            width = max(v.shape[2] for v in vocab)
            wide = local.new_zeros(local.shape[0], local.shape[1], width)
            wide[..., :local.shape[2]] = local
            gathered = [torch.empty_like(wide) for _ in vocab]
            dist.all_gather(gathered, wide, group=tp.group)
            vocab = [g[..., :v.shape[2]] for g, v in zip(gathered, vocab)]
        return torch.cat(vocab, dim=2)


class TPNorm(nn.Module):
    """A norm on this rank's rows of the sequence, its weight whole: the original norm's own forward, run with
    its weight passed through ``SummedGrad`` (``torch.func.functional_call``), so that the weight's gradient is
    summed over the group in the backward, where autograd makes it (exact under accumulation, whoever then holds
    the parameter). The original's parameters and buffers are this module's, under the same names."""

    def __init__(self, norm: nn.Module, tp) -> None:
        super().__init__()
        self.weight = norm.weight
        for name, buffer in norm.named_buffers(recurse=False):
            self.register_buffer(name, buffer, persistent=name not in norm._non_persistent_buffers_set)
        self.tp = tp
        self._norm = (norm,)  # (not a child: its weight is this module's)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        (norm,) = self._norm
        return torch.func.functional_call(norm, {"weight": SummedGrad.apply(self.weight, self.tp.group)}, (x,))

    def extra_repr(self) -> str:
        return f"{type(self._norm[0]).__name__}: {self._norm[0].extra_repr()}"


class SummedGrad(torch.autograd.Function):
    """The identity, whose gradient is summed over ``group`` (a whole weight used on each rank's rows)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, group):
        ctx.group = group
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _called_as_is(layer: nn.Module, *linears: nn.Module) -> None:
    """Refuse a projection that is no longer a plain ``nn.Linear`` or that has hooks: the TP layer reads its
    weight and bias and never calls it, so an adapter (PEFT's LoRA), a quantised linear or a hook would be
    skipped without a word."""
    for linear in linears:
        if type(linear) is not nn.Linear or linear._forward_hooks or linear._forward_pre_hooks:
            what = "has forward hooks" if type(linear) is nn.Linear else f"is a {type(linear).__module__}." \
                                                                         f"{type(linear).__name__}"
            raise RuntimeError(f"tensor_parallel: a projection of {type(layer).__name__} {what}; its TP rings read "
                               f"the plain weight and bias and do not call the module, so that would be skipped. "
                               f"Adapters (PEFT), quantised linears and hooks on the projections are not supported "
                               f"under tensor parallelism")


def _wb(linear: nn.Linear) -> tuple:
    return linear.weight, linear.bias
