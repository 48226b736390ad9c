"""``FusedGroupState``: what the runtime keeps of one fused group of linears (its layout, its parameters' shards,
the gradient partials held while gradient sync is off)."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..wire import RowFormat, layout_segments
from .accumulate import accumulate_grad
from .layout import GroupLayout
from .step import StepState


class FusedGroupState:
    """What the fused Function needs about one group: engine, step state, layout, its ring-op identity (``op``),
    where each member's params sit in the Function's inputs, and the gradient partials kept while gradient sync
    is off."""

    def __init__(self, steps: StepState, layout: GroupLayout, modules: list[nn.Module], name: str,
                 in_place: bool = True) -> None:
        self.engine, self.steps, self.layout, self.modules = steps.engine, steps, layout, modules
        self.name = name
        self.owner = steps.register(name)
        self.tied = False  # its weight is a table shared with a ring embedding: gradients arrive from both
        self.unit: int | None = None  # its FSDP2 unit (a decoder layer): the groups whose hops are bundled
        steps.states.append(self)
        self._index: list[tuple[int, ...]] = []
        i = 0
        for m in modules:
            has_bias = m._parameters.get("bias") is not None
            self._index.append((i, i + 1) if has_bias else (i,))
            i += 2 if has_bias else 1
        self._unsynced: torch.Tensor | None = None
        self._own: torch.Tensor | None = None  # this rank's shards packed, the params' local tensors views of it
        self._own_ptrs: tuple[int, ...] = ()  # where each local tensor sits in ``_own``
        # whether ``_own`` may be used (decided at the first call); never for a member's own ring (cross-attention),
        # whose parameters are views of its group's buffer
        self._packs_in_place: bool | None = None if in_place else False
        self._wire: dict[tuple, RowFormat] = {}  # narrow formats of its rows, by (what, dtype)
        self.residual: torch.Tensor | None = None  # error feedback: what encoding lost of each contribution

    # -- narrow formats on the wire ([Note: narrow formats]) ----------------------------------------------------

    def wire_format(self, what: str, dtype: torch.dtype) -> RowFormat | None:
        """The format its weight rows (``what="gather"``) or gradient contributions (``"reduce"``) of ``dtype``
        travel in, or None where they travel as they are (the exact format, one rank, bf16 rows in bf16)."""
        config = self.engine.config
        fmt = config.gather_format if what == "gather" else config.reduce_format
        if fmt == "exact" or self.engine.ring.size == 1 or (what == "gather" and fmt == "bf16"
                                                             and dtype == torch.bfloat16):
            return None  # (bf16 gradients of bf16 still go to their owner, to be summed in float32)
        made = self._wire.get((what, dtype))
        if made is None:
            made = self._wire[(what, dtype)] = RowFormat(fmt, dtype, self.layout.numel,
                                                         layout_segments(self.layout), config.format_block)
        return made

    def feedback(self, device: torch.device) -> torch.Tensor | None:
        """With ``error_feedback``: what encoding lost of this rank's contribution to each shard, kept from one
        synced backward to the next (in ``feedback_dtype``, a row per shard)."""
        if not self.engine.config.error_feedback:
            return None
        if self.residual is None:  # (named by the group's place in the model: the same on every rank and run)
            self.residual = self.engine.residuals.get(f"fused:{self.steps.states.index(self)}",
                                                      (self.engine.ring.size, self.layout.numel), device)
        return self.residual

    def encode_own(self, params: list[torch.Tensor], fmt: RowFormat, out: torch.Tensor) -> None:
        """This rank's row encoded in ``fmt`` into ``out`` from the members' local shards (the masters, in their
        own dtype; padding rows zero). Encoded afresh at every ring: a parameter's version counter does not say
        whether it changed (fused optimizers and DTensor's in-place ops leave it as it was)."""
        with torch.no_grad():
            row = torch.zeros(self.layout.numel, dtype=params[0].dtype, device=params[0].device)
            self.layout.pack(self.pairs(params), row.dtype, out=row)
            fmt.encode(row, out)

    def params(self) -> list[nn.Parameter]:
        # ``_parameters`` itself: ``m.weight`` is the gathered read for code outside the fused forward (reads.py)
        return [p for m in self.modules for p in (m._parameters["weight"], m._parameters.get("bias")) if p is not None]

    def local_params(self) -> list[torch.Tensor]:
        with torch.no_grad():
            return [p.to_local() for p in self.params()]

    def accumulate_grads(self, flat: torch.Tensor, grad_dtypes: tuple[torch.dtype, ...],
                         train: tuple[bool, ...]) -> None:
        """Add this rank's reduced gradient shards (a flat buffer in the group layout) into the params' grads (HSDP:
        they start crossing the copies now and reach ``.grad`` at the end of the backward, ``replicas.py``)."""
        landed = self.landed_grads(flat, grad_dtypes, train)
        if self.engine.replicas is not None:  # HSDP: they cross the copies now, beside the rest of the backward
            if landed:
                self.engine.replicas.send(landed)
            return
        for param, g in landed:
            accumulate_grad(param, g)

    def landed_grads(self, flat: torch.Tensor, grad_dtypes: tuple[torch.dtype, ...],
                     train: tuple[bool, ...]) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """Each trainable parameter's gradient shard out of this rank's reduced flat buffer (in the group
        layout)."""
        params = self.params()
        shards = self.grad_shards(flat, [p._local_tensor for p in params], grad_dtypes, train)
        return [(params[i], g) for i, g in shards if params[i].requires_grad]

    def grad_shards(self, flat: torch.Tensor, local: list[torch.Tensor], dtypes,
                    train) -> list[tuple[int, torch.Tensor]]:
        """``(index, gradient)`` of each parameter of a member with a gradient (``train``), out of this rank's
        reduced flat buffer: shaped as its local shard ``local[index]``, in ``dtypes[index]``."""
        shards = []
        for j, m in enumerate(self.layout.members):
            if not train[j]:
                continue
            idx = self.param_index(j)
            rows = local[idx[0]].shape[1 if m.transposed else 0]
            shards += zip(idx, self.layout.unpack_grad(flat, m, rows, dtypes[idx[0]]))
        return shards

    # -- the local shards as views of one packed buffer ---------------------------------------------------------

    def own_packed(self, params: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor | None:
        """This rank's shards packed in the ring layout, as one flat buffer, when ``params`` (the members' local
        shards, in ``params()``'s order) are the views of it that ``adopt_packed`` made and ``dtype`` is theirs:
        a ring then sends and computes with it as it is, without packing a copy. None otherwise (a parameter
        replaced since: loaded with ``assign``, ``.data =``, materialised from meta; or another compute dtype).
        The buffer is kept alive here, so a tensor at one of its addresses is a view of it."""
        own = self._own
        if own is None or own.dtype != dtype:
            return None
        for p, ptr in zip(params, self._own_ptrs):
            if p.data_ptr() != ptr or not p.is_contiguous():
                return None
        return own

    def adopt_packed(self) -> None:
        """Before a fused forward: make the members' local shards views of one flat buffer in the ring layout,
        as FSDP2's sharded parameters are views of their padded storage (it too swaps ``_local_tensor``), so that
        the rings send this rank's shards without packing them into their buffers every call (a copy of every
        weight in each forward and backward). Done once, and again after a parameter was replaced. Only where the
        layout is the parameters' own (no ``Conv1D``), for the elastic schedule with ``piece_shards=1`` (its
        gathered buffer is never read as a whole with the own row in it), and on CPU (on CUDA the copy is a small
        kernel, and a ring reading the parameter's storage on the communication stream has not run on a
        device)."""
        if self._packs_in_place is None:
            self._packs_in_place = self._may_pack_in_place()
        if not self._packs_in_place:
            return
        params = self.params()
        locals_ = [p._local_tensor for p in params]
        if self.own_packed(locals_, locals_[0].dtype) is not None:
            return
        if len(locals_) == 1 and locals_[0].is_contiguous() and locals_[0].numel() == self.layout.numel:
            self._own, self._own_ptrs = locals_[0].view(-1), (locals_[0].data_ptr(),)  # the layout is its own
            return
        with torch.no_grad():
            own = self.layout.pack(self.pairs(locals_), locals_[0].dtype)
            ptrs = []
            for j, m in enumerate(self.layout.members):
                idx = self.param_index(j)
                rows = locals_[idx[0]].shape[0]
                views = (m.weight(own, rows), m.bias(own, rows)) if len(idx) > 1 else (m.weight(own, rows),)
                for i, view in zip(idx, views):
                    params[i]._local_tensor = view
                    ptrs.append(view.data_ptr())
        self._own, self._own_ptrs = own, tuple(ptrs)

    def _may_pack_in_place(self) -> bool:
        engine, params, schedule = self.engine, self.params(), self.steps.schedule
        return (engine.ring.size > 1 and schedule.packs_params
                and engine.config.piece_shards == 1
                and not any(m.transposed for m in self.layout.members)
                and all(isinstance(p, DTensor) and p.device.type == "cpu" and p.dtype == params[0].dtype
                        for p in params))

    def param_index(self, member: int) -> tuple[int, ...]:
        return self._index[member]

    def pairs(self, params) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        return [(params[ix[0]], params[ix[1]] if len(ix) > 1 else None) for ix in self._index]

    def keep_unsynced(self, shard: int, part: torch.Tensor, world: int) -> None:
        if self._unsynced is None:
            self._unsynced = part.new_zeros(world, part.numel())
        self._unsynced[shard].add_(part)

    def take_unsynced(self) -> torch.Tensor | None:
        pending, self._unsynced = self._unsynced, None
        return pending
