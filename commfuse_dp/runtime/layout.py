"""Where each member of a fused group sits in the flat per-rank ring buffer.

A fused group is one or more linears that read the same input (a lone linear; q/k/v; gate/up). Their weight
shards (and bias shards) travel the ring together in one flat buffer per rank:

    [ W_0 shard (chunk_0 x in) | b_0 shard (chunk_0) | W_1 shard (chunk_1 x in) | b_1 shard | ... ]

``chunk_m = ceil(out_m / N)`` rows: DTensor's ``Shard`` split (that of ``torch.chunk``), so rank j owns output rows
``[j * chunk_m, min((j + 1) * chunk_m, out_m))`` and the last ranks may own fewer rows or none. The buffer is
padded to ``chunk_m`` rows on every rank; padding rows are sent but never computed with. A member stored as
``(in, out)`` (HF ``Conv1D``) is transposed into this row layout when packed, so the ring code sees one layout.
The gradient buffers of the reduce-scatter ring use the same layout.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Member(NamedTuple):
    """One linear of a fused group: its shape, padded rows per rank and where it sits in the flat buffer."""

    out_features: int
    in_features: int
    chunk: int  # padded rows per rank
    transposed: bool  # weight stored (in, out) and sharded on dim 1 (HF Conv1D)
    has_bias: bool
    offset: int  # of the weight rows in the flat buffer; the bias follows them

    @property
    def weight_numel(self) -> int:
        return self.chunk * self.in_features

    @property
    def numel(self) -> int:
        return self.weight_numel + (self.chunk if self.has_bias else 0)

    def rows(self, shard: int) -> tuple[int, int]:
        """Output rows ``[lo, hi)`` owned by rank ``shard``."""
        lo = min(shard * self.chunk, self.out_features)
        return lo, min(lo + self.chunk, self.out_features)

    def weight(self, flat: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """This member's ``(rows, in)`` weight block inside a flat buffer (default: all padded rows)."""
        rows = self.chunk if rows is None else rows
        return flat[self.offset:self.offset + rows * self.in_features].view(rows, self.in_features)

    def bias(self, flat: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        start = self.offset + self.weight_numel
        return flat[start:start + (self.chunk if rows is None else rows)]


class MemberBlocks(NamedTuple):
    """One member's parts in every row of a 2-D buffer of flat rows (``(R, numel)``: a gathered weight, the
    gradient partials), as views made once: row ``i``'s weight is ``weight[i]``, its transpose ``weight_t[i]``."""

    chunk: int
    weight: torch.Tensor  # (R, chunk, in)
    weight_t: torch.Tensor  # (R, in, chunk)
    bias: torch.Tensor | None  # (R, chunk)


class GroupLayout(NamedTuple):
    """The flat per-rank buffer of a fused group: its members in order, its size, the ranks and the input width.
    ``spans[s]``: each member's output rows ``[lo, hi)`` owned by rank ``s`` (``Member.rows``, looked up once)."""

    members: tuple[Member, ...]
    numel: int
    world: int
    in_features: int
    spans: tuple[tuple[tuple[int, int], ...], ...] = ()

    @staticmethod
    def build(shapes: list[tuple[int, int, bool, bool]], world: int) -> GroupLayout:
        """``shapes``: ``(out_features, in_features, transposed, has_bias)`` per member."""
        members, offset = [], 0
        in_features = shapes[0][1]
        for out_features, in_f, transposed, has_bias in shapes:
            if in_f != in_features:
                raise ValueError(f"a fused group needs one input width, got {in_f} and {in_features}")
            m = Member(out_features, in_f, -(-out_features // world), transposed, has_bias, offset)
            members.append(m)
            offset += m.numel
        spans = tuple(tuple(m.rows(s) for m in members) for s in range(world))
        return GroupLayout(tuple(members), offset, world, in_features, spans)

    def blocks(self, buf: torch.Tensor) -> tuple[MemberBlocks, ...]:
        """Each member's ``MemberBlocks`` in ``buf``: ``(R, numel)``, or one flat row (then R = 1)."""
        rows = buf if buf.dim() == 2 else buf.view(1, -1)
        out = []
        for m in self.members:
            w = rows[:, m.offset:m.offset + m.weight_numel].view(-1, m.chunk, m.in_features)
            bias = rows[:, m.offset + m.weight_numel:m.offset + m.numel] if m.has_bias else None
            out.append(MemberBlocks(m.chunk, w, w.transpose(1, 2), bias))
        return tuple(out)

    def pack(self, params: list[tuple[torch.Tensor, torch.Tensor | None]], dtype: torch.dtype,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's shards (``(weight_local, bias_local)`` per member) cast to ``dtype`` in one flat buffer."""
        flat = out if out is not None else torch.empty(self.numel, dtype=dtype, device=params[0][0].device)
        for m, (weight, bias) in zip(self.members, params):
            rows = weight.shape[1] if m.transposed else weight.shape[0]
            m.weight(flat, rows).copy_(weight.t() if m.transposed else weight)
            if bias is not None:
                m.bias(flat, rows).copy_(bias)
        return flat

    def unpack_grad(self, flat: torch.Tensor, m: Member, rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """The gradient of member ``m``'s local shards (own ``rows``) out of a flat gradient buffer, in ``dtype``
        and in the parameters' own layout: views of ``flat`` where nothing changes (``flat`` must be the gradients'
        own buffer, which nothing writes later), else copies."""
        w = m.weight(flat, rows)
        w = w.t().contiguous() if m.transposed else w
        grads = (w.to(dtype),)
        if m.has_bias:
            grads += (m.bias(flat, rows).to(dtype),)
        return grads


def conv1d_class() -> type | None:
    """Hugging Face's ``Conv1D`` (GPT-2's linears, weight ``(in, out)``), or None without transformers."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return None
    return Conv1D
