"""HSDP: the gradient shards of fused parameters averaged across the model's copies (``CommFuseConfig.replicate``).

[Note: the replica exchange]
With R copies of N ranks each, a fused layer's rings run inside its copy (the shard group) and leave on each rank
its shard of the gradient summed over the copy, divided by N·R (``Engine.divide_factors``). What such a shard
still lacks is the other copies' sums: ranks holding the same shard in each copy (a replicate group) add theirs.
Only the contributions since the last exchange may cross, never what ``.grad`` held before (an accumulation over
steps without ``zero_grad`` would count it R times). So every synchronised contribution to a fused parameter's
gradient (a fused layer's landed ring, a ring embedding's or a weight read's gradient that autograd would put into
``.grad``) is kept here, *pending*, instead of going into ``.grad``. When the backward ends (an autograd final
callback, ``StepState._end_of_backward``, before the non-finite check), and only when gradient sync is on, the
pending shards are summed over the replicate group (one bucketed ring reduce-scatter and all-gather per dtype, in
the order the parameters were registered at ``shard()``, the same on every rank) and added into ``.grad``; the
post-accumulate-grad hooks run then, once, on the averaged gradient. Under ``no_sync`` a ring embedding's or
weight read's contribution (which the shard group sums even then) stays pending until the synchronised backward,
so accumulation crosses the replicas once, as DeepSpeed's MiCS does. A gradient that must go back through autograd
(``torch.autograd.grad``, a tensor hook) is exchanged at once instead (``exchange_now``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ..ring.collectives import ring_all_gather, ring_reduce_scatter
from ..ring.topology import get_ring


class Replicas:
    def __init__(self, group: dist.ProcessGroup, timeout_s: float, bucket_mb: float) -> None:
        self.group, self.timeout_s, self.bucket_mb = group, timeout_s, bucket_mb
        self.ring = get_ring(group, op="shard (replicate group)")
        self._index: dict[int, int] = {}  # id(parameter) -> registration order (the exchange's order)
        self._pending: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}

    @property
    def size(self) -> int:
        return self.ring.size

    def track(self, params) -> None:
        """The fused parameters whose gradients cross the replicas, in an order every rank shares."""
        for p in params:
            self._index.setdefault(id(p), len(self._index))

    def add(self, param: nn.Parameter, local_grad: torch.Tensor) -> None:
        """A synchronised contribution to ``param``'s local gradient shard, not yet summed over the replicas."""
        entry = self._pending.get(id(param))
        if entry is None:
            self._pending[id(param)] = (param, local_grad)
        else:
            entry[1].add_(local_grad)

    def drop(self) -> None:
        """Forget the pending contributions (a step that raised: its window is lost, as the no-sync partials)."""
        self._pending.clear()

    def exchange(self, accumulate) -> None:
        """Sum every pending shard over the replicate group and hand it to ``accumulate(param, shard)``."""
        pending = sorted(self._pending.values(), key=lambda e: self._index.get(id(e[0]), len(self._index)))
        self._pending = {}
        by_dtype: dict[torch.dtype, list[tuple[nn.Parameter, torch.Tensor]]] = {}
        for param, grad in pending:
            by_dtype.setdefault(grad.dtype, []).append((param, grad))
        for dtype in sorted(by_dtype, key=str):
            entries = by_dtype[dtype]
            flat = self._summed(torch.cat([g.reshape(-1) for _, g in entries]), "the gradients of the fused layers")
            at = 0
            for param, grad in entries:
                accumulate(param, flat[at:at + grad.numel()].view_as(grad))
                at += grad.numel()

    def exchange_now(self, grad: torch.Tensor, what: str) -> torch.Tensor:
        """``grad`` summed over the replicate group (a gradient that goes back through autograd)."""
        return self._summed(grad.reshape(-1), what).view_as(grad)

    def _summed(self, flat: torch.Tensor, what: str) -> torch.Tensor:
        """A ring all-reduce (reduce-scatter, then all-gather) of ``flat``, padded to a multiple of R."""
        r = self.size
        part = -(-flat.numel() // r)
        padded = flat.new_zeros(part * r)
        padded[:flat.numel()].copy_(flat)
        mine = padded.new_empty(part)
        label = f"{what} across the model's copies (HSDP)"
        ring_reduce_scatter(mine, padded, self.group, timeout_s=self.timeout_s, bucket_mb=self.bucket_mb, label=label)
        ring_all_gather(padded, mine, self.group, timeout_s=self.timeout_s, bucket_mb=self.bucket_mb, label=label)
        return padded[:flat.numel()]


def autograd_grad(engine, param: nn.Parameter, node, grad: torch.Tensor, what: str) -> torch.Tensor | None:
    """What a ring embedding's or weight read's backward returns for ``param``'s local shard ``grad`` (``node``: the
    parameter's AccumulateGrad node, seen at the forward). Without HSDP: ``grad``. With HSDP, where autograd would
    put it into ``.grad`` (a backward that reaches the parameter, no tensor hook on it): kept pending (None is
    returned); otherwise summed across the copies now when gradients sync."""
    replicas = engine.replicas
    if replicas is None:
        return grad
    try:
        into_grad = node is not None and not param._backward_hooks and torch._C._will_engine_execute_node(node)
    except RuntimeError:  # torch.autograd.grad: autograd refuses the question for leaves; nothing is accumulated
        into_grad = False
    if into_grad:
        replicas.add(param, grad.detach().clone())
        return None
    return replicas.exchange_now(grad, what) if engine.requires_grad_sync else grad


def grad_node(local: torch.Tensor):
    """The AccumulateGrad node of the DTensor parameter whose ``to_local()`` is ``local`` (None without grad)."""
    return local.grad_fn.next_functions[0][0] if local.grad_fn is not None else None
