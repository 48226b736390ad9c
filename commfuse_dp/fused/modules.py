"""Fused modules: an ``nn.Linear`` (or HF ``Conv1D``) turned, in place, into a ring-fused sharded layer.

``convert_linear`` swaps the module's class for a subclass (``RingLinear``, ``RingConv1D``) whose ``forward``
runs the group's fused ring, and replaces its weight and bias by DTensor shards (``Shard(0)``; ``Shard(1)`` for the
``(in, out)`` weight of ``Conv1D``) on the data-parallel mesh. Attribute names, ``isinstance`` checks, parameter
shapes and state-dict keys stay those of the original module.

A ``FusedGroup`` holds linears that read the same input (q/k/v, gate/up). The first member called runs the ring
for all of them and keeps the others' outputs for their own calls with the *same* input tensor; a member called
with another input (cross-attention) runs a ring of its own.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..engine import Engine
from .layout import GroupLayout
from .linear import Call, FusedRingLinearFn, accumulate_grad
from .reads import guarded_class
from .sliced import SlicedLinearFn, SlicingScheduler
from .step import StepState


class FusedGroupState:
    """What the fused Function needs about one group: engine, step state, layout, its ring-op identity (``op``),
    where each member's params sit in the Function's inputs, and the gradient partials kept while gradient sync
    is off."""

    def __init__(self, steps: StepState, layout: GroupLayout, modules: list[nn.Module], name: str,
                 in_place: bool = True) -> None:
        self.engine, self.steps, self.layout, self.modules = steps.engine, steps, layout, modules
        self.name = name
        self.op = steps.register(name)
        self.tied = False  # its weight is a table shared with a ring embedding: gradients arrive from both
        self.unit: int | None = None  # its FSDP2 unit (a decoder layer): the groups whose ring steps are bundled
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
        landed = []
        for j, m in enumerate(self.layout.members):
            if not train[j]:
                continue
            idx = self.param_index(j)
            rows = params[idx[0]].to_local().shape[1 if m.transposed else 0]
            for i, g in zip(idx, self.layout.unpack_grad(flat, m, rows, grad_dtypes[idx[0]])):
                if params[i].requires_grad:
                    landed.append((params[i], g))
        return landed

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
        return (engine.ring.size > 1 and not isinstance(schedule, SlicingScheduler) and schedule.elastic
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


class FusedGroup:
    def __init__(self, steps: StepState, modules: list[nn.Module], names: list[str]) -> None:
        self.steps = steps
        self.modules, self.names = modules, names
        self.state = self._state(modules, "+".join(names))
        self._solo: dict[int, FusedGroupState] = {}
        self._key: torch.Tensor | None = None
        self._pending: dict[int, torch.Tensor] = {}
        steps.groups.append(self)

    def _state(self, modules: list[nn.Module], name: str, in_place: bool = True) -> FusedGroupState:
        weights = [m._parameters["weight"] for m in modules]
        shapes = [(w.shape[1] if m._cf_transposed else w.shape[0], w.shape[0] if m._cf_transposed else w.shape[1],
                   m._cf_transposed, m._parameters.get("bias") is not None) for m, w in zip(modules, weights)]
        return FusedGroupState(self.steps, GroupLayout.build(shapes, self.steps.engine.ring.size), modules, name,
                               in_place)

    def __call__(self, index: int, x: torch.Tensor) -> torch.Tensor:
        if len(self.modules) == 1:
            return _apply(self.state, x)[0]
        if x is self._key and index in self._pending:
            out = self._pending.pop(index)
            if not self._pending:
                self._key = None
            return out
        if self._pending and index != 0:
            # Another input than the group's (cross-attention): this member runs a ring of its own. The first
            # member (index 0) always starts a new round, dropping outputs nobody asked for.
            if index not in self._solo:
                self._solo[index] = self._state([self.modules[index]], f"{self.names[index]} (own input)",
                                                in_place=False)
            return _apply(self._solo[index], x)[0]
        outs = _apply(self.state, x)
        self._key = x
        self._pending = {j: out for j, out in enumerate(outs) if j != index}
        return outs[index]

    def reset(self) -> None:
        self._key, self._pending = None, {}


def _apply(state: FusedGroupState, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    state.adopt_packed()
    params = [p.to_local() for p in state.params()]  # autograd-aware: grads flow back into the DTensor params
    engine, schedule = state.engine, state.steps.schedule
    if engine.stats.enabled:
        engine.stats.mark()
    fn = SlicedLinearFn if isinstance(schedule, SlicingScheduler) else FusedRingLinearFn
    grad_nodes = tuple(p.grad_fn.next_functions[0][0] if p.grad_fn is not None else None for p in params)
    device = x.device.type
    if torch.is_autocast_enabled(device):
        # As nn.Linear under autocast: compute in autocast's dtype and return it; the gradients travel and sum in
        # the parameters' own dtype unless reduce_dtype says otherwise (AMP's fp32 master gradients).
        cdt = torch.get_autocast_dtype(device)
        call = Call(cdt, engine.config.reduce_dtype or params[0].dtype, grad_nodes)
        schedule.dtype_hint = cdt
        with torch.autocast(device, enabled=False):
            return fn.apply(x, state, call, *params)
    cdt = engine.compute_dtype(params[0].dtype)
    schedule.dtype_hint = None
    return fn.apply(x, state, Call(cdt, engine.reduce_dtype(cdt), grad_nodes), *params)


@torch.compiler.disable  # a ring step cannot be traced: torch.compile breaks the graph here and runs it eagerly
def _ring_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return self._cf_group(self._cf_index, x)


def _refuse_deepcopy(self: nn.Module, memo) -> None:
    self._cf_group.steps.engine.__deepcopy__(memo)  # raises, saying why and what to do instead


@functools.cache
def ring_class(cls: type) -> type:
    """``Ring<cls>``: ``cls`` with the fused forward (one class per original class, like FSDP2's)."""
    return guarded_class(f"Ring{cls.__name__}", cls, {"forward": _ring_forward, "_cf_fused": True,
                                                      "__deepcopy__": _refuse_deepcopy})


def shard_parameter(module: nn.Module, name: str, dim: int, engine: Engine) -> nn.Parameter:
    """Replace ``module.<name>`` by this rank's ``torch.chunk`` of it along ``dim``, as a ``Shard(dim)`` DTensor
    parameter on the engine's mesh (an empty shard for ranks past the last chunk)."""
    mesh, world, rank = engine.mesh, engine.ring.size, engine.ring.rank
    full = getattr(module, name)
    chunks = torch.chunk(full.detach(), world, dim=dim)
    local = chunks[rank].clone() if rank < len(chunks) else full.detach().narrow(dim, 0, 0).clone()
    dtensor = DTensor.from_local(local.contiguous(), mesh, engine.placements(dim), run_check=False,
                                 shape=full.shape, stride=full.stride())
    param = nn.Parameter(dtensor, requires_grad=full.requires_grad)
    setattr(module, name, param)
    return param


def convert_linear(module: nn.Module, engine: Engine, transposed: bool) -> list[nn.Parameter]:
    """Shard ``module``'s weight and bias onto the engine's mesh and swap its class; returns the new params."""
    new_params = [shard_parameter(module, name, dim, engine)
                  for name, dim in (("weight", 1 if transposed else 0), ("bias", 0))
                  if getattr(module, name, None) is not None]
    module._cf_transposed = transposed
    module.__class__ = ring_class(type(module))
    return new_params


def attach_group(steps: StepState, modules: list[nn.Module], names: list[str]) -> FusedGroup:
    group = FusedGroup(steps, modules, names)
    for i, m in enumerate(modules):
        m._cf_group, m._cf_index = group, i
    return group
