"""Hugging Face safetensors of a sharded model, slice by slice: the in-place writer behind
``commfuse_dp.checkpoint.save_pretrained`` and the slice reader behind ``load_hf_weights``.

A safetensors file is: 8 bytes (little-endian header length), a JSON header {name: {dtype, shape, data_offsets}}
padded with spaces, then every tensor's bytes in row-major order at its data_offsets. Since every rank knows every
tensor's global shape and dtype, the main rank writes the headers and sizes the files, and each rank writes the
rows it owns at their offsets (a Shard(0) slice is one contiguous range; a Shard(1) slice one range per row). A
tensor-parallel model's split parameters (``TensorParallel.sharded``) are written at their whole shape, each rank's
block at its part's offset along the split dimension plus its data-parallel shard's; the parameters every TP rank
holds whole are written by TP rank 0's ranks.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
from typing import Any

import torch
import torch.distributed as dist

from .tp_state import tensor_parallel_of

_WEIGHTS, _INDEX = "model.safetensors", "model.safetensors.index.json"
_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def _streamable(model: torch.nn.Module) -> bool:
    """True when transformers would write the state dict as it is (no conversion, adapter, quantizer, custom code)."""
    if getattr(model, "_hf_peft_config_loaded", False) or getattr(model, "hf_quantizer", None) is not None:
        return False
    is_remote = getattr(model, "is_remote_code", None)
    if not hasattr(model, "config") or (callable(is_remote) and is_remote()):
        return False
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return True
    return not get_model_conversion_mapping(model, add_legacy=False)


def _size_in_bytes(size: int | str) -> int:
    if isinstance(size, int):
        return size
    from transformers.utils.hub import convert_file_size_to_int

    return convert_file_size_to_int(size)


def _named_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state-dict tensors (parameters and persistent buffers) by name, as sharded (DTensors) or plain;
    tied names map to the same object."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()  # FSDP2's sharded parameters registered (a no-grad forward may have left them full)
    return {k: v for k, v in model.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}


def _local_part(t: torch.Tensor) -> tuple[torch.Tensor, int | None, int, bool]:
    """``(local tensor, sharded dim or None, first index along it, this rank writes it)`` of a DTensor
    (``Shard(d)``: ``torch.chunk``'s split; ``Replicate``; on a 2-D HSDP mesh ``(Replicate(), Shard(d))``: the first
    copy writes) or a plain tensor."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(t, DTensor):
        return t.detach(), None, 0, True
    mesh, local = t.device_mesh, t._local_tensor.detach()
    shards = [(i, p) for i, p in enumerate(t.placements) if isinstance(p, Shard)]
    if any(not isinstance(p, (Replicate, Shard)) for p in t.placements) or len(shards) > 1:
        raise TypeError(f"a DTensor placed {t.placements}: only one Shard, the rest Replicate, can be written or "
                        f"loaded")
    writes = all(mesh.get_local_rank(i) == 0 for i, p in enumerate(t.placements) if isinstance(p, Replicate))
    if not shards:
        return local, None, 0, writes
    at, placement = shards[0]
    rank, ranks = mesh.get_local_rank(at), mesh.size(at)
    dim, size = placement.dim, t.shape[placement.dim]
    chunk = -(-size // ranks)
    lo = min(rank * chunk, size)
    if local.shape[dim] != min(chunk, size - lo):
        raise ValueError(f"a DTensor shard of {local.shape[dim]} rows along dim {dim} on rank {rank}, expected "
                         f"{min(chunk, size - lo)} (torch.chunk's split of {size} over {ranks})")
    return local, dim, lo, writes


def _stored_keys(folder: str) -> dict[str, str]:
    """``{key: file}`` of a Hugging Face folder's safetensors (the index's weight map, or the one file's keys)."""
    from safetensors import safe_open

    index = os.path.join(folder, _INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            return {k: os.path.join(folder, v) for k, v in json.load(f)["weight_map"].items()}
    single = os.path.join(folder, _WEIGHTS)
    if not os.path.isfile(single):
        raise FileNotFoundError(f"no {_WEIGHTS} (or {_INDEX}) in {folder}")
    with safe_open(single, framework="pt", device="cpu") as f:
        return dict.fromkeys(f.keys(), single)


def _read_slice(f: Any, key: str, t: torch.Tensor, part: tuple[int, int, int, int] | None = None) -> None:
    """This rank's shard of ``t`` from the file's tensor ``key``; ``part``: ``t`` is a TP part, ``(dim, start,
    count, whole)`` of the file's tensor (``TensorParallel.sharded``)."""
    stored = f.get_slice(key)
    shape = tuple(stored.get_shape())
    want = list(t.shape)
    if part is not None:
        want[part[0]] = part[3]
    if shape != tuple(want):
        raise ValueError(f"{key}: the checkpoint holds shape {shape}, the model {tuple(want)}")
    local, dim, lo, _ = _local_part(t)
    if local.numel() == 0:
        return
    if dim is None and part is None:
        local.copy_(f.get_tensor(key))
        return
    index = [slice(None)] * len(shape)
    if dim is not None:
        index[dim] = slice(lo, lo + local.shape[dim])
    if part is not None:  # the TP part's place along its dimension (FSDP2's rows are rows of the part)
        tp_dim, start, count, _ = part
        inner = index[tp_dim]
        index[tp_dim] = (slice(start + inner.start, start + inner.stop) if inner != slice(None)
                         else slice(start, start + count))
    local.copy_(stored[tuple(index)])


def _file_shape(name: str, t: torch.Tensor, tp) -> tuple[int, ...]:
    """The whole tensor's shape: ``t``'s, or a TP-split parameter's along its split dimension."""
    shape = list(t.shape)
    if tp is not None and name in tp.sharded:
        dim, _, _, full = tp.sharded[name]
        shape[dim] = full
    return tuple(shape)


def _write_safetensors(model: torch.nn.Module, output_dir: str, main: bool, max_bytes: int) -> None:
    tp = tensor_parallel_of(model)
    tensors = _named_tensors(model)
    tied = set(getattr(model, "all_tied_weights_keys", None) or ())
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    chosen: dict[int, str] = {}
    for name, t in tensors.items():  # one name per tensor: the first that transformers does not drop as tied
        if name not in ignored and (id(t) not in chosen or (chosen[id(t)] in tied and name not in tied)):
            chosen[id(t)] = name
    entries = [(name, tensors[name]) for name in tensors if chosen.get(id(tensors[name])) == name]
    for name, t in entries:
        if t.dtype not in _ST_DTYPES:
            raise TypeError(f"save_pretrained: {name} has dtype {t.dtype}, which safetensors cannot hold")
    files: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    shapes = {name: _file_shape(name, t, tp) for name, t in entries}
    for name, t in entries:  # greedy, in state-dict order, as transformers' split_torch_state_dict_into_shards
        nbytes = math.prod(shapes[name]) * t.element_size()
        if files[-1] and size + nbytes > max_bytes:
            files.append([])
            size = 0
        files[-1].append((name, t))
        size += nbytes
    names = [_WEIGHTS] if len(files) == 1 else [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
                                                 for i in range(len(files))]
    layouts = [_layout(items, shapes) for items in files]
    if main:
        for old in os.listdir(output_dir):  # weights of an earlier save that this one would not overwrite
            if old.startswith("model") and (old.endswith(".safetensors") or old == _INDEX) and old not in names:
                os.remove(os.path.join(output_dir, old))
        for name, (header, total) in zip(names, layouts):
            with open(os.path.join(output_dir, name), "wb") as f:
                f.write(header)
                f.truncate(len(header) + total)
        if len(files) > 1:
            index = {"metadata": {"total_size": sum(total for _, total in layouts)},
                     "weight_map": {k: n for n, items in zip(names, files) for k, _ in items}}
            with open(os.path.join(output_dir, _INDEX), "w") as f:
                json.dump(index, f, indent=2, sort_keys=True)
    if dist.is_initialized():
        dist.barrier()  # the files exist at their full size before any rank writes into them
    for name, items, (header, _) in zip(names, files, layouts):
        fd = os.open(os.path.join(output_dir, name), os.O_WRONLY)
        try:
            offset = len(header)
            for name, t in items:
                part = tp.sharded.get(name) if tp is not None else None
                if part is not None or tp is None or tp.rank == 0:  # (whole on every TP rank: TP rank 0 writes)
                    _write_slice(fd, offset, t, main, shapes[name], part)
                offset += math.prod(shapes[name]) * t.element_size()
        finally:
            os.close(fd)
    if dist.is_initialized():
        dist.barrier()


def _layout(items: list[tuple[str, torch.Tensor]], shapes: dict[str, tuple[int, ...]]) -> tuple[bytes, int]:
    """The header bytes (length prefix included) of one file and the size of its data section."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, t in items:
        nbytes = math.prod(shapes[name]) * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(shapes[name]),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data section starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(text)) + text, offset


def _write_slice(fd: int, start: int, t: torch.Tensor, main: bool, shape: tuple[int, ...],
                 part: tuple[int, int, int, int] | None = None) -> None:
    """This rank's block of ``t`` into the file's tensor of ``shape`` at byte ``start``: its data-parallel shard
    (``_local_part``), at ``part``'s offset along its dimension where it is a TP rank's part."""
    local, dim, lo, writes = _local_part(t)
    if dim is None and part is None:
        writes = writes and main  # a plain (or replicated) tensor: one rank writes it
    if not writes or local.numel() == 0:
        return
    offsets = [0] * local.dim()
    if dim is not None:
        offsets[dim] += lo
    if part is not None:
        offsets[part[0]] += part[1]
    data = local.contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    item = t.element_size()
    k = local.dim()  # dims k.. are whole in the file: the block is one contiguous run per index of the dims before
    while k > 0 and local.shape[k - 1] == shape[k - 1]:
        k -= 1
    if k == 0:
        _pwrite(fd, memoryview(data), start)
        return
    strides = [math.prod(shape[d + 1:]) * item for d in range(len(shape))]
    run = local.shape[k - 1] * strides[k - 1]
    for i, index in enumerate(itertools.product(*(range(n) for n in local.shape[:k - 1]))):
        at = sum((offsets[d] + j) * strides[d] for d, j in enumerate(index)) + offsets[k - 1] * strides[k - 1]
        _pwrite(fd, memoryview(data[i * run:(i + 1) * run]), start + at)


def _pwrite(fd: int, data: memoryview, offset: int) -> None:
    while len(data):  # one write() moves at most ~2 GiB on Linux
        written = os.pwrite(fd, data, offset)
        data, offset = data[written:], offset + written
