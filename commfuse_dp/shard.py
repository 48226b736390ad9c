"""``shard(model, config)``: turn a model into a CommFuse-sharded model, in place.

1. Every eligible linear (``nn.Linear``, HF ``Conv1D``) whose weight shard has at least ``min_fuse_numel``
   elements becomes a ring-fused layer (``fused/``): its weight and bias become DTensor shards on a 1-D data-parallel
   mesh, and its forward and backward run the fused rings. Linears that read the same input (``q/k/v``,
   ``query/key/value``, ``gate/up``) share hops; under the elastic schedule so do a unit's groups, and a
   small linear is fused where its unit has a large one.
2. Every ``nn.Embedding`` with a large enough, untied table becomes a ring embedding (``fused/embedding.py``,
   ``CommFuseConfig.ring_embeddings``): sharded by rows, it exchanges looked-up rows instead of the table when
   that moves fewer bytes.
3. Everything else (norms, small embeddings, small or tied linears, other modules) is sharded by stock FSDP2
   ``fully_shard``, unit by unit (the model's ``_no_split_modules`` classes, else the entries of its layer list),
   with the fused parameters passed as ``ignored_params``, and its collectives switched to the bucketed rings.
   Under ``schedule="fsdp2"`` nothing is fused and the units are torchtitan's (``fsdp_units.py``: the embedding,
   each layer, the final norm with the lm_head).
4. The model gains ``set_requires_gradient_sync(flag)`` / ``no_sync()`` covering both parts (gradient accumulation),
   and ``commfuse_dp.step_stats(model)`` reports the last step's timing; ``commfuse_dp.describe(model)`` what was
   fused and what each part moves.

Before anything is converted the ranks check that they pass the same group, config and model (``checks.py``).
Modules named by ``CommFuseConfig.exclude`` and modules the model calls data-dependently (MoE experts, LayerDrop
layers: ``data_dependence.py``) stay out of the fused path and out of FSDP2 units of their own, so that every rank enters
the same hops in the same order.

Any torch optimizer built afterwards on ``model.parameters()`` keeps sharded state (ZeRO-3 memory).

A model built on the ``meta`` device (``with torch.device("meta"): model = AutoModelForCausalLM.from_config(cfg)``)
is sharded the same way, and then every rank allocates only its own shards on the real device (``to_empty``), so
the whole model never exists on one rank. Its parameters are then uninitialised until the weights are loaded
(``commfuse_dp.checkpoint.load_hf_weights``); its buffers are recomputed by transformers' own initialisation.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

from . import data_dependence, fsdp_units, node_layout
from .checks import CHECK_LABEL, check_not_sharded_elsewhere, check_ranks_agree
from .planner.choose import Resolved, narrow_formats, resolve
from .planner.choose_nodes import resolve_nodes
from .feedback import Residuals
from .handle import engine_of, handle_of
from .node_layout import NodeLayout
from .config import CommFuseConfig
from .describe import warn_if_little_fused
from .fused.embedding import convert_embedding
from .fused import attach_group, convert_linear, step_state
from .fused.reads import ParamBindings, attach_reads
from .nonfinite import NonfiniteCheck
from .ring.fsdp_comm import use_ring_collectives
from .ring.topology import get_ring
from .runtime.engine import Engine
from .runtime.replicas import Replicas
from .runtime.step import StepState
from .meta import materialise, materialise_device
from .scalars import ScalarParams
from .selection import (bundle_units, fusable_linears, ring_embeddings, shared_input_groups, tied_tables, unfused_numel,
                        unit_modules_of)
from .stats import StepStats
from .tp.parallelize import data_parallel_mesh

logger = logging.getLogger("commfuse_dp")


def shard(model: nn.Module, config: CommFuseConfig | None = None, *, mesh: DeviceMesh | None = None,
          units: tuple[type[nn.Module], ...] | None = None, device: torch.device | str | None = None) -> nn.Module:
    """Shard ``model`` in place over the data-parallel group and return it.

    ``mesh``: a 1-D DeviceMesh of the data-parallel ranks (default: all ranks of the initialised world), or a 2-D
    one ``(replicate, shard)`` for HSDP (``CommFuseConfig.replicate`` builds it from the world).
    ``units``: module classes to shard as FSDP2 units (default: ``model._no_split_modules``, else the entries of
    the model's longest ``nn.ModuleList``). By default a unit whose parameters left after fusing are too few to
    be worth a collective of their own (a shard below ``min_fuse_numel`` elements, e.g. a decoder layer's two
    norm weights) joins its parent's unit instead: the root gathers them once at the start of the step and
    reduce-scatters them once at the end, rather than with two blocking ring collectives inside every layer.

    A model on the ``meta`` device is sharded as a materialised one would be, and then each rank allocates its own
    shards, and nothing more, on ``device`` (default: the current CUDA device if CUDA is available, else the CPU;
    the mesh's device type when ``mesh`` is given). Its parameters are left **empty** (uninitialised memory): load
    them with ``commfuse_dp.checkpoint.load_hf_weights(model, folder)`` (a Hugging Face folder, each rank reading
    only its slices) or ``load_sharded``; a forward before that raises ``RuntimeError``. Non-persistent buffers
    (rotary ``inv_freq``, ``position_ids``) are recomputed with the model's transformers initialisation
    (``initialize_weights``, every parameter skipped), as ``from_pretrained`` does; a model that is no
    ``PreTrainedModel`` must set its non-persistent buffers itself. ``device`` is only for meta models.
    """
    config = _hpz_layout(config if config is not None else CommFuseConfig())
    device, on_meta, mesh, layout = _device_and_mesh(model, config, mesh, device)
    group = mesh.get_group(mesh.ndim - 1)  # the shard dimension: the fused rings run here
    everyone = mesh.mesh.flatten().tolist()
    one_node = not layout.multi and (device.type != "cuda" or dist.get_world_size() <= torch.cuda.device_count())
    check_ranks_agree(everyone, config, model)  # same mesh, config and parameters on every rank (checks.py)
    asked_schedule = config.schedule
    config, choice = _resolve_auto(model, config, mesh, group, device, one_node, layout)
    config, mesh, group = _chosen_mesh(config, mesh, group, device)
    check_ranks_agree(everyone, config, model, chosen=choice)  # (a rank that read other tokens chose otherwise)
    replicas = None
    # error feedback's, which checkpoints carry (feedback.py), kept in config.feedback_dtype
    handle = handle_of(model, create=True)
    residuals = handle.residuals = Residuals(config.error_feedback, config.feedback_torch_dtype)
    if mesh.ndim == 2:
        replicas = Replicas(mesh.get_group(0), config.ring_kwargs, config.reduce_format, config.format_block,
                            config.error_feedback, residuals)
    world_ring = get_ring(group if mesh.ndim == 1 else _data_parallel_world(model), caller="shard")  # 2-D: all
    engine = Engine(get_ring(group, caller="shard"), mesh, config, world_ring, replicas, residuals)
    steps = step_state(engine)  # drives the schedule the config names
    fused = _fuse(model, config, engine, steps, units)
    if replicas is not None:  # HSDP: the order in which their gradients cross the copies (the same on every rank)
        replicas.track(module._parameters[p] for _, module, dims in fused.bound for p in dims
                       if module._parameters.get(p) is not None)
    plans, scalars = _shard_the_rest(model, config, engine, steps, mesh, units, fused)
    _install(model, steps, ParamBindings(model, fused.bound), scalars)
    if on_meta:
        materialise(model, device)
    for state in steps.states:  # each group's local shards as views of one buffer that its rings send as it is
        state.adopt_packed()
    handle.excluded = dict(fused.excluded.reasons)
    handle.choice = choice
    logger.info("commfuse_dp.shard: %d linears fused (%s schedule: %s), %d FSDP2 units + root, %d ranks",
                len(fused.linears), config.schedule, choice.reason, len(plans), engine.ring.size)
    if config.schedule != "fsdp2":
        warn_if_little_fused(model, config, asked_schedule, choice.fused_with)
    return model


def _device_and_mesh(model: nn.Module, config: CommFuseConfig, mesh: DeviceMesh | None,
                     requested: torch.device | str | None) -> tuple[torch.device, bool, DeviceMesh, NodeLayout]:
    """The device the model's shards live on, whether the model is on the meta device, the data-parallel mesh and
    the launch's nodes (``node_layout.read``); a model sharded already, on several devices, or on another device
    than the mesh is refused."""
    if engine_of(model, through_wrapper=False) is not None:
        raise ValueError("shard: this model is sharded already; call shard() once per model")
    check_not_sharded_elsewhere(model)  # DeepSpeed or FSDP2 shards it already (checks.py)
    device = _single_device(model)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("shard: torch.distributed is not initialised. Call torch.distributed."
                           "init_process_group(...) first (torchrun / accelerate launch set it up)")
    if config.tp_size > 1:  # each TP rank's part of the model, sharded over the ranks at its TP position
        kind = materialise_device(requested, mesh).type if device.type == "meta" else device.type
        mesh = data_parallel_mesh(model, config, mesh, kind)
    on_meta = device.type == "meta"
    if on_meta:
        device = materialise_device(requested, mesh)
    elif requested is not None:
        raise ValueError(f"shard: device= is for a model on the meta device (where its shards are allocated); this "
                         f"model is on {device} already. Move it with model.to(...) before shard() instead")
    layout = node_layout.read(config.timeout_s, CHECK_LABEL) if mesh is None else NodeLayout(1, dist.get_world_size(), "the mesh given")
    mesh = _data_parallel_mesh(mesh, config, device, layout)
    if mesh.device_type != device.type:
        raise ValueError(f"shard: the model is on {device} but the mesh is on {mesh.device_type}; "
                         f"move the model to the mesh's device first")
    return device, on_meta, mesh, layout


def _chosen_mesh(config: CommFuseConfig, mesh: DeviceMesh, group, device: torch.device):
    """The config, mesh and shard group as chosen: one flat mesh where the flat ring (or hpZ) was chosen over HSDP
    across the nodes, and ``hpz_size`` checked against it (``_check_hpz``)."""
    if mesh.ndim == 2 and config.replicate == 1:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        group = mesh.get_group(0)
    return _check_hpz(config, mesh), mesh, group


def _hpz_layout(config: CommFuseConfig) -> CommFuseConfig:
    """An ``hpz_size`` N > 1 given: one flat shard (``replicate`` 1) under the fsdp2 schedule, where those are
    ``"auto"`` (``_check_hpz`` refuses them given otherwise)."""
    if config.hpz_size == "auto" or config.hpz_size <= 1:
        return config
    return config.replace(replicate=1 if config.replicate == "auto" else config.replicate,
                          schedule="fsdp2" if config.schedule == "auto" else config.schedule)


def _check_hpz(config: CommFuseConfig, mesh: DeviceMesh) -> CommFuseConfig:
    """``config`` with ``hpz_size`` an integer (``"auto"`` not chosen: 1), refused with one line where it cannot run:
    beside HSDP or TP, under another schedule than fsdp2, or not dividing the shard group's ranks."""
    if config.hpz_size == "auto":
        return config.replace(hpz_size=1)
    n, world = config.hpz_size, mesh.size(mesh.ndim - 1)
    if n == 1:
        return config
    fix = "set hpz_size=1 (no second copy)"
    if config.tp_size > 1 or mesh.ndim != 1:
        what = f"tp_size={config.tp_size}" if config.tp_size > 1 else f"HSDP ({mesh.size(0)} copies)"
        raise ValueError(f"shard: CommFuseConfig.hpz_size={n} splits a second copy of one flat shard, not {what}, "
                         f"whose backward gathers stay inside a copy already; {fix} or replicate=1 and tp_size=1")
    if config.schedule != "fsdp2":
        raise ValueError(f"shard: CommFuseConfig.hpz_size={n} runs under schedule='fsdp2' (FSDP2's "
                         f"reshard_after_forward={n}), not schedule={config.schedule!r}; set schedule=\"fsdp2\" "
                         f"(or \"auto\"), or {fix}")
    if world % n or n > world:
        raise ValueError(f"shard: CommFuseConfig.hpz_size={n} does not divide the {world} ranks of the shard group; "
                         f"give the ranks per node (the launcher's LOCAL_WORLD_SIZE), or {fix}")
    return config


def _resolve_auto(model: nn.Module, config: CommFuseConfig, mesh: DeviceMesh, group, device: torch.device,
                  one_node: bool, layout: NodeLayout) -> Resolved:
    """``config``'s "auto" settings, decided in one pass of the planner's plays (``choose.resolve``; across nodes
    ``choose_nodes.resolve_nodes``, which also picks HSDP or one flat ring) on what was given or is measured now
    (the median rank's figures: every rank chooses alike); the formats on the wire checked against the schedule
    chosen."""
    ranks = dist.get_world_size(group)
    copies = mesh.size(0) if mesh.ndim == 2 else 1  # (HSDP from a mesh given: choose as for replicate=R)
    if layout.multi and mesh.ndim == 2 and mesh.size(0) == layout.nodes and (
            config.replicate == "auto" or config.schedule == "auto"):
        resolved, choice = resolve_nodes(model, config, mesh, device)
    else:
        resolved, choice = resolve(model, config.replace(replicate=copies), ranks, device, one_node, group)
        resolved = resolved.replace(replicate=copies)
    if narrow_formats(resolved) and resolved.schedule == "fsdp2" and resolved.fsdp2_collectives == "torch":
        raise ValueError(f"shard: gather_format={resolved.gather_format!r} and reduce_format="
                         f"{resolved.reduce_format!r} travel on the library's rings, but fsdp2_collectives='torch' "
                         f"runs torch's own collectives; set fsdp2_collectives=\"rings\" (or \"auto\"), or leave "
                         f"both formats \"exact\"")
    if narrow_formats(resolved) and resolved.schedule == "slicing" and ranks > 1:
        raise ValueError(f"shard: gather_format={resolved.gather_format!r} and reduce_format="
                         f"{resolved.reduce_format!r} apply to the fused and fsdp2 schedules, not to "
                         f"schedule='slicing'; set schedule=\"fused\" (or \"auto\"), or leave both formats "
                         f"\"exact\"")
    return Resolved(resolved, choice)


class _Fused(NamedTuple):
    """What ``shard()`` put on the fused path, and what the rest of it needs to know."""

    linears: list[tuple[str, nn.Module, bool]]  # (name, module, transposed) of each fused linear
    params: set[nn.Parameter]  # the fused linears' and ring embeddings' parameters
    bound: list[tuple[str, nn.Module, dict[str, int]]]  # fused modules and their sharded params' dims
    excluded: data_dependence.Exclusions  # modules kept off the fused path and out of units of their own, and why
    data_dependent: dict[str, str]  # modules the model calls data-dependently (data_dependence.py)
    unit_modules: list[nn.Module]  # the FSDP2 unit candidates


def _fuse(model: nn.Module, config: CommFuseConfig, engine: Engine, steps: StepState,
          units: tuple[type[nn.Module], ...] | None) -> _Fused:
    """Convert the eligible linears (grouped where they read the same input) and embeddings to the fused rings, and
    bind their weights for reads from outside their forward. Nothing under the fsdp2 schedule."""
    names = {id(m): name or "(root)" for name, m in model.named_modules()}
    data_dependent = data_dependence.data_dependent_modules(model)
    excluded = data_dependence.exclusions(model, config.exclude, data_dependent, config.exclude_data_dependent)
    if handle_of(model).tp is not None:  # (tensor_parallel: the TP layers read their weights themselves)
        excluded.reasons.update(handle_of(model).tp.exclusions())
    peer = config.schedule == "fsdp2"  # nothing fused: FSDP2's units and its GPU schedule on the rings
    tied = {} if peer else tied_tables(model, config, engine.ring.size, excluded)  # {id(table): (embedding, lm_head)}
    unit_modules = unit_modules_of(model, units, not_units=data_dependence.inside(model, data_dependent))
    fused = [] if peer else fusable_linears(model, config, engine.ring.size, excluded, tied, unit_modules)
    fused_params: set[nn.Parameter] = set()
    bound: list[tuple[str, nn.Module, dict[str, int]]] = []  # fused modules and their sharded params' dims
    for name, module, transposed in fused:
        fused_params.update(convert_linear(module, engine, transposed))
        bound.append((name, module, {"weight": 1 if transposed else 0, "bias": 0}))
    for members in shared_input_groups(fused):
        attach_group(steps, [m for _, m, _ in members], [names[id(m)] for _, m, _ in members])
    for _, lm_head in tied.values():
        lm_head._cf_group.state.tied = True
    if config.ring_embeddings and not peer:
        for module in ring_embeddings(model, config, engine.ring.size, excluded, tied):
            pair = tied.get(id(module.weight))  # the lm_head that shares this table was sharded above: use its shards
            fused_params.add(convert_embedding(module, steps, names[id(module)],
                                               table=pair[1]._parameters["weight"] if pair is not None else None))
            bound.append((names[id(module)], module, {"weight": 0}))
    for name, module, dims in bound:
        attach_reads(steps, module, name, dims)  # module.weight read from outside: full value, summed gradient
    return _Fused(fused, fused_params, bound, excluded, data_dependent, unit_modules)


def _shard_the_rest(model: nn.Module, config: CommFuseConfig, engine: Engine, steps: StepState, mesh: DeviceMesh,
                    units: tuple[type[nn.Module], ...] | None, fused: _Fused) -> tuple[list, ScalarParams]:
    """Everything not fused: 0-d parameters replicated, the rest in FSDP2 units on the bucketed rings (the peer's:
    torchtitan's units on FSDP2's GPU schedule). Returns the units' plans and the 0-d parameters."""
    peer = config.schedule == "fsdp2"
    scalars = ScalarParams(model, mesh, engine)  # 0-d: fully_shard refuses them; replicated, averaged (scalars.py)
    kept_out = fused.params | scalars.params  # what fully_shard leaves alone
    mp_policy = MixedPrecisionPolicy(param_dtype=config.param_dtype, reduce_dtype=config.reduce_dtype)
    unit_modules = fused.unit_modules
    bundle_units(steps, unit_modules)
    if units is None and not peer:  # (the peer's shape: every decoder layer a unit of its own)
        unit_modules = [u for u in unit_modules
                        if unfused_numel(u, kept_out) // engine.ring.size >= max(config.min_fuse_numel, 1)]
    plans = (fsdp_units.peer_plan(model, unit_modules, kept_out, data_dependence.inside(model, fused.data_dependent))
             if peer else fsdp_units.coarse_plan(model, unit_modules, kept_out))
    fsdp_units.apply(plans, second_copy=config.hpz_size if peer else 1, mesh=mesh, mp_policy=mp_policy,
                     ignored_params=kept_out)
    if any(p not in kept_out for p in model.parameters()):
        fully_shard(model, mesh=mesh, mp_policy=mp_policy, ignored_params=kept_out)
    if any(isinstance(m, FSDPModule) for m in model.modules()) and not (peer and config.fsdp2_collectives == "torch"):
        use_ring_collectives(model, config, recorder=engine.stats, overlap=peer)
    if isinstance(model, FSDPModule) and callable(getattr(model, "generate", None)):
        # generate() may call submodules directly (T5's encoder): the root's parameters must be gathered for it
        register_fsdp_forward_method(model, "generate")
    data_dependence.reduce_unused_params(model, fused.data_dependent)
    data_dependence.mark_fsdp_managed(model)
    return plans, scalars


def _data_parallel_mesh(mesh: DeviceMesh | None, config: CommFuseConfig, device: torch.device,
                        layout: NodeLayout) -> DeviceMesh:
    """The 1-D shard mesh, or for HSDP the 2-D ``(replicate, shard)`` one: ``mesh`` as given, else built over the
    world from ``config.replicate`` (consecutive ranks share a copy); ``"auto"``: one copy on one node, and on a
    launch over several nodes a copy per node, which ``_resolve_auto`` may turn into one flat ring."""
    world = dist.get_world_size()
    if mesh is None:
        r = config.replicate if config.replicate != "auto" else layout.nodes
        if world % r:
            raise ValueError(f"shard: CommFuseConfig.replicate={r} does not divide the {world} ranks; the copies "
                             f"must be of equal size (e.g. replicate = the number of nodes)")
        if r == 1:
            return init_device_mesh(device.type, (world,))
        return init_device_mesh(device.type, (r, world // r), mesh_dim_names=("replicate", "shard"))
    if mesh.ndim not in (1, 2):
        raise ValueError(f"shard: the data-parallel mesh must be 1-D (shard) or 2-D (replicate, shard), got "
                         f"{mesh.ndim} dimensions")
    if config.replicate not in (1, "auto") and (mesh.ndim != 2 or mesh.size(0) != config.replicate):
        raise ValueError(f"shard: CommFuseConfig.replicate={config.replicate} but the mesh passed has shape "
                         f"{tuple(mesh.shape)}; give one of them (the mesh's first dimension is the replicas)")
    if mesh.ndim == 2 and mesh.size() != world and config.tp_size == 1:
        raise ValueError(f"shard: a 2-D (HSDP) mesh must hold every rank of the world ({world}); it holds "
                         f"{mesh.size()}")
    return mesh


def _data_parallel_world(model: nn.Module):
    """The group of every rank an HSDP engine spans: the world, or beside TP (``CommFuseConfig.tp_size``) every
    data-parallel rank at this rank's TP position."""
    tp = handle_of(model).tp
    return dist.group.WORLD if tp is None else tp.data_parallel


def step_stats(model: nn.Module) -> StepStats:
    """Timing of the last completed step of this rank (the current one if none completed yet). Steps count from 0,
    and a step lasts from one forward of the model to the next, so the step run last is complete only once the
    next forward begins: after three training steps this is step 1."""
    engine = engine_of(model)
    if engine is None:
        raise ValueError("step_stats: this model was not sharded with commfuse_dp.shard()")
    if not engine.stats.enabled:
        raise ValueError("step_stats: statistics are off (CommFuseConfig(stats=False))")
    return engine.stats.last or engine.stats.current()


# ---- checks ----------------------------------------------------------------------------------------------

def _single_device(model: nn.Module) -> torch.device:
    devices: dict[torch.device, str] = {}
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        devices.setdefault(t.device, name)
    if not devices:
        raise ValueError("shard: the model has no parameters to shard")
    if len(devices) > 1:
        where = ", ".join(f"{name!r} on {dev}" for dev, name in devices.items())
        raise ValueError(f"shard: the model's parameters and buffers are on several devices ({where}); move the "
                         f"whole model to one device (model.to(device)) before sharding")
    return next(iter(devices))


def _refuse_resize(*args, **kwargs) -> None:
    raise RuntimeError("resize_token_embeddings after commfuse_dp.shard(): the embedding table and the lm_head are "
                       "sharded over the ranks and cannot change shape. Resize before shard() (add the tokens to "
                       "the tokenizer, call model.resize_token_embeddings(len(tokenizer)), then shard the model)")


# ---- what the model gains ---------------------------------------------------------------------------------

def _install(model: nn.Module, steps: StepState, bindings: ParamBindings, scalars: ScalarParams) -> None:
    """What the model gains: the step's hooks, gradient-sync control, recovery after an error, and refusals of what
    a sharded model cannot do."""
    engine = steps.engine
    fsdp_root = model if isinstance(model, FSDPModule) else None
    # FSDP2's recovery after a step that raised (torch 2.13; torch 2.11, met on the GPU check, has none)
    fsdp_reset = getattr(fsdp_root, "reset_iter_state", None) if fsdp_root is not None else None
    _install_step_hooks(model, steps, bindings, scalars, fsdp_reset)
    _install_sync_control(model, steps, scalars, fsdp_root, fsdp_reset)
    model.__deepcopy__ = engine.__deepcopy__  # before FSDP2's own refusal, which does not say what to do
    if callable(getattr(model, "resize_token_embeddings", None)):
        model.resize_token_embeddings = _refuse_resize
    handle = handle_of(model, create=True)
    handle.engine, handle.steps = engine, steps


def _install_step_hooks(model: nn.Module, steps: StepState, bindings: ParamBindings, scalars: ScalarParams,
                        fsdp_reset) -> None:
    """The model's forward begins a step (after a step that raised, cleaning up first) and ends its forward part;
    the non-finite check watches the outputs."""

    @torch.compiler.disable
    def begin_step(module, args) -> None:
        bindings.check()  # a fused module replaced, or its parameter rebound, since shard(): refuse, say what
        if steps.begin_step() and fsdp_reset is not None:  # the previous step raised: FSDP2's part too
            fsdp_reset()
        scalars.begin_step()

    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if steps.engine.config.nonfinite_grads != "off":
        steps.nonfinite = NonfiniteCheck(model, steps)  # checks the shards after each synced backward

    @torch.compiler.disable
    def end_forward(module, args, output) -> None:
        steps.end_forward()
        scalars.end_forward(output)
        if steps.nonfinite is not None and torch.is_grad_enabled():
            steps.nonfinite.watch(output)  # the backward through these outputs ends with the check
        if not torch.is_grad_enabled():
            # No backward follows a no-grad forward (eval), so FSDP2 would leave the root unit (and any unit with
            # reshard_after_forward=False) unsharded, its plain full tensors registered as the module's
            # parameters until the next backward ends. An optimizer built in between (the Trainer builds it in
            # train(), after an evaluate()) would then hold those stale tensors and never update the shards.
            for unit in units:
                unit.reshard()

    model.register_forward_pre_hook(begin_step, prepend=True)
    model.register_forward_hook(end_forward)


def _install_sync_control(model: nn.Module, steps: StepState, scalars: ScalarParams, fsdp_root: FSDPModule | None,
                          fsdp_reset) -> None:
    """``set_requires_gradient_sync`` and ``no_sync`` over the fused layers and every FSDP2 unit, and
    ``reset_iter_state`` after an exception."""
    engine = steps.engine
    fsdp_set_sync = fsdp_root.set_requires_gradient_sync if fsdp_root is not None else None

    def reset_iter_state() -> None:
        """After an exception aborted a forward or backward: drop the step's in-flight hops, deferred
        gradients, prefetched weights and no-sync partials (and FSDP2's iteration state), so that the next step
        starts clean. The next forward does this by itself when it finds the previous step unfinished."""
        steps.reset()
        scalars.unshadow()
        if fsdp_reset is not None:
            fsdp_reset()

    def set_requires_gradient_sync(requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Gradient sync on/off for the fused layers and every FSDP2 unit (off: accumulate locally)."""
        engine.requires_grad_sync = requires_gradient_sync
        if fsdp_set_sync is not None:
            fsdp_set_sync(requires_gradient_sync, recurse=recurse)

    @contextlib.contextmanager
    def no_sync() -> Iterator[None]:
        """No gradient communication inside; the next backward outside syncs everything accumulated."""
        set_requires_gradient_sync(False)
        try:
            yield
        finally:
            set_requires_gradient_sync(True)

    model.set_requires_gradient_sync = set_requires_gradient_sync
    model.no_sync = no_sync
    model.reset_iter_state = reset_iter_state
