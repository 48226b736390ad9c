"""Hugging Face folders of a sharded model: the consolidated ``save_pretrained`` that ``from_pretrained`` loads in
one process, each rank reading its own slices back (``load_hf_weights``), and the full state dict."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

from ..handle import handle_of
from .common import _barrier, _rank, _unwrap
from .slices import _named_tensors, _read_slice, _size_in_bytes, _stored_keys, _streamable, _write_safetensors
from .tp_state import _split_names, tensor_parallel_of


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict on rank 0, in CPU memory; ``{}`` on the other ranks. Collective."""
    return get_model_state_dict(_unwrap(model), options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state_dict(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], *, strict: bool = True) -> None:
    """Loads a full state dict that every rank holds (e.g. read from the same safetensors): each rank copies its
    own slices into its shards. With ``strict``, an unexpected key, or a missing one that is not a tied copy of a
    loaded parameter (``save_pretrained`` drops those), raises ``KeyError``. Collective."""
    model = _unwrap(model)
    result = set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True, strict=False))
    mark_initialised(model)
    if not strict:
        return
    tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    loaded = {id(tensors[k]) for k in state_dict if k in tensors}
    missing = [k for k in result.missing_keys if k not in tensors or id(tensors[k]) not in loaded]
    if missing or result.unexpected_keys:
        raise KeyError(f"the weights do not match the model: missing {missing}, unexpected "
                       f"{list(result.unexpected_keys)}")


def load_hf_weights(model: torch.nn.Module, folder: str | os.PathLike, *, strict: bool = True) -> None:
    """Loads the safetensors weights of a Hugging Face folder (``model.safetensors``, or an index and several files)
    into a sharded model, each rank reading only the slices it owns (``safe_open(...).get_slice(name)[lo:hi]``):
    no rank ever holds more than its own shards plus one tensor's slice. The model may come from ``shard()`` of a
    meta-device model (its empty shards are filled here). Names must be the model's own state-dict keys (true of
    folders written by ``save_pretrained`` of models without weight-name conversions); a key missing from the
    folder is fine when it is tied to one that is there (``save_pretrained`` drops ``lm_head.weight`` when it is
    the input embedding). With ``strict``, missing and unexpected keys raise ``KeyError`` naming them; a shape that
    differs raises ``ValueError``. Dtypes are converted to the model's. Every rank must call it (it reads the same
    files and raises the same errors everywhere; it sends nothing)."""
    from safetensors import safe_open

    inner = _unwrap(model)
    tp = tensor_parallel_of(inner)
    split = _split_names(inner, tp) if tp is not None else {}  # (a TP part: its place in the file's tensor)
    where = _stored_keys(os.fspath(folder))
    tensors = _named_tensors(inner)
    aliases: dict[int, list[str]] = {}
    for name, t in tensors.items():
        aliases.setdefault(id(t), []).append(name)
    missing = [names[0] for names in aliases.values() if not any(n in where for n in names)]
    unexpected = sorted(k for k in where if k not in tensors)
    if strict and (missing or unexpected):
        raise KeyError(f"the weights in {os.fspath(folder)} do not match the model: missing {missing}, unexpected "
                       f"{unexpected}")
    by_file: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for names in aliases.values():
        key = next((n for n in names if n in where), None)
        if key is not None:
            by_file.setdefault(where[key], []).append((key, tensors[key]))
    with torch.no_grad():
        for path, items in by_file.items():
            with safe_open(path, framework="pt", device="cpu") as f:
                for key, t in items:
                    _read_slice(f, key, t, split.get(key))
    mark_initialised(inner)


def load_pretrained_weights(model: torch.nn.Module, folder: str | os.PathLike, *, strict: bool = True) -> None:
    """The former name of :func:`load_hf_weights` (same behaviour: every rank reads only its own slices)."""
    load_hf_weights(model, folder, strict=strict)


def mark_initialised(model: torch.nn.Module) -> None:
    """Declares the parameters of a model sharded on the meta device set (``shard()`` refuses a forward until
    then). The loaders call it; call it yourself only after initialising the shards some other way."""
    state = handle_of(_unwrap(model), through_wrapper=False)
    hook = state.empty_weights if state is not None else None
    if hook is not None:
        state.empty_weights = None
        hook.remove()


def save_pretrained(model: torch.nn.Module, output_dir: str | os.PathLike, *, is_main_process: bool | None = None,
                    **kwargs) -> None:
    """Writes a consolidated Hugging Face folder of a sharded ``PreTrainedModel`` (``config.json``,
    ``generation_config.json``, safetensors), loadable by ``from_pretrained`` in a single process, without
    gathering the model anywhere: the main rank (rank 0, or the one rank passing ``is_main_process=True``) writes
    the config and each safetensors header, then every rank writes its own shards into the files in place
    (``os.pwrite`` at the shard's byte offset). Tied weights are written once, under the name transformers keeps.
    ``max_shard_size`` (default ``"50GB"``, as transformers) splits the weights into several files and an index.

    Models that transformers saves with more than renaming-free tensors -- weight-name conversions, PEFT adapters,
    quantizers, remote code -- and other keyword arguments of ``PreTrainedModel.save_pretrained`` take the former
    path: the full state dict is gathered on rank 0 (CPU memory) and the model's own ``save_pretrained`` writes it.
    Collective: every rank must call it."""
    inner = _unwrap(model)
    if not hasattr(inner, "save_pretrained"):
        raise TypeError(f"{type(inner).__name__} has no save_pretrained(); use commfuse_dp.checkpoint."
                        "full_state_dict(model) on every rank and save rank 0's dict yourself")
    kwargs.pop("state_dict", None)
    max_shard_size = kwargs.pop("max_shard_size", "50GB")
    main = _rank() == 0 if is_main_process is None else bool(is_main_process)
    if kwargs or not _streamable(inner):
        _save_pretrained_gathered(inner, output_dir, main, max_shard_size=max_shard_size, **kwargs)
        return
    if dist.is_initialized():
        mains: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(mains, main)
        if sum(mains) != 1:
            raise ValueError(f"save_pretrained: exactly one rank must be the main process (is_main_process=True), "
                             f"got {sum(mains)} of {len(mains)}")
    output_dir = os.fspath(output_dir)
    if main:
        os.makedirs(output_dir, exist_ok=True)
        inner.config.dtype = str(inner.dtype).removeprefix("torch.")
        inner.config.architectures = [type(inner).__name__.removeprefix("FSDP")]
        inner.config.save_pretrained(output_dir)
        if inner.can_generate():
            inner.generation_config.save_pretrained(output_dir)
    _write_safetensors(inner, output_dir, main, _size_in_bytes(max_shard_size))


def _save_pretrained_gathered(inner: torch.nn.Module, output_dir: str | os.PathLike, main: bool, **kwargs) -> None:
    state = full_state_dict(inner)
    if main:
        inner.save_pretrained(os.fspath(output_dir), state_dict=state, is_main_process=True, **kwargs)
    del state
    _barrier()
