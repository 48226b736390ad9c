"""What ``shard()`` fuses and how it groups the rest: the linears to fuse, tables shared with an lm_head, ring
embeddings, linears that read one input (fused as one group), and the FSDP2 units (decoder layers) whose fused
groups' hops are bundled."""

from __future__ import annotations

import logging
from collections import Counter, defaultdict

import torch.nn as nn

from . import data_dependence
from .config import CommFuseConfig
from .fused.embedding import embedding_eligible
from .runtime.layout import conv1d_class
from .runtime.step import StepState

logger = logging.getLogger("commfuse_dp")

SHARED_INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"), ("gate_proj", "up_proj"))


def fusable_linears(model: nn.Module, config: CommFuseConfig, world: int, excluded: data_dependence.Exclusions,
                     tied_tables: dict[int, tuple[nn.Embedding, nn.Linear]],
                     unit_modules: list[nn.Module]) -> list[tuple[str, nn.Module, bool]]:
    conv1d = conv1d_class()
    owners = _param_owners(model)
    fused, candidates, small, tied, other = [], [], 0, 0, Counter()
    for name, module in model.named_modules():
        if excluded.why(name):
            continue  # logged by data_dependence.exclusions
        kind = type(module)
        if kind is nn.Linear or (conv1d is not None and kind is conv1d):
            if id(module.weight) in tied_tables:
                fused.append((name, module, False))  # the lm_head of a tied table (tied_tables)
            elif owners[id(module.weight)] > 1 or (module.bias is not None and owners[id(module.bias)] > 1):
                tied += 1  # shared with another module: FSDP2 keeps both uses in one unit
            else:
                candidates.append((name, module, kind is not nn.Linear))
        elif isinstance(module, nn.Linear) or (conv1d is not None and isinstance(module, conv1d)):
            other[kind.__name__] += 1
    # Linears that read the same input ride the same hops, so they are judged together: GQA's k_proj and
    # v_proj, each below min_fuse_numel, are fused with q_proj when the group's shard is large enough. Under the
    # elastic schedule every fused group of a unit rides that unit's hops (its bundle), so a small
    # group in a unit with a large one is fused too: at 8 ranks a 512-wide o_proj (a 32768-element shard) then
    # costs no ring latency of its own, where unfused it would join the root unit's gather at the step's head.
    small_groups = []
    for group in shared_input_groups(candidates):
        if sum(m.weight.numel() for _, m, _ in group) // world < config.min_fuse_numel:
            small_groups.append(group)
        else:
            fused += group
    if small_groups and config.schedule == "fused" and config.elastic(world):
        innermost = _innermost_unit(unit_modules)
        with_fused = {innermost.get(id(m)) for _, m, _ in fused} - {None}
        rides = [g for g in small_groups if innermost.get(id(g[0][1])) in with_fused]
        small_groups = [g for g in small_groups if innermost.get(id(g[0][1])) not in with_fused]
        if rides:
            order = {id(m): i for i, m in enumerate(model.modules())}
            fused = sorted(fused + [entry for g in rides for entry in g], key=lambda e: order[id(e[1])])
            logger.info("commfuse_dp: %d linears below min_fuse_numel=%d elements are fused with the larger groups "
                        "of their unit, whose hops they share", sum(len(g) for g in rides),
                        config.min_fuse_numel)
    small = sum(len(g) for g in small_groups)
    if small:
        logger.info("commfuse_dp: %d linears have weight shards (summed with the linears that read the same input, "
                    "q/k/v, gate/up) below min_fuse_numel=%d elements and go through the bucketed rings instead",
                    small, config.min_fuse_numel)
    if tied:
        logger.info("commfuse_dp: %d linears share their weight with another module in a way that is not fused "
                    "(see tied_tables) and go through the bucketed rings", tied)
    for kind_name, count in other.items():
        logger.info("commfuse_dp: %d modules of type %s are not fused (only nn.Linear and Conv1D themselves are; "
                    "a subclass may use its weight in its own way); they go through the bucketed rings",
                    count, kind_name)
    return fused


def _param_owners(model: nn.Module) -> Counter[int]:
    """How many modules hold each parameter (more than one: tied weights)."""
    return Counter(id(p) for m in model.modules() for p in m.parameters(recurse=False))


def tied_tables(model: nn.Module, config: CommFuseConfig, world: int,
                 excluded: data_dependence.Exclusions) -> dict[int, tuple[nn.Embedding, nn.Linear]]:
    """Tied input and output embeddings that are fused together: an ``nn.Embedding`` whose table is the weight of
    one ``nn.Linear`` (the lm_head of GPT-2, Llama-3.2, Qwen2.5, Gemma) and of nothing else, whose bias (if any)
    is its own, both eligible on their own. The table is sharded by vocabulary rows once; the fused lm_head and the
    ring embedding use the same shards, and both gradients sum into its one ``.grad``. Keyed by ``id`` of the shared
    weight."""
    if not config.ring_embeddings:
        return {}
    holders: dict[int, list[tuple[str, nn.Module]]] = defaultdict(list)
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            if p is getattr(module, "weight", None):
                holders[id(p)].append((name, module))
    owners = _param_owners(model)
    tied = {}
    for key, users in holders.items():
        if len(users) != 2 or owners[key] != 2:  # held by these two modules, as their weight, and nothing else
            continue
        (e_name, embedding), (l_name, linear) = sorted(users, key=lambda u: type(u[1]) is not nn.Embedding)
        if type(embedding) is not nn.Embedding or type(linear) is not nn.Linear:
            continue
        if linear.bias is not None and owners[id(linear.bias)] > 1:
            continue  # a bias shared too (BERT's decoder bias is its parent's): the pair stays with FSDP2
        rows, cols = embedding.weight.shape
        why = (embedding_eligible(embedding) or excluded.why(e_name) or excluded.why(l_name)
               or ("its shard is below min_fuse_numel" if -(-rows // world) * cols < config.min_fuse_numel else None))
        if why is None:
            tied[key] = (embedding, linear)
            logger.info("commfuse_dp: %s and %s share one table: sharded once by vocabulary rows, fused in both",
                        e_name, l_name)
        else:
            logger.info("commfuse_dp: the table %s shares with %s stays in FSDP2: %s", e_name, l_name, why)
    return tied


def ring_embeddings(model: nn.Module, config: CommFuseConfig, world: int, excluded: data_dependence.Exclusions,
                     tied: dict[int, tuple[nn.Embedding, nn.Linear]]) -> list[nn.Embedding]:
    owners = _param_owners(model)
    chosen = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Embedding) or excluded.why(name):
            continue
        if id(module.weight) in tied:
            chosen.append(module)
            continue
        why = embedding_eligible(module)
        if why is None and owners[id(module.weight)] > 1:
            why = "its table is shared with another module (tied embeddings)"
        if why is None and -(-module.weight.shape[0] // world) * module.weight.shape[1] < config.min_fuse_numel:
            why = f"its shard is below min_fuse_numel={config.min_fuse_numel} elements"
        if why is None:
            chosen.append(module)
        else:
            logger.info("commfuse_dp: embedding %s goes through the bucketed rings: %s", name or "(root)", why)
    return chosen


def shared_input_groups(linears: list[tuple[str, nn.Module, bool]]) -> list[list[tuple[str, nn.Module, bool]]]:
    """Linears that read the same input, by sibling names (a PEFT wrapper's ``base_layer`` counts as its wrapper),
    as groups of ``(name, module, transposed)``; every other linear is a group of its own. Order: the groups, then
    the single linears, each in ``linears``' order (the same on every rank)."""
    by_parent: dict[str, dict[str, tuple[str, nn.Module, bool]]] = defaultdict(dict)
    for entry in linears:
        logical = entry[0].removesuffix(".base_layer")
        parent, _, leaf = logical.rpartition(".")
        by_parent[parent][leaf] = entry
    groups, grouped = [], set()
    for siblings in by_parent.values():
        for names in SHARED_INPUT_GROUPS:
            members = [siblings.get(n) for n in names]
            if all(m is not None for m in members) and _compatible(members):
                groups.append(members)
                grouped.update(id(m) for _, m, _ in members)
    return groups + [[entry] for entry in linears if id(entry[1]) not in grouped]


def _compatible(members: list[tuple[str, nn.Module, bool]]) -> bool:
    def width(entry):  # in_features: Conv1D's weight is (in, out)
        return entry[1].weight.shape[0] if entry[2] else entry[1].weight.shape[1]

    first = members[0]
    return all(width(m) == width(first) and m[1].weight.dtype == first[1].weight.dtype and m[2] == first[2]
               for m in members)


def unfused_numel(unit: nn.Module, fused_params: set[nn.Parameter]) -> int:
    return sum(p.numel() for p in unit.parameters() if p not in fused_params)


def _innermost_unit(unit_modules: list[nn.Module]) -> dict[int, int]:
    """``id(module)`` -> index of the innermost unit module around it (``unit_modules`` is innermost first)."""
    innermost: dict[int, int] = {}
    for at, unit in enumerate(unit_modules):
        for module in unit.modules():
            innermost.setdefault(id(module), at)
    return innermost


def bundle_units(steps: StepState, unit_modules: list[nn.Module]) -> None:
    """Each fused group's unit (``FusedGroupState.unit``): the innermost unit module around it, also where that
    unit is too small to be an FSDP2 unit of its own. The elastic schedule bundles the hops of a unit's
    groups (``runtime/schedule.py``)."""
    innermost = _innermost_unit(unit_modules)
    for state in steps.states:
        state.unit = innermost.get(id(state.modules[0]))


def unit_modules_of(model: nn.Module, units: tuple[type[nn.Module], ...] | None,
                    not_units: set[int]) -> list[nn.Module]:
    """FSDP2 units, innermost first. A module in ``not_units`` (ids: data-dependently called modules and the
    modules inside them, ``data_dependence.py``) is never one: it joins its parent's unit."""
    if units is not None:
        chosen = [m for m in model.modules() if isinstance(m, units) and m is not model]
    else:
        names = set(getattr(model, "_no_split_modules", None) or ())
        chosen = [m for m in model.modules() if type(m).__name__ in names and m is not model]
        if not chosen:
            lists = [m for m in model.modules()
                     if isinstance(m, nn.ModuleList) and not any(id(c) in not_units for c in m)]
            chosen = list(max(lists, key=len)) if lists else []
    lockstep_safe = [m for m in chosen if id(m) not in not_units]
    data_dependence.log_dropped_units(chosen, lockstep_safe)
    chosen = lockstep_safe
    # A unit that shares a parameter with a module outside it (a tied embedding) cannot be an FSDP2 unit of its
    # own: both uses must sit in one unit, so it is left to its parent.
    owners: dict[int, set[int]] = defaultdict(set)
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)].add(id(module))
    kept = []
    for unit in chosen:
        inside = {id(m) for m in unit.modules()}
        if all(owners[id(p)] <= inside for p in unit.parameters()):
            kept.append(unit)
        else:
            logger.info("commfuse_dp: %s shares a parameter with a module outside it (tied weights); it is sharded "
                        "with its parent instead of as a unit of its own", type(unit).__name__)
    return list(reversed(kept))
