"""Transformers' tensor-parallel plans read against the fused layers, and its ``DistributedConfig`` as a
``CommFuseConfig``.

A plan maps module (or parameter) names, layer numbers written ``*``, to transformers' parallel styles: a model's
own is its ``_tp_plan`` (``base_model_tp_plan`` under the base model's prefix, with the lm_head's rule), and a
user's ``DistributedConfig(tp_plan={...})`` overrides rules of it. The fused TPSP layers split every supported
model one way: q, k, v, gate and up by output rows ("colwise"), o and down by input columns ("rowwise"), the
embedding and the lm_head by vocabulary rows ("embedding_rowwise", "colwise_gather_output"), the norms whole over
this rank's rows of the sequence. A plan is taken when each of its rules names modules the model has and says
that split of them (or leaves a module whole that the fused layers leave whole); any other rule is refused,
naming it, before the model is changed. The check is local and the same on every rank, so every rank raises.
"""

from __future__ import annotations

import re

import torch.nn as nn

NORMS = ("RMSNorm", "LayerNorm")  # the modules whose weights stay whole (their class names end so)
# what the fused layers do to a module -> the styles of transformers' that say the same split of its weight
STYLES = {
    "rows": ("colwise", "colwise_rep", "colwise_gather_output"),
    "columns": ("rowwise", "rowwise_rep", "rowwise_split_input"),
    "vocabulary": ("embedding_rowwise",),
    "whole": ("sequence_parallel", "replicated_with_grad_allreduce", "replicate"),
}
_SAID = {"rows": "by output rows", "columns": "by input columns", "vocabulary": "by vocabulary rows",
         "whole": "whole (over this rank's rows of the sequence)"}


def generic(name: str) -> str:
    """``name`` with its layer numbers as ``*`` (transformers' ``replace_layer_number_by_wildcard``)."""
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)


def roles(model: nn.Module) -> dict[str, str]:
    """What the fused layers do to each module they touch, by generic name: ``rows``, ``columns``,
    ``vocabulary`` or ``whole``."""
    names = {id(m): n for n, m in model.named_modules()}
    base = model.get_decoder()
    out: dict[str, str] = {}
    for layer in base.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for proj, role in ((attn.q_proj, "rows"), (attn.k_proj, "rows"), (attn.v_proj, "rows"),
                           (attn.o_proj, "columns"), (getattr(mlp, "gate_proj", None), "rows"),
                           (getattr(mlp, "up_proj", None), "rows"), (getattr(mlp, "down_proj", None), "columns")):
            if proj is not None:
                out[generic(names[id(proj)])] = role
    out[generic(names[id(base.embed_tokens)])] = "vocabulary"
    head = getattr(model, "lm_head", None)
    if head is not None:
        out[generic(names[id(head)])] = "rows"
    for name, module in model.named_modules():
        if type(module).__name__.endswith(NORMS):
            out[generic(name)] = "whole"
    return out


def resolve(model: nn.Module, plan) -> dict[str, str]:
    """The plan the model runs: its own (``"auto"`` or None), or its own with ``plan``'s rules over it."""
    own = dict(getattr(model, "_tp_plan", None) or {})
    if plan is None or plan == "auto":
        return own
    return {**own, **dict(plan)}


def check_plan(model: nn.Module, plan) -> dict[str, str]:
    """Raise ``ValueError`` unless every rule of the plan ``model`` would run (``resolve``) names a module or a
    parameter of ``model`` and says of it what the fused layers do (``STYLES``); returns that plan. A rule's name
    is taken from the root (``model.layers.*.mlp.up_proj``, as ``model._tp_plan`` writes it) or from the base
    model (``layers.*.mlp.up_proj``, as ``base_model_tp_plan`` does)."""
    merged = resolve(model, plan)
    cls = type(model).__name__
    modules = {generic(n) for n, _ in model.named_modules()}
    params = {generic(n) for n, _ in model.named_parameters()}
    role_of = roles(model)
    prefix = getattr(model, "base_model_prefix", "") or ""
    for key, style in merged.items():
        name = next((k for k in (key, f"{prefix}.{key}" if prefix else None) if k in modules or k in params), None)
        if name is None:
            raise ValueError(f"tensor_parallel: tp_plan rule {key!r} names no module or parameter of {cls} (layer "
                             f"numbers as *, e.g. 'model.layers.*.self_attn.q_proj'); drop or rename the rule")
        module = name.rsplit(".", 1)[0] if name in params and name not in modules else name
        role = role_of.get(module)
        if role is None:
            if style in STYLES["whole"]:
                continue
            raise ValueError(f"tensor_parallel: tp_plan rule {key!r}: {style!r}: the fused TP layers have no split "
                             f"for {module} (they split the attention, the MLP, the embedding and the lm_head and "
                             f"keep every other module whole); drop the rule or make it 'replicate'")
        if not isinstance(style, str) or style not in STYLES[role]:
            raise ValueError(f"tensor_parallel: tp_plan rule {key!r}: {style!r}: the fused TP layers split {module} "
                             f"{_SAID[role]} ({' / '.join(repr(s) for s in STYLES[role])} in transformers' names) "
                             f"and cannot run another split; drop the rule to take the model's own plan")
    return merged


def from_distributed_config(distributed, config=None):
    """The ``CommFuseConfig`` (``config``, default the defaults) that runs what transformers' ``DistributedConfig``
    ``distributed`` asks on the fused layers: its ``tp_size``, ``tp_plan`` and ``dp_replicate_size`` (as
    ``replicate``); the data-parallel shards are what is left of the world, so its ``fsdp_size`` is not read.
    Pipeline, expert and context parallelism are refused. Use it instead of ``from_pretrained(...,
    distributed_config=...)``: load the model unsharded (on the meta device to hold no whole copy) and call
    ``shard(model, from_distributed_config(distributed))``."""
    from ..config import CommFuseConfig

    config = config if config is not None else CommFuseConfig()
    if not isinstance(config, CommFuseConfig):
        raise ValueError(f"from_distributed_config: config must be a CommFuseConfig, got {type(config).__name__}")
    for name in ("pp_size", "ep_size", "cp_size"):
        if (getattr(distributed, name, None) or 1) > 1:
            raise ValueError(f"from_distributed_config: {name}={getattr(distributed, name)} is not supported "
                             f"(tensor parallelism, FSDP and HSDP only); set it to 1")
    changes = {"tp_size": int(getattr(distributed, "tp_size", None) or 1),
               "tp_plan": getattr(distributed, "tp_plan", None) or "auto"}
    replicate = int(getattr(distributed, "dp_replicate_size", None) or 1)
    if replicate > 1:
        changes["replicate"] = replicate
    return config.replace(**changes)
