"""Lockstep by construction: which modules a model calls data-dependently, and what ``shard()`` does about them.

Every rank must enter the same fused hops, and the same FSDP2 collectives, in the same order. A module that
runs on one rank and not on another breaks that: its hop (or its unit's all-gather) waits for a peer that
never comes, or pairs with another layer's hop. Two kinds of modules are called data-dependently, and both are
found from the model's structure and config, not from a list of model names:

(a) **MoE experts.** An ``nn.ModuleList`` / ``nn.ModuleDict`` whose children that hold parameters are at least
    two, all of one type (children without parameters, like NLLB-MoE's ``token_dropout``, do not count), is a
    list of experts when its attribute name contains ``"expert"`` (``experts``, ``expert_list``),
    or when its length equals the ``out_features`` of a sibling linear, directly (``gate = Linear(hidden, E)``
    beside ``experts``) or one level down (``router.classifier``, as in transformers' SwitchTransformers and
    NLLB-MoE): that linear is the router. A list whose children are of one of the model's ``_no_split_modules``
    classes is its layer list, never experts. Each child is data-dependent ("MoE expert of <block>"): it runs only
    when tokens are routed to it.
(b) **LayerDrop.** A config (``model.config``, the ``config`` of any submodule, and the configs nested in them,
    e.g. ``config.text_config``) with an attribute whose name contains ``layerdrop`` and whose value is > 0
    (``layerdrop``, ``encoder_layerdrop``, ``decoder_layerdrop``) governs the layer lists under the module that
    holds it: the ``nn.ModuleList`` s named ``layers``, ``layer``, ``block``, ``blocks`` or ``h``, restricted to
    those whose path contains ``encoder`` (``decoder``) for an ``encoder_`` (``decoder_``) attribute. A module
    with its own ``layerdrop`` attribute > 0 (BART's encoder and decoder) governs its ``nn.ModuleList`` children,
    whatever their names. Each layer of a governed list is data-dependent ("LayerDrop"): training skips it at
    random, per rank.

What ``shard()`` does with them (``CommFuseConfig.exclude_data_dependent``, on by default): they are neither fused
nor ring embeddings, and never FSDP2 units of their own; they join the unit of their parent (an MoE block's unit
gathers all of its experts at once, on every rank). That unit reduce-scatters a zero gradient for a parameter that
got none on this rank (``FSDPModule.set_reduce_scatter_unused_params``), so every rank reduces the same set of
tensors: without it a rank whose expert got no tokens would leave that expert out and the gradients would be
wrong (or the ring would hang). A parameter that no rank used gets a zero gradient instead of ``None`` (as with
DDP's ``find_unused_parameters``): an optimizer then still applies weight decay and momentum to it.

Every submodule is also marked ``_is_fsdp_managed_module`` (as ``fully_shard`` marks the modules it manages),
which transformers reads (``transformers.distributed.fsdp.is_fsdp_managed_module``): ``generate()`` turns
``synced_gpus`` on by itself when the world has more than one rank (a rank whose sequences are done keeps
stepping until all are), Seq2SeqTrainer does the same for evaluation, and the LayerDrop loops of wav2vec2,
WavLM, HuBERT, NLLB-MoE's decoder and similar models run every layer on every rank.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

logger = logging.getLogger("commfuse_dp")

MOE = "MoE expert"
LAYERDROP = "LayerDrop"
PATTERN = "exclude pattern"
KINDS = {
    MOE: "MoE experts (called only for the tokens routed to them)",
    LAYERDROP: "LayerDrop layers (skipped at random, per rank, in training)",
    PATTERN: "modules matching CommFuseConfig.exclude",
}
LAYER_LIST_NAMES = ("layers", "layer", "block", "blocks", "h")
_SHOWN = 4  # module names shown per log line


# ---- finding data-dependent modules ------------------------------------------------------------------

def data_dependent_modules(model: nn.Module) -> dict[str, str]:
    """``{module name: reason}`` for every module that ``model`` calls data-dependently (rules in the docstring)."""
    found: dict[str, str] = {}
    _moe_experts(model, found)
    _layerdrop_layers(model, found)
    return found


def _moe_experts(model: nn.Module, found: dict[str, str]) -> None:
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    for parent_name, parent in model.named_modules():
        for attr, container in parent.named_children():
            if not isinstance(container, (nn.ModuleList, nn.ModuleDict)):
                continue
            entries = [(key, m) for key, m in container.named_children() if next(m.parameters(), None) is not None]
            if len(entries) < 2 or len({type(m) for _, m in entries}) != 1:
                continue
            if type(entries[0][1]).__name__ in layer_classes:
                continue
            if "expert" in attr.lower():
                how = ""
            else:
                router = _router(parent, attr, len(entries))
                if router is None:
                    continue
                how = f", routed by {_join(parent_name, router)}"
            block = parent_name or "(root)"
            for key, _ in entries:
                found.setdefault(_join(parent_name, attr, key), f"{MOE} of {block}{how}")


def _router(parent: nn.Module, experts_attr: str, count: int) -> str | None:
    """The name (relative to ``parent``) of a linear beside ``parent.<experts_attr>`` with ``count`` outputs."""
    for attr, sibling in parent.named_children():
        if attr == experts_attr:
            continue
        if _out_features(sibling) == count:
            return attr
        for inner, module in sibling.named_children():
            if _out_features(module) == count:
                return f"{attr}.{inner}"
    return None


def _out_features(module: nn.Module) -> int | None:
    if isinstance(module, nn.Linear):
        return module.out_features
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf"):  # transformers' (in, out) linear
        return module.nf
    return None


def _layerdrop_layers(model: nn.Module, found: dict[str, str]) -> None:
    for scope, label, attr, value in _layerdrop_settings(model):
        side = attr.lower().partition("layerdrop")[0].strip("_")  # "encoder", "decoder" or ""
        root = model.get_submodule(scope)
        for name, module in root.named_modules(prefix=scope):
            if not isinstance(module, nn.ModuleList) or name.rpartition(".")[2] not in LAYER_LIST_NAMES:
                continue
            if side and not any(side in part.lower() for part in name.split(".")):
                continue
            _mark_layers(name, module, f"{LAYERDROP} ({label}.{attr}={value})", found)
    for name, module in model.named_modules():
        value = getattr(module, "layerdrop", None) if not isinstance(module, nn.ModuleList) else None
        if _positive(value):
            for attr, child in module.named_children():
                if isinstance(child, nn.ModuleList):
                    _mark_layers(_join(name, attr), child, f"{LAYERDROP} ({name or '(root)'}.layerdrop={value})",
                                 found)


def _mark_layers(list_name: str, layers: nn.ModuleList, reason: str, found: dict[str, str]) -> None:
    for key, _ in layers.named_children():
        found.setdefault(_join(list_name, key), reason)


def _layerdrop_settings(model: nn.Module) -> Iterator[tuple[str, str, str, Any]]:
    """``(scope module name, config label, attribute, value)`` for every LayerDrop attribute > 0 of a config."""
    holders: dict[int, tuple[str, Any]] = {}
    for name, module in model.named_modules():
        cfg = module.__dict__.get("config")
        if cfg is not None and not isinstance(cfg, nn.Module) and id(cfg) not in holders:
            holders[id(cfg)] = (name, cfg)
    seen: set[int] = set()

    def walk(cfg: Any, scope: str, label: str, depth: int) -> Iterator[tuple[str, str, str, Any]]:
        seen.add(id(cfg))
        for attr, value in _attributes(cfg).items():
            if "layerdrop" in attr.lower() and _positive(value):
                yield scope, label, attr, value
            elif _config_like(value) and id(value) not in seen and depth < 4:
                inner_scope = holders[id(value)][0] if id(value) in holders else scope
                yield from walk(value, inner_scope, f"{label}.{attr}", depth + 1)

    for cfg_id, (scope, cfg) in holders.items():
        if cfg_id not in seen:
            yield from walk(cfg, scope, _join(scope, "config"), 0)


def _attributes(cfg: Any) -> dict[str, Any]:
    if isinstance(cfg, Mapping):
        return {str(k): v for k, v in cfg.items()}
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: getattr(cfg, f.name, None) for f in dataclasses.fields(cfg)}
    return dict(getattr(cfg, "__dict__", {}))


def _config_like(value: Any) -> bool:
    return not isinstance(value, type) and (type(value).__name__.endswith("Config")
                                            or (dataclasses.is_dataclass(value) and not isinstance(value, type)))


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


# ---- what shard() keeps out of the fused path ---------------------------------------------------------

class Exclusions:
    """Modules kept out of the fused path, by name, with the reason; a module inside one is excluded too."""

    def __init__(self, reasons: dict[str, str]) -> None:
        self.reasons = reasons

    def why(self, name: str) -> str | None:
        """The reason ``name`` (or the nearest excluded module containing it) is excluded; None if it is not."""
        parts = name.split(".") if name else []
        for end in range(len(parts), -1, -1):
            reason = self.reasons.get(".".join(parts[:end]))
            if reason is not None:
                return reason
        return None

    def __bool__(self) -> bool:
        return bool(self.reasons)


def exclusions(model: nn.Module, patterns: tuple[str, ...], data_dependent: dict[str, str],
               exclude_data_dependent: bool) -> Exclusions:
    """The modules ``shard()`` keeps out of the fused path: those matching ``patterns`` (``CommFuseConfig.exclude``)
    and, with ``exclude_data_dependent``, the data-dependent ones. Logs each kind once."""
    reasons: dict[str, str] = {}
    if exclude_data_dependent:
        reasons.update(data_dependent)
    elif data_dependent:
        _log_groups(data_dependent, "are fused anyway (CommFuseConfig.exclude_data_dependent=False): a step in which "
                                    "the ranks call different ones fails")
    if patterns:
        matched = set()
        for name, _ in model.named_modules():
            for pattern in patterns:
                if name and fnmatch.fnmatchcase(name, pattern):
                    reasons.setdefault(name, f"{PATTERN} {pattern!r}")
                    matched.add(pattern)
                    break
        unmatched = [p for p in patterns if p not in matched]
        if unmatched:
            logger.warning("commfuse_dp: CommFuseConfig.exclude patterns %s match no module name; names look like "
                           "%r", unmatched, next((n for n, _ in model.named_modules() if "." in n), ""))
    _log_groups(reasons, "stay out of the fused path: FSDP2 shards them with their parent's unit")
    return Exclusions(reasons)


def _log_groups(reasons: dict[str, str], what: str) -> None:
    groups: dict[str, list[str]] = defaultdict(list)
    for name, reason in reasons.items():
        groups[kind_of(reason)].append(name)
    for kind, names in groups.items():
        shown = ", ".join(names[:_SHOWN]) + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")
        example = reasons[names[0]]
        logger.info("commfuse_dp: %d %s %s (%s; e.g. %s)", len(names), KINDS.get(kind, kind), what, shown, example)


def kind_of(reason: str) -> str:
    return next((kind for kind in KINDS if reason.startswith(kind)), reason)


# ---- FSDP2 units and the unused-parameter reduce-scatter ------------------------------------------------

def inside(model: nn.Module, names: Iterable[str]) -> set[int]:
    """Ids of the modules named ``names`` and of every module inside them."""
    wanted, ids = set(names), set()
    for name, module in model.named_modules():
        if name in wanted:
            ids.update(id(m) for m in module.modules())
    return ids


def log_dropped_units(units: list[nn.Module], kept: list[nn.Module]) -> None:
    dropped = [u for u in units if all(u is not k for k in kept)]
    if dropped:
        kinds = sorted({type(u).__name__ for u in dropped})
        logger.info("commfuse_dp: %d modules (%s) are called data-dependently and are not FSDP2 units of their own "
                    "(one rank would skip its all-gather); they join their parent's unit", len(dropped),
                    ", ".join(kinds))


def reduce_unused_params(model: nn.Module, names: Iterable[str]) -> list[str]:
    """Make the FSDP2 unit that manages each module of ``names`` (the innermost ``FSDPModule`` holding it) reduce
    a zero gradient for parameters that got none on this rank. Returns the names of those units."""
    units: dict[str, FSDPModule] = {}
    for name in names:
        parts = name.split(".")
        for end in range(len(parts), -1, -1):
            prefix = ".".join(parts[:end])
            module = model.get_submodule(prefix)
            if isinstance(module, FSDPModule):
                units[prefix] = module
                break
    for unit in units.values():
        unit.set_reduce_scatter_unused_params(True, recurse=False)
    return sorted(units)


def mark_fsdp_managed(model: nn.Module) -> None:
    """Mark every submodule the way ``fully_shard`` marks the modules it manages (see the module docstring)."""
    for module in model.modules():
        module._is_fsdp_managed_module = True
        if not hasattr(module, "_fsdp_use_orig_params"):  # torch.compile requires it of a module marked so
            module._fsdp_use_orig_params = True
