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

Module order stands for execution order (true of most of transformers' decoders and encoders; where it is not, as
OPT's final norm registered before its layers, the unit is only gathered for longer). What sits between layers
(T5's encoder norm), contains a layer, or shares a parameter with such a module (T5's and BART's tables, tied to
the decoder's embedding) stays with the root.
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


def peer_plan(model: nn.Module, layers: list[nn.Module], kept_out: set, stay_whole: set[int] = frozenset()
              ) -> list[UnitPlan]:
    """[Note: the peer's units]. ``layers``: the decoder layers (``selection.unit_modules_of``, innermost first);
    ``kept_out``: parameters no unit takes (``fully_shard``'s ``ignored_params``); ``stay_whole``: ids of modules
    that stay with the root (inside a data-dependently called module: ``data_dependence.py``). Without layers: none."""
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
    # the modules that contain a layer stay with the root, whose unit wraps them
    prefixes = {name.rsplit(".", k)[0] for name in (names[id(layer)] for layer in layers)
                for k in range(1, name.count(".") + 1)}
    around = {id(model)} | {id(m) for name, m in model.named_modules() if name in prefixes}
    first, last = min(s for s, _ in span), max(e for _, e in span)
    outside = [m for m in model.modules() if id(m) not in inside and _has_direct(m, kept_out)]
    holders = [m for m in outside if id(m) not in around and id(m) not in stay_whole]
    head = [m for m in holders if order[id(m)] < first]
    tail = [m for m in holders if order[id(m)] > last]
    for tied in _sharing(outside):  # modules that hold one parameter between them go to one unit, or to the root
        if any(m not in head and m not in tail for m in tied):
            head, tail = [m for m in head if m not in tied], [m for m in tail if m not in tied]
        elif any(m in head for m in tied) and any(m in tail for m in tied):
            tail, head = head + tail, []  # one table used at both ends: one unit, kept from the embedding on
    outer = [p for p in plans if not any(p.modules[0] is not q.modules[0] and p.modules[0] in q.modules[0].modules()
                                         for q in plans)]
    last_layer = max(outer, key=lambda p: order[id(p.modules[0])])
    plans = [p._replace(reshard_after_forward=False) if p is last_layer else p for p in plans]
    if head:
        plans.append(UnitPlan("+".join(names[id(m)] for m in head), tuple(head), True))
    if tail:
        plans.append(UnitPlan("+".join(names[id(m)] for m in tail), tuple(tail), False))
    return plans


def _sharing(modules: list[nn.Module]) -> list[list[nn.Module]]:
    """The groups of ``modules`` (two or more) joined by parameters they hold in common (tied tables)."""
    owner: dict[int, int] = {}  # parameter id -> the first module index holding it
    parent = list(range(len(modules)))

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    for i, m in enumerate(modules):
        for p in m.parameters(recurse=False):
            j = owner.setdefault(id(p), i)
            parent[root(i)] = root(j)
    groups: dict[int, list[nn.Module]] = {}
    for i, m in enumerate(modules):
        groups.setdefault(root(i), []).append(m)
    return [g for g in groups.values() if len(g) > 1]


def apply(plans: list[UnitPlan], second_copy: int = 1, **fully_shard_kwargs) -> None:
    """``fully_shard`` each plan (inner layers first, as listed), with ``fully_shard_kwargs`` (mesh, mp_policy,
    ignored_params). ``second_copy`` N > 1 (``CommFuseConfig.hpz_size``): the units resharded after forward are
    resharded to groups of N consecutive ranks instead (``reshard_after_forward=N``: ZeRO++'s hpZ)."""
    for plan in plans:
        target = plan.modules[0] if len(plan.modules) == 1 else list(plan.modules)
        reshard = second_copy if plan.reshard_after_forward and second_copy > 1 else plan.reshard_after_forward
        fully_shard(target, reshard_after_forward=reshard, **fully_shard_kwargs)


def _has_direct(module: nn.Module, kept_out: set) -> bool:
    return any(p not in kept_out for p in module.parameters(recurse=False))


def _has_own(module: nn.Module, kept_out: set) -> bool:
    return any(p not in kept_out for p in module.parameters())
