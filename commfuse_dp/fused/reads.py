"""Reading a fused parameter from outside its fused forward: ``model.lm_head.weight`` in code we did not write.

A fused linear's weight and bias and a ring embedding's table are ``Shard(0)`` DTensors at all times (``Shard(1)``
for a ``Conv1D`` weight). Libraries read them directly instead of calling the module: TRL's fused LM head
(``add_fused_lm_head``: ``lm_head.weight``, ``.full_tensor()`` when it is a DTensor), Liger-Kernel's fused linear
cross-entropy, a custom chunked loss ``F.linear(h, model.lm_head.weight)``. Stock FSDP2 gives such code the full
weight as a plain tensor between the root's pre-forward and its backward (the root is not resharded after
forward), and reduce-scatters whatever gradient reaches it. A DTensor cannot do that: ``full_tensor()``'s
backward (Replicate -> Shard) keeps the local rows of *this* rank's gradient and sums nothing, so the other
ranks' contributions were silently lost.

So a fused module answers ``module.weight`` (``module.bias``) with a ``ParamRead``:

- **inside a step** (from the root's forward pre-hook until the end of the backward that follows a grad-enabled
  forward, or until the end of a no-grad forward): the full weight, a plain tensor in the compute dtype
  (``param_dtype`` when set), gathered over the ring on first read and kept for the rest of the step (every
  rank runs the same forward code, so every rank reads at the same point: the lockstep contract holds). Its
  gradient is summed over the ranks by a reduce-scatter ring into this rank's shard (divided as
  ``grad_divide`` says, like every gradient), then reaches ``.grad`` through autograd. The sum runs even under
  ``no_sync()`` (as the ring embedding's does): summing per micro-batch or once equals the same total.
- **outside a step** (building an optimizer, ``state_dict()``, ``describe``, ``tie_weights()``): the DTensor
  parameter itself, as ``model.parameters()`` gives it.

The fused forward itself reads ``_parameters`` and never comes here. ``ParamRead`` keeps its own ring-op owner
(``StepState.register``) so that its hops carry their own tags.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..runtime import exchange
from ..runtime.replicas import autograd_grad, grad_node
from ..runtime.step import StepState
from ..timeline import labelled

logger = logging.getLogger("commfuse_dp")


class ParamRead:
    """A fused parameter's full value for reads from outside its fused forward (one per parameter)."""

    def __init__(self, steps: StepState, param: nn.Parameter, dim: int, name: str) -> None:
        self.engine, self.steps, self.param, self.dim, self.name = steps.engine, steps, param, dim, name
        self.owner = steps.register(f"{name} (read)")
        self.node = None  # the parameter's AccumulateGrad node at the last gathered read (HSDP: replicas.py)
        self._logged = False

    def read(self) -> torch.Tensor:
        steps = self.steps
        if not steps.reads_gathered():
            return self.param
        full = steps.read_cache.get(id(self))
        if full is None:
            if not self._logged:
                self._logged = True
                logger.info("commfuse_dp: %s was read outside its fused forward: gathered in full for the step (as "
                            "FSDP2 unshards its root), its gradient summed over the ranks", self.name)
            with labelled("commfuse::param_read"):
                local = self.param.to_local()
                if self.engine.replicas is not None:  # HSDP: where its gradient goes (replicas.py)
                    self.node = grad_node(local)
                full = GatheredRead.apply(local, self)
            steps.read_cache[id(self)] = full
        return full


class GatheredRead(torch.autograd.Function):
    """``full = GatheredRead.apply(local_shard, read)``: forward all-gathers the shards (ring), backward
    reduce-scatters (sums) the full gradient into this rank's shard."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, read: ParamRead) -> torch.Tensor:
        engine = read.engine
        ctx.read, ctx.dtype = read, local.dtype
        compute_dtype = engine.compute_dtype(local.dtype)
        rows = local.movedim(read.dim, 0)
        world, rank = engine.ring.size, engine.ring.rank
        size = read.param.shape[read.dim]
        chunk = -(-size // world)  # torch.chunk's rows per shard
        slots = rows.new_empty(world, chunk, *rows.shape[1:], dtype=compute_dtype)
        slots[rank, :rows.shape[0]].copy_(rows)
        slots[rank, rows.shape[0]:].zero_()
        if world > 1:
            exchange.gather_into(read, slots, "weight read")
        full = slots.view(world * chunk, *rows.shape[1:])[:size].movedim(0, read.dim)
        return full.contiguous()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        read = ctx.read
        engine = read.engine
        read.steps.backward_begins()  # the end of this backward drops the step's gathered reads
        world, rank = engine.ring.size, engine.ring.rank
        size = read.param.shape[read.dim]
        chunk = -(-size // world)
        reduce_dtype = engine.reduce_dtype(engine.compute_dtype(ctx.dtype))
        pre, post = engine.divide_factors()
        rows = grad.movedim(read.dim, 0)
        dense = rows.new_zeros(world * chunk, *rows.shape[1:], dtype=reduce_dtype)
        dense[:size].copy_(rows)
        if pre != 1.0:
            dense.div_(pre)
        dense = dense.view(world, chunk, *rows.shape[1:])
        with labelled("commfuse::param_read_grad"):
            if world > 1:
                def take(t: int, part: torch.Tensor) -> None:
                    part.copy_(dense[t])

                mine = exchange.reduce(read, dense.shape[1:], reduce_dtype, grad.device, take, "weight read grad")
            else:
                mine = dense[0]
        local_rows = max(0, min(chunk, size - rank * chunk))
        mine = mine[:local_rows]
        if post != 1.0:
            mine = mine / post
        mine = mine.movedim(0, read.dim).to(ctx.dtype).contiguous()
        return autograd_grad(engine, read.param, read.node, mine, f"the gradient of {read.name}"), None


def attach_reads(steps: StepState, module: nn.Module, name: str, dims: dict[str, int]) -> None:
    """Give ``module`` (a fused linear or ring embedding) a ``ParamRead`` for each of its sharded parameters
    (``dims``: parameter name -> sharded dim). A parameter shared with a module converted before (a tied table)
    keeps its one ``ParamRead``, so every read of it in a step is one gather and one gradient sum."""
    reads = module.__dict__.setdefault("_cf_reads", {})
    for pname, dim in dims.items():
        param = module._parameters.get(pname)
        if param is None:
            continue
        assert isinstance(param, DTensor), "a fused parameter is a DTensor"
        known = steps.reads.get(id(param))
        if known is None:
            known = steps.reads[id(param)] = ParamRead(steps, param, dim, f"{name}.{pname}" if name else pname)
        reads[pname] = known


def read_attribute(module: nn.Module, name: str):
    """``__getattr__`` of the fused module classes: a sharded parameter answers through its ``ParamRead``;
    everything else as ``nn.Module`` does (parameters, buffers and submodules are found there)."""
    reads = module.__dict__.get("_cf_reads")
    if reads is not None:
        read = reads.get(name)
        if read is not None:
            return read.read()
    return nn.Module.__getattr__(module, name)


def refuse_rebinding(module: nn.Module, name: str, value=None, deleting: bool = False) -> None:
    """``__setattr__`` / ``__delattr__`` of the fused module classes, for the sharded parameters: rebinding one
    to the same parameter (``tie_weights()`` on a table that is tied already) is allowed; anything else would
    leave the fused ring with a parameter the model no longer uses, so it is refused."""
    reads = module.__dict__.get("_cf_reads")
    read = reads.get(name) if reads is not None else None
    if read is None or (not deleting and value is read.param):
        return
    what = "delete" if deleting else "replace"
    raise RuntimeError(
        f"commfuse_dp: cannot {what} {read.name} after shard(): it is a ring-fused parameter, sharded over the "
        f"ranks and bound to its layer's ring. Do this before commfuse_dp.shard() (resize_token_embeddings, "
        f"tie_weights with a new tie, torch.nn.utils.parametrize / weight_norm, swapping a weight), or keep the "
        f"module out of the fused path with CommFuseConfig(exclude=[...]) (then FSDP2 shards it)")


def guarded_class(name: str, base: type, namespace: dict) -> type:
    """A fused module class: ``base`` plus ``namespace``, whose sharded parameters answer attribute reads from
    outside the fused forward with their full value and refuse to be rebound (``reads.py``)."""
    cls = type(name, (base,), dict(namespace))

    def __getattr__(self, attr: str):
        return read_attribute(self, attr)

    def __setattr__(self, attr: str, value) -> None:
        refuse_rebinding(self, attr, value)
        super(cls, self).__setattr__(attr, value)

    def __delattr__(self, attr: str) -> None:
        refuse_rebinding(self, attr, deleting=True)
        super(cls, self).__delattr__(attr)

    cls.__getattr__, cls.__setattr__, cls.__delattr__ = __getattr__, __setattr__, __delattr__
    return cls


class ParamBindings:
    """The fused modules and their sharded parameters as ``shard()`` left them, checked at each step's start: a
    module replaced in its parent (``set_input_embeddings``), a parameter removed or rebound behind
    ``__setattr__``'s back (``torch.nn.utils.weight_norm`` edits ``_parameters`` directly), or a class swapped
    (``parametrize``) is refused on every rank, before any hop could pair up with another rank's."""

    def __init__(self, model: nn.Module, bound: list[tuple[str, nn.Module, dict[str, int]]]) -> None:
        self.entries = []
        for name, module, dims in bound:
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            params = tuple((p, module._parameters[p]) for p in dims if module._parameters.get(p) is not None)
            self.entries.append((name, parent._modules, leaf, module, type(module), params))

    def check(self) -> None:
        for name, siblings, leaf, module, cls, params in self.entries:
            if siblings.get(leaf) is not module:
                problem = "the module was replaced in its parent (set_input_embeddings / set_output_embeddings?)"
            elif type(module) is not cls:
                problem = f"its class became {type(module).__name__} (torch.nn.utils.parametrize?)"
            else:
                changed = [p for p, param in params if module._parameters.get(p) is not param]
                if not changed:
                    continue
                problem = f"its parameter {changed[0]!r} was removed or replaced (weight_norm? a direct assignment?)"
            raise RuntimeError(
                f"commfuse_dp: {name} is ring-fused and was changed after shard(): {problem}. Its shards and ring are "
                f"bound to the module and parameters shard() saw, so this forward would silently use the old ones. "
                f"Make such changes before commfuse_dp.shard(), or keep the module out of the fused path with "
                f"CommFuseConfig(exclude=[...])")
