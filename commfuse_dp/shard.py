"""``shard(model, config)``: turn a model into a CommFuse-sharded model, in place.

1. Every eligible linear (``nn.Linear``, HF ``Conv1D``) whose weight shard has at least ``min_fuse_numel``
   elements becomes a ring-fused layer (``fused/``): its weight and bias become DTensor shards on a 1-D data-parallel
   mesh, and its forward and backward run the fused rings. Linears that read the same input (``q/k/v``,
   ``query/key/value``, ``gate/up``) share ring steps; under the elastic schedule so do a unit's groups, and a
   small linear is fused where its unit has a large one.
2. Every ``nn.Embedding`` with a large enough, untied table becomes a ring embedding (``fused/embedding.py``,
   ``CommFuseConfig.ring_embeddings``): sharded by rows, it exchanges looked-up rows instead of the table when
   that moves fewer bytes.
3. Everything else (norms, small embeddings, small or tied linears, other modules) is sharded by stock FSDP2
   ``fully_shard``, unit by unit (the model's ``_no_split_modules`` classes, else the entries of its layer list),
   with the fused parameters passed as ``ignored_params``, and its collectives switched to the bucketed rings.
4. The model gains ``set_requires_gradient_sync(flag)`` / ``no_sync()`` covering both parts (gradient accumulation),
   and ``commfuse_dp.step_stats(model)`` reports the last step's timing; ``commfuse_dp.describe(model)`` what was
   fused and what each part moves.

Before anything is converted the ranks check that they pass the same group, config and model (``checks.py``).
Modules named by ``CommFuseConfig.exclude`` and modules the model calls data-dependently (MoE experts, LayerDrop
layers: ``lockstep.py``) stay out of the fused path and out of FSDP2 units of their own, so that every rank enters
the same ring steps in the same order.

Any torch optimizer built afterwards on ``model.parameters()`` keeps sharded state (ZeRO-3 memory).

A model built on the ``meta`` device (``with torch.device("meta"): model = AutoModelForCausalLM.from_config(cfg)``)
is sharded the same way, and then every rank allocates only its own shards on the real device (``to_empty``), so
the whole model never exists on one rank. Its parameters are then uninitialised until the weights are loaded
(``commfuse_dp.checkpoint.load_hf_weights``); its buffers are recomputed by transformers' own initialisation.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter, defaultdict
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor

from . import lockstep
from .checks import check_not_deepspeed, check_ranks_agree
from .choose import resolve
from .config import CommFuseConfig
from .describe import warn_if_little_fused
from .fused.embedding import convert_embedding, embedding_eligible
from .fused.modules import attach_group, convert_linear
from .fused.reads import ParamBindings, attach_reads
from .nonfinite import NonfiniteCheck
from .ring.fsdp_comm import use_ring_collectives
from .ring.topology import get_ring
from .runtime import step_state
from .runtime.engine import Engine
from .runtime.layout import conv1d_class
from .runtime.replicas import Replicas
from .runtime.step import StepState
from .scalars import ScalarParams
from .stats import StepStats

logger = logging.getLogger("commfuse_dp")

SHARED_INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"), ("gate_proj", "up_proj"))


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
    config = config if config is not None else CommFuseConfig()
    requested = device
    if getattr(model, "_commfuse_engine", None) is not None:
        raise ValueError("shard: this model is sharded already; call shard() once per model")
    check_not_deepspeed(model)  # ZeRO-3 / a DeepSpeed engine shards it already (checks.py)
    if any(isinstance(m, FSDPModule) for m in model.modules()) or any(
            isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError("shard: this model is sharded already (FSDP2 fully_shard, or transformers' from_pretrained("
                         "..., distributed_config=DistributedConfig(...))); shard() needs the unsharded model. Load "
                         "or build it without sharding and call shard(model), or keep that sharding and call "
                         "commfuse_dp.integrations.fsdp.use_ring_collectives(model) to run its collectives on rings")
    device = _single_device(model)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("shard: torch.distributed is not initialised. Call torch.distributed."
                           "init_process_group(...) first (torchrun / accelerate launch set it up)")
    on_meta = device.type == "meta"
    if on_meta:
        device = _materialise_device(requested, mesh)
    elif requested is not None:
        raise ValueError(f"shard: device= is for a model on the meta device (where its shards are allocated); this "
                         f"model is on {device} already. Move it with model.to(...) before shard() instead")
    mesh = _data_parallel_mesh(mesh, config, device)
    if mesh.device_type != device.type:
        raise ValueError(f"shard: the model is on {device} but the mesh is on {mesh.device_type}; "
                         f"move the model to the mesh's device first")
    group = mesh.get_group(mesh.ndim - 1)  # the shard dimension: the fused rings run here
    everyone = mesh.mesh.flatten().tolist()
    one_node = device.type != "cuda" or dist.get_world_size() <= torch.cuda.device_count()
    # "auto" settings from the planner's plays (choose.py): the same on every rank, which the check below confirms
    config, choice = resolve(model, config, dist.get_world_size(group), device, one_node)
    check_ranks_agree(everyone, config, model)  # same mesh, config and parameters on every rank (checks.py)
    replicas = None
    if mesh.ndim == 2:
        replicas = Replicas(mesh.get_group(0), config.ring_kwargs)
    world_ring = get_ring(group if mesh.ndim == 1 else dist.group.WORLD, op="shard")  # 2-D: every rank
    engine = Engine(get_ring(group, op="shard"), mesh, config, world_ring, replicas)
    steps = step_state(engine)
    names = {id(m): name or "(root)" for name, m in model.named_modules()}

    data_dependent = lockstep.data_dependent_modules(model)
    excluded = lockstep.exclusions(model, config.exclude, data_dependent, config.exclude_data_dependent)
    peer = config.schedule == "fsdp2"  # nothing fused: FSDP2's units and its GPU schedule on the rings
    tied = {} if peer else _tied_tables(model, config, engine.ring.size, excluded)  # {id(table): (embedding, lm_head)}
    unit_modules = _units(model, units, not_units=lockstep.inside(model, data_dependent))
    fused = [] if peer else _fusable_linears(model, config, engine.ring.size, excluded, tied, unit_modules)
    fused_params: set[nn.Parameter] = set()
    bound: list[tuple[str, nn.Module, dict[str, int]]] = []  # fused modules and their sharded params' dims
    for name, module, transposed in fused:
        fused_params.update(convert_linear(module, engine, transposed))
        bound.append((name, module, {"weight": 1 if transposed else 0, "bias": 0}))
    for members in _shared_input_groups(fused):
        attach_group(steps, [m for _, m, _ in members], [names[id(m)] for _, m, _ in members])
    for _, lm_head in tied.values():
        lm_head._cf_group.state.tied = True
    if config.ring_embeddings and not peer:
        for module in _ring_embeddings(model, config, engine.ring.size, excluded, tied):
            pair = tied.get(id(module.weight))  # the lm_head that shares this table was sharded above: use its shards
            fused_params.add(convert_embedding(module, steps, names[id(module)],
                                               table=pair[1]._parameters["weight"] if pair is not None else None))
            bound.append((names[id(module)], module, {"weight": 0}))
    for name, module, dims in bound:
        attach_reads(steps, module, name, dims)  # module.weight read from outside: full value, summed gradient
    if replicas is not None:  # HSDP: the order in which their gradients cross the copies (the same on every rank)
        replicas.track(module._parameters[p] for _, module, dims in bound for p in dims
                       if module._parameters.get(p) is not None)

    scalars = ScalarParams(model, mesh, engine)  # 0-d: fully_shard refuses them; replicated, averaged (scalars.py)
    kept_out = fused_params | scalars.params  # what fully_shard leaves alone
    mp_policy = MixedPrecisionPolicy(param_dtype=config.param_dtype, reduce_dtype=config.reduce_dtype)
    _bundle_units(steps, unit_modules)
    if units is None and not peer:  # (FSDP2's shape: every decoder layer a unit of its own)
        unit_modules = [u for u in unit_modules
                        if _unfused_numel(u, kept_out) // engine.ring.size >= max(config.min_fuse_numel, 1)]
    for unit in unit_modules:
        if any(p not in kept_out for p in unit.parameters()):
            fully_shard(unit, mesh=mesh, mp_policy=mp_policy, ignored_params=kept_out)
    if any(p not in kept_out for p in model.parameters()):
        fully_shard(model, mesh=mesh, mp_policy=mp_policy, ignored_params=kept_out)
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        use_ring_collectives(model, config, recorder=engine.stats, overlap=peer)
    if isinstance(model, FSDPModule) and callable(getattr(model, "generate", None)):
        # generate() may call submodules directly (T5's encoder): the root's parameters must be gathered for it
        register_fsdp_forward_method(model, "generate")
    lockstep.reduce_unused_params(model, data_dependent)
    lockstep.mark_fsdp_managed(model)
    _install(model, steps, ParamBindings(model, bound), scalars)
    if on_meta:
        _materialise(model, device)
    for state in steps.states:  # each group's local shards as views of one buffer that its rings send as it is
        state.adopt_packed()
    model._commfuse_excluded = dict(excluded.reasons)
    model._commfuse_choice = choice
    logger.info("commfuse_dp.shard: %d linears fused (%s schedule: %s), %d FSDP2 units + root, %d ranks",
                len(fused), config.schedule, choice.reason, len(unit_modules), engine.ring.size)
    if not peer:
        warn_if_little_fused(model, config)
    return model


def _data_parallel_mesh(mesh: DeviceMesh | None, config: CommFuseConfig, device: torch.device) -> DeviceMesh:
    """The 1-D shard mesh, or for HSDP the 2-D ``(replicate, shard)`` one: ``mesh`` as given, else built over the
    world from ``config.replicate`` (consecutive ranks share a copy)."""
    world = dist.get_world_size()
    if mesh is None:
        r = config.replicate
        if world % r:
            raise ValueError(f"shard: CommFuseConfig.replicate={r} does not divide the {world} ranks; the copies "
                             f"must be of equal size (e.g. replicate = the number of nodes)")
        if r == 1:
            return init_device_mesh(device.type, (world,))
        return init_device_mesh(device.type, (r, world // r), mesh_dim_names=("replicate", "shard"))
    if mesh.ndim not in (1, 2):
        raise ValueError(f"shard: the data-parallel mesh must be 1-D (shard) or 2-D (replicate, shard), got "
                         f"{mesh.ndim} dimensions")
    if config.replicate != 1 and (mesh.ndim != 2 or mesh.size(0) != config.replicate):
        raise ValueError(f"shard: CommFuseConfig.replicate={config.replicate} but the mesh passed has shape "
                         f"{tuple(mesh.shape)}; give one of them (the mesh's first dimension is the replicas)")
    if mesh.ndim == 2 and mesh.size() != world:
        raise ValueError(f"shard: a 2-D (HSDP) mesh must hold every rank of the world ({world}); it holds "
                         f"{mesh.size()}")
    return mesh


def step_stats(model: nn.Module) -> StepStats:
    """Timing of the last completed step of this rank (the current one if none completed yet)."""
    engine = getattr(model, "_commfuse_engine", None)
    if engine is None:
        raise ValueError("step_stats: this model was not sharded with commfuse_dp.shard()")
    if not engine.stats.enabled:
        raise ValueError("step_stats: statistics are off (CommFuseConfig(stats=False))")
    return engine.stats.last or engine.stats.current()


# ---- what to fuse ----------------------------------------------------------------------------------------

def _fusable_linears(model: nn.Module, config: CommFuseConfig, world: int, excluded: lockstep.Exclusions,
                     tied_tables: dict[int, tuple[nn.Embedding, nn.Linear]],
                     unit_modules: list[nn.Module]) -> list[tuple[str, nn.Module, bool]]:
    conv1d = conv1d_class()
    owners = _param_owners(model)
    fused, candidates, small, tied, other = [], [], 0, 0, Counter()
    for name, module in model.named_modules():
        if excluded.why(name):
            continue  # logged by lockstep.exclusions
        kind = type(module)
        if kind is nn.Linear or (conv1d is not None and kind is conv1d):
            if id(module.weight) in tied_tables:
                fused.append((name, module, False))  # the lm_head of a tied table (_tied_tables)
            elif owners[id(module.weight)] > 1 or (module.bias is not None and owners[id(module.bias)] > 1):
                tied += 1  # shared with another module: FSDP2 keeps both uses in one unit
            else:
                candidates.append((name, module, kind is not nn.Linear))
        elif isinstance(module, nn.Linear) or (conv1d is not None and isinstance(module, conv1d)):
            other[kind.__name__] += 1
    # Linears that read the same input ride the same ring steps, so they are judged together: GQA's k_proj and
    # v_proj, each below min_fuse_numel, are fused with q_proj when the group's shard is large enough. Under the
    # elastic schedule every fused group of a unit rides that unit's ring steps (one bundle per step), so a small
    # group in a unit with a large one is fused too: at 8 ranks a 512-wide o_proj (a 32768-element shard) then
    # costs no ring latency of its own, where unfused it would join the root unit's gather at the step's head.
    small_groups = []
    for group in _shared_input_groups(candidates):
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
                        "of their unit, whose ring steps they share", sum(len(g) for g in rides),
                        config.min_fuse_numel)
    small = sum(len(g) for g in small_groups)
    if small:
        logger.info("commfuse_dp: %d linears have weight shards (summed with the linears that read the same input, "
                    "q/k/v, gate/up) below min_fuse_numel=%d elements and go through the bucketed rings instead",
                    small, config.min_fuse_numel)
    if tied:
        logger.info("commfuse_dp: %d linears share their weight with another module in a way that is not fused "
                    "(see _tied_tables) and go through the bucketed rings", tied)
    for kind_name, count in other.items():
        logger.info("commfuse_dp: %d modules of type %s are not fused (only nn.Linear and Conv1D themselves are; "
                    "a subclass may use its weight in its own way); they go through the bucketed rings",
                    count, kind_name)
    return fused


def _param_owners(model: nn.Module) -> Counter[int]:
    """How many modules hold each parameter (more than one: tied weights)."""
    return Counter(id(p) for m in model.modules() for p in m.parameters(recurse=False))


def _tied_tables(model: nn.Module, config: CommFuseConfig, world: int,
                 excluded: lockstep.Exclusions) -> dict[int, tuple[nn.Embedding, nn.Linear]]:
    """Tied input and output embeddings that are fused together: an ``nn.Embedding`` whose table is the weight of
    one ``nn.Linear`` (the lm_head of GPT-2, Llama-3.2, Qwen2.5, Gemma) and of nothing else, whose bias (if any)
    is its own, both eligible on their own. The table is sharded by vocabulary rows once; the fused lm_head and the ring embedding use the
    same shards, and both gradients sum into its one ``.grad``. Keyed by ``id`` of the shared weight."""
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


def _ring_embeddings(model: nn.Module, config: CommFuseConfig, world: int, excluded: lockstep.Exclusions,
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


def _shared_input_groups(linears: list[tuple[str, nn.Module, bool]]) -> list[list[tuple[str, nn.Module, bool]]]:
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


def _unfused_numel(unit: nn.Module, fused_params: set[nn.Parameter]) -> int:
    return sum(p.numel() for p in unit.parameters() if p not in fused_params)


def _innermost_unit(unit_modules: list[nn.Module]) -> dict[int, int]:
    """``id(module)`` -> index of the innermost unit module around it (``unit_modules`` is innermost first)."""
    innermost: dict[int, int] = {}
    for at, unit in enumerate(unit_modules):
        for module in unit.modules():
            innermost.setdefault(id(module), at)
    return innermost


def _bundle_units(steps: StepState, unit_modules: list[nn.Module]) -> None:
    """Each fused group's unit (``FusedGroupState.unit``): the innermost unit module around it, also where that
    unit is too small to be an FSDP2 unit of its own. The elastic schedule bundles the ring steps of a unit's
    groups (``runtime/schedule.py``)."""
    innermost = _innermost_unit(unit_modules)
    for state in steps.states:
        state.unit = innermost.get(id(state.modules[0]))


def _units(model: nn.Module, units: tuple[type[nn.Module], ...] | None, not_units: set[int]) -> list[nn.Module]:
    """FSDP2 units, innermost first. A module in ``not_units`` (ids: data-dependently called modules and the
    modules inside them, ``lockstep.py``) is never one: it joins its parent's unit."""
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
    lockstep.log_dropped_units(chosen, lockstep_safe)
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


# ---- a model built on the meta device --------------------------------------------------------------------

def _materialise_device(requested: torch.device | str | None, mesh: DeviceMesh | None) -> torch.device:
    """Where a meta model's shards are allocated: ``requested``, else the mesh's device type, else the current
    CUDA device if there is one, else the CPU (a CUDA device without an index: the current one)."""
    if requested is not None:
        device = torch.device(requested)
    elif mesh is not None:
        device = torch.device(mesh.device_type)
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "meta":
        raise ValueError("shard: device='meta' is where the model is already; pass the device its shards should be "
                         "allocated on (device='cuda' or 'cpu')")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _refuse_empty_weights(module: nn.Module, args) -> None:
    raise RuntimeError("this model was sharded on the meta device and its parameters are still uninitialised "
                       "(empty memory). Load its weights first: commfuse_dp.checkpoint.load_hf_weights(model, folder) "
                       "for a Hugging Face folder, or checkpoint.load_sharded(...) to resume; if you initialised them "
                       "yourself, call commfuse_dp.checkpoint.mark_initialised(model)")


def _materialise(model: nn.Module, device: torch.device) -> None:
    """Allocate every shard (and buffer) of a sharded meta model on ``device``: ``to_empty`` replaces each meta
    tensor by an uninitialised one of the same (local) shape, so each rank allocates its own shards only (FSDP2's
    ``_apply`` re-pads its sharded parameters; DTensor's ``empty_like`` keeps the local shape). Then the
    non-persistent buffers are recomputed, and a forward is refused until the weights are loaded."""
    model.to_empty(device=device)
    _init_buffers(model)
    model._commfuse_empty_weights = model.register_forward_pre_hook(_refuse_empty_weights, prepend=True)


def _init_buffers(model: nn.Module) -> None:
    """Recompute the buffers of a model just taken off the meta device, the way ``from_pretrained`` does
    (transformers 5: ``_move_missing_keys_from_meta_to_device`` then ``initialize_weights``): every parameter is
    flagged ``_is_hf_initialized`` so that transformers' guarded init functions leave it alone, and only the
    buffers (rotary ``inv_freq``, ``position_ids``, norm statistics) get their values. Persistent buffers are
    loaded again with the weights anyway."""
    buffers = [name for name, _ in model.named_buffers()]
    if not buffers:
        return
    initialize = getattr(model, "initialize_weights", None)
    if not callable(initialize) or not hasattr(model, "_init_weights"):
        non_persistent = [name for name, _ in _non_persistent_buffers(model)]
        if non_persistent:
            logger.warning("commfuse_dp.shard: %s is no transformers PreTrainedModel, so its non-persistent buffers "
                           "%s are left uninitialised after leaving the meta device; set them yourself after "
                           "shard() (persistent buffers are loaded with the weights)",
                           type(model).__name__, ", ".join(non_persistent))
        return
    params = list(model.parameters())
    flagged = [p for p in params if not getattr(p, "_is_hf_initialized", False)]
    for p in flagged:
        p._is_hf_initialized = True
    modules_before = {id(m) for m in model.modules() if getattr(m, "_is_hf_initialized", False)}
    try:
        initialize()
    finally:
        for p in flagged:
            del p._is_hf_initialized
        for m in model.modules():
            if id(m) not in modules_before and "_is_hf_initialized" in m.__dict__:
                del m._is_hf_initialized


def _non_persistent_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for module_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if name in module._non_persistent_buffers_set:
                yield f"{module_name}.{name}" if module_name else name, buf


def _refuse_resize(*args, **kwargs) -> None:
    raise RuntimeError("resize_token_embeddings after commfuse_dp.shard(): the embedding table and the lm_head are "
                       "sharded over the ranks and cannot change shape. Resize before shard() (add the tokens to "
                       "the tokenizer, call model.resize_token_embeddings(len(tokenizer)), then shard the model)")


# ---- what the model gains ---------------------------------------------------------------------------------

def _install(model: nn.Module, steps: StepState, bindings: ParamBindings, scalars: ScalarParams) -> None:
    engine = steps.engine
    fsdp_root = model if isinstance(model, FSDPModule) else None
    fsdp_set_sync = fsdp_root.set_requires_gradient_sync if fsdp_root is not None else None
    # FSDP2's recovery after a step that raised (torch 2.13; torch 2.11, met on the GPU check, has none)
    fsdp_reset = getattr(fsdp_root, "reset_iter_state", None) if fsdp_root is not None else None

    @torch.compiler.disable
    def begin_step(module, args) -> None:
        bindings.check()  # a fused module replaced, or its parameter rebound, since shard(): refuse, say what
        if steps.begin_step() and fsdp_reset is not None:  # the previous step raised: FSDP2's part too
            fsdp_reset()
        scalars.begin_step()

    fsdp_units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if engine.config.nonfinite_grads != "off":
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
            for unit in fsdp_units:
                unit.reshard()

    def reset_iter_state() -> None:
        """After an exception aborted a forward or backward: drop the step's in-flight ring steps, deferred
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

    model.register_forward_pre_hook(begin_step, prepend=True)
    model.register_forward_hook(end_forward)
    model.set_requires_gradient_sync = set_requires_gradient_sync
    model.no_sync = no_sync
    model.reset_iter_state = reset_iter_state
    model.__deepcopy__ = engine.__deepcopy__  # before FSDP2's own refusal, which does not say what to do
    if callable(getattr(model, "resize_token_embeddings", None)):
        model.resize_token_embeddings = _refuse_resize
    model._commfuse_engine = engine
    model._commfuse_steps = steps
