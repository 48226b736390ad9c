"""The FSDP2 units ``shard()`` makes: what each ``fully_shard`` call holds and whether it reshards after forward.

[Note: the peer's units]
``schedule="fsdp2"`` wraps a model as torchtitan (``parallelize_llama``) and transformers' own FSDP plan do:

- the input embedding (the modules with parameters before the first decoder layer) is a unit of its own, resharded
  after the forward and gathered again for the backward;
- each decoder layer is a unit; the last one is kept gathered after the forward, since the backward needs it at
  once (FSDP2 would otherwise gather it again right away);
- the final norm and the output head (the modules with parameters after the last layer) are one unit, kept
  gathered after the forward for the same reason;
- where the input and output tables are one tensor (tied embeddings), the embedding joins that last unit;
- the root holds what is left (often nothing) and runs FSDP2's step-level hooks.

The coarse shape (``coarse_plan``) is each decoder layer and the root, which then holds the embedding, the final
norm and the lm_head: gathered before anything computes and reduce-scattered after the last layer's backward, with
nothing to hide either under. The bench keeps it as ``fsdp2_coarse``.

Module order stands for execution order (true of transformers' decoders and encoders); a module with parameters
between two layers (T5's encoder norm) stays with the root.
"""

from __future__ import annotations

from typing import NamedTuple

import torch.nn as nn
from torch.distributed.fsdp import fully_shard


class UnitPlan(NamedTuple):
    """One ``fully_shard`` call: its modules (several: one unit, one collective), and ``reshard_after_forward``."""

    name: str
    modules: tuple[nn.Module, ...]
    reshard_after_forward: bool


def coarse_plan(model: nn.Module, layers: list[nn.Module], kept_out: set) -> list[UnitPlan]:
    """Each layer with parameters of its own (innermost first), resharded after forward; the root is not listed."""
    names = {id(m): n for n, m in model.named_modules()}
    return [UnitPlan(names[id(u)], (u,), True) for u in layers if _has_own(u, kept_out)]


def peer_plan(model: nn.Module, layers: list[nn.Module], kept_out: set) -> list[UnitPlan]:
    """[Note: the peer's units]. ``layers``: the decoder layers (``selection.unit_modules_of``, innermost first);
    ``kept_out``: parameters no unit takes (``fully_shard``'s ``ignored_params``). Without layers: none."""
    plans = coarse_plan(model, layers, kept_out)
    if not plans:
        return plans
    order = {id(m): i for i, m in enumerate(model.modules())}
    names = {id(m): n for n, m in model.named_modules()}
    inside: set[int] = set()
    span = []  # (first, last) module position of each layer
    for layer in layers:
        positions = [order[id(m)] for m in layer.modules()]
        inside.update(id(m) for m in layer.modules())
        span.append((min(positions), max(positions)))
    first, last = min(s for s, _ in span), max(e for _, e in span)
    holders = [m for m in model.modules() if m is not model and id(m) not in inside and _has_direct(m, kept_out)]
    head = [m for m in holders if order[id(m)] < first]
    tail = [m for m in holders if order[id(m)] > last]
    tied = {id(p) for m in head for p in m.parameters(recurse=False)} & {
        id(p) for m in tail for p in m.parameters(recurse=False)}
    if tied:  # one table used at both ends: one unit, kept gathered from the embedding to the lm_head's backward
        tail, head = head + tail, []
    outer = [p for p in plans if not any(p.modules[0] is not q.modules[0] and p.modules[0] in q.modules[0].modules()
                                         for q in plans)]
    last_layer = max(outer, key=lambda p: order[id(p.modules[0])])
    plans = [p._replace(reshard_after_forward=False) if p is last_layer else p for p in plans]
    if head:
        plans.append(UnitPlan("+".join(names[id(m)] for m in head), tuple(head), True))
    if tail:
        plans.append(UnitPlan("+".join(names[id(m)] for m in tail), tuple(tail), False))
    return plans


def apply(plans: list[UnitPlan], **fully_shard_kwargs) -> None:
    """``fully_shard`` each plan (inner layers first, as listed), with ``fully_shard_kwargs`` (mesh, mp_policy,
    ignored_params)."""
    for plan in plans:
        target = plan.modules[0] if len(plan.modules) == 1 else list(plan.modules)
        fully_shard(target, reshard_after_forward=plan.reshard_after_forward, **fully_shard_kwargs)


def _has_direct(module: nn.Module, kept_out: set) -> bool:
    return any(p not in kept_out for p in module.parameters(recurse=False))


def _has_own(module: nn.Module, kept_out: set) -> bool:
    return any(p not in kept_out for p in module.parameters())
