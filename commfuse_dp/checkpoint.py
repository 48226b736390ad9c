"""Saving and loading a commfuse-sharded model: every rank's shards, nothing kept from rank 0 alone.

Two kinds of output, both built on ``torch.distributed.checkpoint`` (DCP) and its state-dict helpers, so nothing
here gathers by hand:

* **Sharded state, to resume** -- :func:`save_sharded` / :func:`load_sharded`: the models' and optimizers' DTensor
  shards of every rank, written by every rank in parallel into one DCP folder
  (``get_model_state_dict`` / ``get_optimizer_state_dict`` keyed by parameter names, so optimizer state belongs to a
  name, not to a position). DCP reshards on load: the folder can be read back by another world size.
* **A consolidated Hugging Face folder** -- :func:`save_pretrained`: every rank takes part in gathering the full
  parameters (``StateDictOptions(full_state_dict=True, cpu_offload=True)``: the full copy exists on rank 0 only, in
  CPU memory), and rank 0 writes it with the model's own ``save_pretrained`` (config, safetensors, tied weights
  and weight-name conversions handled by transformers), so ``from_pretrained`` loads it in one process.
  :func:`full_state_dict` is the gather alone (what ``Accelerator.get_state_dict`` returns for such a model), and
  :func:`load_full_state_dict` the reverse: a full state dict present on every rank, each keeping its own slices.

Every function here is collective: call it on every rank of the model's process group, in the same order.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

__all__ = ["is_sharded", "is_complete", "mark_complete", "unmark_complete", "latest_complete", "full_state_dict",
           "load_full_state_dict", "load_pretrained_weights",
           "save_pretrained", "save_sharded", "load_sharded", "optimizer_model", "unwrap_optimizer"]

_COMPLETE = "commfuse_complete"


def is_sharded(model: Any) -> bool:
    """True for a model (or a wrapper with ``.module``) that :func:`commfuse_dp.shard` sharded."""
    return getattr(model, "_commfuse_engine", None) is not None \
        or getattr(getattr(model, "module", None), "_commfuse_engine", None) is not None


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model if getattr(model, "_commfuse_engine", None) is not None else getattr(model, "module", model)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict on rank 0, in CPU memory; ``{}`` on the other ranks. Collective."""
    return get_model_state_dict(_unwrap(model), options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state_dict(model: torch.nn.Module, state_dict: dict[str, torch.Tensor], *, strict: bool = True) -> None:
    """Loads a full state dict that every rank holds (e.g. read from the same safetensors): each rank copies its
    own slices into its shards. With ``strict``, an unexpected key, or a missing one that is not a tied copy of a
    loaded parameter (``save_pretrained`` drops those), raises ``KeyError``. Collective."""
    model = _unwrap(model)
    result = set_model_state_dict(model, state_dict, options=StateDictOptions(full_state_dict=True, strict=False))
    if not strict:
        return
    tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    loaded = {id(tensors[k]) for k in state_dict if k in tensors}
    missing = [k for k in result.missing_keys if k not in tensors or id(tensors[k]) not in loaded]
    if missing or result.unexpected_keys:
        raise KeyError(f"the weights do not match the model: missing {missing}, unexpected "
                       f"{list(result.unexpected_keys)}")


def load_pretrained_weights(model: torch.nn.Module, folder: str | os.PathLike, *, strict: bool = True) -> None:
    """Loads the safetensors weights of a Hugging Face folder (one file or an index of several) into a sharded
    model: every rank reads the files and keeps its own slices. The names must be the model's own (true of a
    folder written by :func:`save_pretrained` for models without weight-name conversions). Collective."""
    from safetensors.torch import load_file

    folder = os.fspath(folder)
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index):
        import json

        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(folder, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"no model.safetensors (or model.safetensors.index.json) in {folder}")
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(os.path.join(folder, name)))
    load_full_state_dict(model, state, strict=strict)


def save_pretrained(model: torch.nn.Module, output_dir: str | os.PathLike, *, is_main_process: bool | None = None,
                    **kwargs) -> None:
    """Writes a consolidated Hugging Face folder of a sharded ``PreTrainedModel`` (config + safetensors), loadable
    by ``from_pretrained`` in a single process. Every rank must call it; rank 0 (or ``is_main_process``) writes.
    Extra keyword arguments go to the model's ``save_pretrained`` (``max_shard_size``, ...). Collective."""
    inner = _unwrap(model)
    state = full_state_dict(inner)
    main = _rank() == 0 if is_main_process is None else is_main_process
    if main:
        if not hasattr(inner, "save_pretrained"):
            raise TypeError(f"{type(inner).__name__} has no save_pretrained(); use commfuse_dp.checkpoint."
                            "full_state_dict(model) on every rank and save rank 0's dict yourself")
        kwargs.pop("state_dict", None)
        inner.save_pretrained(os.fspath(output_dir), state_dict=state, is_main_process=True, **kwargs)
    del state
    _barrier()


def is_complete(path: str | os.PathLike) -> bool:
    """True for a folder that :func:`save_sharded` finished writing."""
    return os.path.isfile(os.path.join(os.fspath(path), _COMPLETE))


def optimizer_model(optimizer: torch.optim.Optimizer, models: Iterable[torch.nn.Module]) -> torch.nn.Module | None:
    """The model among ``models`` whose parameters ``optimizer`` updates (``None`` when it is none of them).
    An optimizer spanning two sharded models is refused: its state could not be keyed by one model's names."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    owners = [m for m in models if any(id(p) in params for p in _unwrap(m).parameters())]
    if len(owners) > 1:
        raise ValueError("one optimizer updates parameters of several commfuse-sharded models; give each model its "
                         "own optimizer so that each optimizer's sharded state can be saved under that model's "
                         "parameter names")
    return owners[0] if owners else None


def _state(models: list[torch.nn.Module], optimizers: list[tuple[torch.nn.Module, torch.optim.Optimizer]],
           extra: dict[str, Any] | None) -> dict[str, Any]:
    state: dict[str, Any] = {}
    for i, model in enumerate(models):
        state[f"model_{i}"] = get_model_state_dict(_unwrap(model))
    for i, (model, optimizer) in enumerate(optimizers):
        state[f"optimizer_{i}"] = get_optimizer_state_dict(_unwrap(model), unwrap_optimizer(optimizer))
    if extra:
        state.update(extra)
    return state


def unwrap_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    # accelerate's AcceleratedOptimizer wraps the torch optimizer as .optimizer
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def save_sharded(path: str | os.PathLike, models: list[torch.nn.Module],
                 optimizers: list[tuple[torch.nn.Module, torch.optim.Optimizer]] = (), *,
                 extra: dict[str, Any] | None = None) -> None:
    """Every rank writes its shards of ``models`` and of each ``(model, optimizer)`` pair's state into the DCP
    folder ``path``. The folder is written beside its final name and renamed once every rank has finished, so an
    interrupted save never leaves a folder that looks complete. ``extra``: more DCP-serialisable entries
    (tensors, DTensors, numbers). Collective."""
    path = os.fspath(path)
    tmp = path + ".partial"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    dcp.save(_state(list(models), list(optimizers), extra), checkpoint_id=tmp)
    _barrier()
    if _rank() == 0:
        mark_complete(tmp)
        # Never delete the previous folder in place (a kill inside rmtree could leave it half gone): move it
        # aside with one rename, move the new one in with another, and only then delete the old one.
        old = path + ".old"
        if os.path.exists(path):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()


def load_sharded(path: str | os.PathLike, models: list[torch.nn.Module],
                 optimizers: list[tuple[torch.nn.Module, torch.optim.Optimizer]] = (), *,
                 extra: dict[str, Any] | None = None) -> None:
    """Reads a folder written by :func:`save_sharded` into ``models`` and the optimizers, in place (another world
    size is fine: DCP reshards). ``extra`` is filled in place. Collective."""
    path = os.fspath(path)
    if not is_complete(path):
        raise FileNotFoundError(_incomplete_message(path))
    models, optimizers = list(models), list(optimizers)
    state = _state(models, optimizers, extra)
    dcp.load(state, checkpoint_id=path)
    for i, model in enumerate(models):
        set_model_state_dict(_unwrap(model), state[f"model_{i}"])
    for i, (model, optimizer) in enumerate(optimizers):
        set_optimizer_state_dict(_unwrap(model), unwrap_optimizer(optimizer), state[f"optimizer_{i}"])
    if extra:
        for key in extra:
            extra[key] = state[key]


def mark_complete(path: str | os.PathLike) -> None:
    """Writes the completion marker that :func:`is_complete` looks for into the folder ``path`` (the file appears
    whole or not at all: written beside it, then renamed). Call it once everything in the folder is written."""
    path = os.fspath(path)
    tmp = os.path.join(path, _COMPLETE + ".tmp")
    with open(tmp, "w") as f:
        f.write(f"world_size={dist.get_world_size() if dist.is_initialized() else 1}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(path, _COMPLETE))


def unmark_complete(path: str | os.PathLike) -> None:
    """Removes the completion marker of ``path`` (if any): do it before rewriting or deleting a complete folder,
    so that an interruption half-way never leaves a folder that says it is complete."""
    try:
        os.remove(os.path.join(os.fspath(path), _COMPLETE))
    except FileNotFoundError:
        pass


def latest_complete(folder: str | os.PathLike, prefix: str = "checkpoint") -> str | None:
    """The complete folder (:func:`is_complete`) named ``{prefix}-{N}`` in ``folder`` with the highest ``N``, or
    ``None``. Folders of that name whose save was interrupted are passed over."""
    import re

    folder = os.fspath(folder)
    pattern = re.compile(rf"^{re.escape(prefix)}-(\d+)$")
    steps = [(int(m.group(1)), name) for name in (os.listdir(folder) if os.path.isdir(folder) else ())
             if (m := pattern.match(name)) and is_complete(os.path.join(folder, name))]
    return os.path.join(folder, max(steps)[1]) if steps else None


def _incomplete_message(path: str) -> str:
    head = f"{path} is not a complete commfuse checkpoint"
    if path.endswith(".partial"):
        final = path[:-len(".partial")]
        previous = (f"the previous complete save is still at {final}: load that one" if is_complete(final)
                    else f"there is no complete save at {final}")
        return (f"{head}: it is the folder an interrupted save_sharded() left behind (no {_COMPLETE} marker: not "
                f"every rank finished writing). {previous[0].upper() + previous[1:]}, or save again (the next "
                f"save_sharded() to {final} replaces this folder)")
    if not os.path.exists(path):
        if is_complete(path + ".partial"):
            return (f"{head}: {path} does not exist, but {path}.partial is complete (a save was interrupted while "
                    f"renaming it into place): rename {path}.partial to {path}")
        return f"{head}: {path} does not exist"
    return (f"{head} (no {_COMPLETE} marker: its save did not finish, or this is not a folder written by "
            "commfuse_dp). Load an earlier complete checkpoint, or save again")
