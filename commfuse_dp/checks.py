"""Ranks checked at ``shard()``: same data-parallel group, same config, same model, before anything is converted.

Ranks that disagree on any of these would not fail at once: they would enter hops of different sizes, or
in a different order, and hang or silently compute wrong gradients, far from the cause. So ``shard()`` starts
with one gather of Python objects over the world (pickled, on the world's ring: ``gather_objects``) of, per rank:

- the ranks of the data-parallel group it was given,
- its ``CommFuseConfig.to_dict()``,
- a digest of the ``(name, shape, dtype, requires_grad)`` of every parameter of the model it is about to shard.

Every rank gets the same answers and so raises the same ``ValueError`` on a mismatch, naming what differs: the
config fields (``schedule: rank 0 has 'fused', rank 1 has 'slicing'``), or, after a second gather of the full
parameter lists (only when the digests differ), the first few parameters whose shape, dtype or ``requires_grad``
differ and the counts of missing and extra ones.

The gathers run on the ring of the world with ``config.timeout_s`` per hop, not through
``dist.all_gather_object``, whose wait is the process group's timeout (30 minutes by default on gloo): a rank that never
calls ``shard()`` (it stopped early, waits in a barrier, or died) makes the others raise ``RingCommError`` naming it
within ``timeout_s``, instead of hanging.
"""

from __future__ import annotations

import hashlib
import pickle
from collections import defaultdict
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from .config import CommFuseConfig
from .handle import handle_of
from .ring.collectives import ring_all_gather
from .ring.topology import get_ring

_SHOWN = 3  # differing parameters named per rank

ParamInfo = tuple[str, tuple[int, ...], str, bool]


def check_ranks_agree(ranks: list[int], config: CommFuseConfig, model: nn.Module, chosen: Any = None) -> None:
    """Raise ``ValueError`` on every rank unless all ranks passed the same mesh (``ranks``: its global ranks, in
    its order), the same config and a model with the same parameters (names, shapes, dtypes, ``requires_grad``).
    With ``chosen`` (``choose.Choice``), after the ``"auto"`` settings were chosen: unless every rank chose the same
    schedule, piece width and collectives (ranks that planned from different inputs, their own batch's tokens,
    would run different collectives). A tensor-parallel model's (``commfuse_dp.tensor_parallel``) groups may
    instead partition the world (one per TP position), each group's models alike. Collective over the world."""
    if chosen is not None:
        mine = (chosen.schedule, chosen.piece_shards, chosen.collectives, chosen.machine)
        everyone = gather_objects(mine, config.timeout_s, CHECK_LABEL)
        if any(c[:3] != everyone[0][:3] for c in everyone):
            detail = "; ".join(f"rank {r}: {c[0]}, piece_shards {c[1]}, {c[2]} ({c[3]})"
                               for r, c in enumerate(everyone))
            raise ValueError(f"shard: the ranks' \"auto\" settings chose differently ({detail}). Give the inputs that "
                             f"differ (CommFuseConfig.tokens_per_rank, link_gbps, tflops) or the schedule itself")
        return
    params = parameter_list(model)
    mine = (list(ranks), config.to_dict(), _digest(params))
    everyone = gather_objects(mine, config.timeout_s, CHECK_LABEL)
    groups = [g for g, _, _ in everyone]
    handle = handle_of(model, through_wrapper=False)
    tensor_parallel = handle is not None and handle.tp is not None
    if any(g != groups[0] for g in groups) and not (tensor_parallel and _partition(groups)):
        detail = "; ".join(f"rank {r}: {g}" for r, g in enumerate(groups))
        raise ValueError(f"shard: the ranks passed different data-parallel groups ({detail}); every rank must "
                         f"pass the same mesh / process group")
    members = sorted({r for g in groups for r in g if r < len(everyone)})  # (beside TP: every group's)
    configs = {r: everyone[r][1] for r in members}
    differing = config_differences(configs)
    if differing:
        raise ValueError(f"shard: the ranks passed different CommFuseConfigs: {'; '.join(differing)}. Pass the same "
                         f"config on every rank (build it from the same YAML file, the same COMMFUSE_* environment "
                         f"or the same arguments everywhere)")
    differ = [g for g in {tuple(g) for g in groups} if len({everyone[r][2] for r in g}) > 1]
    if differ:
        lists = gather_objects(params, config.timeout_s, CHECK_LABEL)  # every rank saw the same digests: all gather again
        raise ValueError(f"shard: the ranks are sharding different models: "
                         f"{'; '.join(model_differences({r: lists[r] for r in sorted(differ)[0]}))}. Build the same model on "
                         f"every rank (same architecture config, same checkpoint, same adapters and frozen "
                         f"parameters) before shard()")


def _partition(groups: list[list[int]]) -> bool:
    """Whether the data-parallel groups the ranks passed are one group, or groups that partition the world (the
    data-parallel groups beside tensor parallelism): each rank in its own, and every member of it passing it."""
    return all(r in g and all(m < len(groups) and groups[m] == g for m in g) for r, g in enumerate(groups))


CHECK_LABEL = ("shard()'s check that every rank passed the same group, config and model (every rank of the world "
               "must call shard() at the same point)")



def gather_objects(obj: Any, timeout_s: float, label: str) -> list[Any]:
    """``obj`` of every rank of the world, rank-major: ``dist.all_gather_object`` on the world's ring, each hop
    bounded by ``timeout_s`` (a rank that does not take part makes the others raise ``RingCommError`` naming it,
    in ``label``). Two ring all-gathers: the lengths of the pickled objects, then the bytes padded to the longest."""
    ring = get_ring(None, caller="shard")
    device = torch.device("cpu") if "gloo" in ring.backend else torch.device("cuda", torch.cuda.current_device())
    data = pickle.dumps(obj)
    lengths = torch.zeros(ring.size, dtype=torch.int64, device=device)
    ring_all_gather(lengths, torch.tensor([len(data)], dtype=torch.int64, device=device), ring.group,
                    timeout_s=timeout_s, label=label)
    sizes = lengths.tolist()
    longest = max(sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    everyone = torch.empty(ring.size * longest, dtype=torch.uint8, device=device)
    ring_all_gather(everyone, mine.to(device), ring.group, timeout_s=timeout_s, label=label)
    rows = everyone.view(ring.size, longest).cpu()
    return [pickle.loads(rows[r, :size].numpy().tobytes()) for r, size in enumerate(sizes)]


def parameter_list(model: nn.Module) -> list[ParamInfo]:
    return [(name, tuple(p.shape), str(p.dtype).removeprefix("torch."), bool(p.requires_grad))
            for name, p in model.named_parameters()]


def _digest(params: list[ParamInfo]) -> str:
    return hashlib.sha256(repr(params).encode()).hexdigest()


def config_differences(configs: dict[int, dict[str, Any]]) -> list[str]:
    """``"field: rank 0 has X, rank 1 has Y"`` for every field whose value is not the same on all ranks."""
    out = []
    fields = list(next(iter(configs.values())))
    for field in fields:
        by_value: dict[str, list[int]] = defaultdict(list)
        for rank, values in configs.items():
            by_value[repr(values.get(field))].append(rank)
        if len(by_value) > 1:
            out.append(f"{field}: " + ", ".join(f"{_ranks(ranks)} {value}" for value, ranks in by_value.items()))
    return out


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]} has" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))} have"


def model_differences(lists: dict[int, list[ParamInfo]]) -> list[str]:
    """Per rank whose parameters differ from the first rank's: the first few differing parameters (shape, dtype,
    requires_grad) and the counts of missing and extra ones."""
    ranks = list(lists)
    ref_rank = ranks[0]
    ref = {name: info for name, *info in lists[ref_rank]}
    out = []
    for rank in ranks[1:]:
        theirs = {name: info for name, *info in lists[rank]}
        if lists[rank] == lists[ref_rank]:
            continue
        changed = [n for n in ref if n in theirs and theirs[n] != ref[n]]
        missing = [n for n in ref if n not in theirs]
        extra = [n for n in theirs if n not in ref]
        parts = []
        if changed:
            shown = ", ".join(f"{n} (rank {ref_rank} has {_info(ref[n])}, rank {rank} has {_info(theirs[n])})"
                              for n in changed[:_SHOWN])
            more = f" and {len(changed) - _SHOWN} more" if len(changed) > _SHOWN else ""
            parts.append(f"{len(changed)} parameters differ: {shown}{more}")
        for what, names in (("missing", missing), ("extra", extra)):
            if names:
                more = ", ..." if len(names) > _SHOWN else ""
                parts.append(f"{len(names)} {what} on rank {rank} ({', '.join(names[:_SHOWN])}{more})")
        if not parts:
            at = next(i for i, (a, b) in enumerate(zip(lists[ref_rank], lists[rank])) if a != b)
            parts.append(f"the same parameters in another order (position {at}: rank {ref_rank} has "
                         f"{lists[ref_rank][at][0]}, rank {rank} has {lists[rank][at][0]})")
        out.append(f"rank {rank} differs from rank {ref_rank}: " + ", ".join(parts))
    return out


def _info(info: list) -> str:
    shape, dtype, requires_grad = info
    return f"shape {tuple(shape)} {dtype}" + ("" if requires_grad else " frozen")


_DEEPSPEED_PARAM_ATTRS = ("ds_id", "ds_tensor", "ds_status")  # set by deepspeed.zero.Init / ZeRO-3 partitioning


def check_not_deepspeed(model: nn.Module) -> None:
    """Raise ``ValueError`` if DeepSpeed shards ``model`` already: it is a DeepSpeed engine, or ZeRO-3
    (``deepspeed.initialize`` with stage 3, or ``deepspeed.zero.Init``) partitioned its parameters (they carry
    ``ds_id`` / ``ds_tensor``). commfuse sharding and ZeRO's partitioning of one model exclude each other; local,
    no communication."""
    if any(cls.__module__.split(".")[0] == "deepspeed" for cls in type(model).__mro__):
        raise ValueError(f"shard: this model is a DeepSpeed {type(model).__name__}, which shards it already; pass "
                         f"the plain model to shard() and not to deepspeed.initialize, or keep DeepSpeed and switch "
                         f"its collectives to the rings with commfuse_dp.integrations.deepspeed."
                         f"enable_ring_collectives(engine)")
    for name, param in model.named_parameters():
        attrs = [a for a in _DEEPSPEED_PARAM_ATTRS if hasattr(param, a)]
        if attrs:
            raise ValueError(f"shard: parameter {name!r} is partitioned by DeepSpeed ZeRO-3 (it carries "
                             f"{', '.join(attrs)}); commfuse_dp.shard and ZeRO-3 cannot both shard one model. Build "
                             f"the model outside deepspeed.zero.Init and do not give it to deepspeed.initialize to "
                             f"shard it with commfuse, or keep ZeRO-3 and call commfuse_dp.integrations.deepspeed."
                             f"enable_ring_collectives(engine) to run its collectives on the rings")


def check_not_sharded_elsewhere(model: nn.Module) -> None:
    """Raise ``ValueError`` if another library shards ``model`` already: DeepSpeed (:func:`check_not_deepspeed`), or
    FSDP2 (``fully_shard``, or transformers' ``from_pretrained(..., distributed_config=...)``: FSDP2 units or
    DTensor parameters). Each message names what to do instead. Local, no communication; ``shard()`` and
    ``commfuse_dp.integrations.attach`` both start with it."""
    check_not_deepspeed(model)
    tp = next((p.device_mesh.size(p.device_mesh.mesh_dim_names.index("tp")) for p in model.parameters()
               if isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ())), 1)
    if tp > 1:
        raise ValueError(f"shard: transformers made this model tensor-parallel itself (from_pretrained(..., "
                         f"distributed_config=DistributedConfig(tp_size={tp}, ...)): its DTensor layers, FSDP2 on "
                         f"top); for the fused TP layers load it without distributed_config (device 'meta' holds no "
                         f"whole copy: docs/tensor_parallel.md) and call shard(model, commfuse_dp.tp."
                         f"from_distributed_config(<that DistributedConfig>))")
    if any(isinstance(m, FSDPModule) for m in model.modules()) or any(
            isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError("shard: this model is sharded already (FSDP2 fully_shard, or transformers' from_pretrained("
                         "..., distributed_config=DistributedConfig(...))); shard() needs the unsharded model. Load "
                         "or build it without sharding and call shard(model), or keep that sharding and call "
                         "commfuse_dp.integrations.fsdp.use_ring_collectives(model) to run its collectives on rings")


def check_same_layout(target: nn.Module, source: nn.Module, what: str) -> None:
    """Raise ``ValueError`` unless ``target``'s and ``source``'s parameters, zipped in order, can be mixed shard
    against shard on every rank (``target.data.mul_(1 - a).add_(source.data, alpha=a)``, TRL's ``sync_ref_model``):
    both sharded alike (DTensors on one mesh, same placements, same local shapes) or both plain of one shape.
    ``what`` names the mixing in the message. The parameters are the same on every rank, so every rank raises."""
    pairs = list(zip(target.named_parameters(), source.named_parameters()))
    counts = (sum(1 for _ in target.parameters()), sum(1 for _ in source.parameters()))
    if counts[0] != counts[1]:
        raise ValueError(f"{what}: the models have {counts[0]} and {counts[1]} parameters; the mix pairs them one "
                         f"by one, so they must be the same model")
    for (name, t), (_, s) in pairs:
        if isinstance(t, DTensor) != isinstance(s, DTensor):
            sharded = "the trained model" if isinstance(s, DTensor) else "the mixed-into model"
            raise ValueError(
                f"{what}: {name} is sharded in {sharded} only, and the mix would add a shard to a full tensor. "
                f"Shard both: keep CommFuseConfig.shard_frozen on (the default), and let the Trainer "
                f"prepare the reference (commfuse_trainer(...) or CommFuseTrainer; a plain Trainer with the "
                f"callback alone leaves it whole), or commfuse_dp.shard() it yourself with the same config")
        if isinstance(t, DTensor):
            same = (t.device_mesh == s.device_mesh and t.placements == s.placements
                    and t.to_local().shape == s.to_local().shape and t.shape == s.shape)
            shapes = f"{tuple(t.shape)} {t.placements} and {tuple(s.shape)} {s.placements}"
        else:
            same, shapes = t.shape == s.shape, f"{tuple(t.shape)} and {tuple(s.shape)}"
        if not same:
            raise ValueError(f"{what}: {name} is laid out differently in the two models ({shapes}). Shard both with "
                             f"the same CommFuseConfig (and schedule), on the same model class and config")
