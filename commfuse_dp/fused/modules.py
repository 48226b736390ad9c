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

from ..runtime.engine import Engine
from ..runtime.group import FusedGroupState
from ..runtime.layout import GroupLayout
from ..runtime.step import StepState
from .linear import Call, FusedRingLinearFn
from .reads import guarded_class


class FusedGroup:
    """Linears that read the same input, computed by one ``FusedRingLinearFn`` under the step state's schedule
    (module docstring)."""

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
    grad_nodes = tuple(p.grad_fn.next_functions[0][0] if p.grad_fn is not None else None for p in params)
    device = x.device.type
    if torch.is_autocast_enabled(device):
        # As nn.Linear under autocast: compute in autocast's dtype and return it; the gradients travel and sum in
        # the parameters' own dtype unless reduce_dtype says otherwise (AMP's fp32 master gradients).
        compute_dtype = torch.get_autocast_dtype(device)
        call = Call(compute_dtype, engine.config.reduce_dtype or params[0].dtype, grad_nodes)
        schedule.dtype_hint = compute_dtype
        with torch.autocast(device, enabled=False):
            return FusedRingLinearFn.apply(x, state, call, *params)
    compute_dtype = engine.compute_dtype(params[0].dtype)
    schedule.dtype_hint = None
    call = Call(compute_dtype, engine.reduce_dtype(compute_dtype), grad_nodes)
    return FusedRingLinearFn.apply(x, state, call, *params)


@torch.compiler.disable  # a hop cannot be traced: torch.compile breaks the graph here and runs it eagerly
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
