"""A tensor-parallel model's sharded state in DCP's terms, so that its checkpoints reshard.

Under ``CommFuseConfig(tp_size=N)`` a split parameter (``TensorParallel.sharded``: q/k/v/gate/up rows, o/down
columns, the vocabulary rows of the embedding and lm_head) is on each rank an FSDP2 DTensor over the data-parallel
mesh whose global shape is only that TP rank's part: every TP rank would write chunks of a different tensor under
one name. ``as_chunks`` puts in its place, for DCP, a ``ShardedTensor`` of the whole parameter whose one local shard
is this rank's rows of its TP part, at their offsets in the whole (the TP part's offset along the split dimension,
FSDP2's rows along dimension 0), sharing the DTensor's storage: ``dcp.save`` writes each rank's rectangle of the
whole tensor, and ``dcp.load`` reads into it in place from any layout, so a checkpoint saved at TP 2 x FSDP 2
loads at TP 4, at FSDP 4 without TP, or in one process. The optimizer's state of that parameter (AdamW's moments)
gets the same. DTensor's own placements cannot say this: FSDP2's rows of a TP part that is itself rows of the
whole are a strided sharding, and the vocabulary splits as ``torch.tensor_split`` does (the first ranks one row
more), not as ``torch.chunk`` does.

Each rank lists the rectangles of the ranks of its own data-parallel copy (HSDP's other copies hold the same ones;
DCP writes a rectangle once). Parameters that TP keeps whole (norms) stay as FSDP2 gave them.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard as ShardPlacement

from ..handle import handle_of
from .common import _unwrap
from ..tp.rings import seq_split


def tensor_parallel_of(model: torch.nn.Module):
    """The model's ``TensorParallel`` (``None`` where it is not tensor-parallel)."""
    handle = handle_of(model)
    if handle is None and hasattr(model, "module"):
        handle = handle_of(model.module)
    return handle.tp if handle is not None else None


def as_chunks(models: list[torch.nn.Module], optimizers: list[tuple[torch.nn.Module, torch.optim.Optimizer]],
              state: dict[str, Any]) -> list[tuple[dict, Any, Any]]:
    """Put the whole-tensor view in place of every split tensor of ``state`` (``_state``'s ``model_<i>`` and
    ``optimizer_<i>`` entries), in place; returns what ``put_back`` needs to undo it."""
    undo: list[tuple[dict, Any, Any]] = []
    for i, model in enumerate(models):
        tp = tensor_parallel_of(model)
        entries = state.get(f"model_{i}")
        if tp is None or entries is None:
            continue
        split = _split_names(model, tp)
        for name, value in list(entries.items()):
            if name in split:
                undo.append((entries, name, value))
                entries[name] = _whole(tp, split[name], name, value)
    for i, (model, _) in enumerate(optimizers):
        tp = tensor_parallel_of(model)
        entries = state.get(f"optimizer_{i}")
        if tp is None or entries is None:
            continue
        split = _split_names(model, tp)
        for name, per_param in entries.get("state", {}).items():
            if name not in split:
                continue
            for key, value in list(per_param.items()):
                if isinstance(value, torch.Tensor) and value.dim() > 0:  # (not AdamW's step count)
                    undo.append((per_param, key, value))
                    per_param[key] = _whole(tp, split[name], name, value)
    if undo:  # (torch warns of ShardedTensor on every save and load; it is what DCP reads such chunks from)
        warnings.filterwarnings("ignore", message="Please use DTensor instead and we are deprecating ShardedTensor",
                                category=FutureWarning)
    return undo


def _split_names(model: torch.nn.Module, tp) -> dict[str, tuple[int, int, int, int]]:
    """Every name of a split parameter (a tied table's other name too: ``lm_head.weight`` beside
    ``model.embed_tokens.weight``) -> its ``(dim, start, count, whole)``."""
    inner = _unwrap(model)  # (the names of its state dict)
    by_param: dict[int, list[str]] = {}
    for name, param in inner.named_parameters(remove_duplicate=False):
        by_param.setdefault(id(param), []).append(name)
    split = dict(tp.sharded)
    for names in by_param.values():
        record = next((tp.sharded[n] for n in names if n in tp.sharded), None)
        if record is not None:
            split.update((n, record) for n in names)
    return split


def put_back(undo: list[tuple[dict, Any, Any]]) -> None:
    """The state as ``_state`` made it again (its tensors hold what ``dcp.load`` read into the views)."""
    for entries, key, value in reversed(undo):
        entries[key] = value


def _whole(tp, record: tuple[int, int, int, int], name: str, value: torch.Tensor) -> ShardedTensor:
    dim, start, count, whole = record
    counts, offsets = seq_split(whole, tp.size)
    if (offsets[tp.rank], counts[tp.rank]) != (start, count):
        raise AssertionError(f"checkpoint: {name}: TP rank {tp.rank} holds {start}:{start + count} of {whole} "
                             f"along dim {dim}, not torch.tensor_split's {offsets[tp.rank]}:"
                             f"{offsets[tp.rank] + counts[tp.rank]}")
    local, part_shape, shards, my_shard = _data_parallel_rows(value)
    shape = list(part_shape)
    shape[dim] = whole
    ranks = _ranks_of_my_copy(tp)  # [data-parallel shard][TP rank] -> global rank
    device = local.device
    metadata, mine = [], None
    for s in range(shards):
        for t in range(tp.size):
            part = list(part_shape)
            part[dim] = counts[t]
            rows = math.ceil(part[0] / shards) if shards > 1 else part[0]  # FSDP2's torch.chunk of dim 0
            lo, hi = min(s * rows, part[0]), min((s + 1) * rows, part[0])
            if hi <= lo and s > 0:
                continue  # (no rows here: FSDP2's chunks of a short part leave the last ranks empty)
            at, sizes = [0] * len(shape), list(part)
            at[0], sizes[0] = lo, hi - lo
            at[dim] += offsets[t]
            meta = ShardMetadata(shard_offsets=at, shard_sizes=sizes,
                                 placement=f"rank:{ranks[s][t]}/{_device_name(device)}")
            metadata.append(meta)
            if (s, t) == (my_shard, tp.rank):
                mine = meta
    if mine is None or list(local.shape) != mine.shard_sizes:
        raise AssertionError(f"checkpoint: {name}: this rank's shard {tuple(local.shape)} is not FSDP2's rows of "
                             f"its TP part {tuple(part_shape)} over {shards} ranks")
    properties = TensorProperties(dtype=local.dtype, layout=torch.strided, requires_grad=local.requires_grad,
                                  memory_format=torch.contiguous_format, pin_memory=local.is_pinned())
    global_meta = ShardedTensorMetadata(shards_metadata=metadata, size=torch.Size(shape),
                                        tensor_properties=properties)
    return ShardedTensor._init_from_local_shards_and_global_metadata([Shard(local, mine)], global_meta)


def _data_parallel_rows(value: torch.Tensor) -> tuple[torch.Tensor, torch.Size, int, int]:
    """(this rank's rows, the TP part's shape, data-parallel shards, this rank's shard) of an FSDP2 DTensor of a
    TP part (``Shard(0)`` on its data-parallel mesh dimension; HSDP: ``Replicate()`` on the other), or of a plain
    tensor (the whole TP part)."""
    if not isinstance(value, DTensor):
        return _storage(value), value.shape, 1, 0
    sharded = [d for d, p in enumerate(value.placements) if isinstance(p, ShardPlacement)]
    if len(sharded) > 1 or (sharded and value.placements[sharded[0]].dim != 0):
        raise NotImplementedError(f"checkpoint: a tensor-parallel part with placements {value.placements}: "
                                  f"expected FSDP2's Shard(0) over the data-parallel ranks")
    local = _storage(value.to_local())
    if not sharded:
        return local, value.shape, 1, 0
    mesh = value.device_mesh
    return local, value.shape, mesh.size(sharded[0]), mesh.get_local_rank(sharded[0])


def _storage(local: torch.Tensor) -> torch.Tensor:
    """``local`` itself, detached (``dcp.load`` reads into it in place)."""
    if not local.is_contiguous():
        raise NotImplementedError("checkpoint: a tensor-parallel shard that is not contiguous; DCP reads into it "
                                  "in place")
    return local.detach()


def _ranks_of_my_copy(tp) -> list[list[int]]:
    """The global ranks of this rank's data-parallel copy: ``[dp_shard][tp]``."""
    mesh = tp.mesh
    if mesh is None:  # (TP alone: one data-parallel shard)
        import torch.distributed as dist
        return [dist.get_process_group_ranks(tp.group)]
    grid = mesh.mesh
    if grid.dim() == 3:  # (dp_replicate, dp_shard, tp)
        grid = grid[mesh.get_local_rank("dp_replicate")]
    return grid.tolist()


def _device_name(device: torch.device) -> str:
    return f"cuda:{device.index}" if device.type == "cuda" and device.index is not None else device.type
