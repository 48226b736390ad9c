"""Sharded state to resume from: every rank's DTensor shards of the models and optimizers, and its error-feedback
residuals, in one DCP folder (``save_sharded`` / ``load_sharded``)."""

from __future__ import annotations

import logging
import os
import shutil
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from ..feedback import Residuals, residuals_of
from ..handle import handle_of
from .common import _barrier, _rank, _unwrap
from .hf import mark_initialised
from .markers import (CheckpointError, _failures, _files, _gather_digests, _incomplete_message, _previous, is_complete,
                      mark_complete, verify)
from .tp_state import as_chunks, put_back

logger = logging.getLogger(__name__)


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
           extra: dict[str, Any] | None, feedback: bool = True) -> dict[str, Any]:
    """What a checkpoint holds; ``feedback``: with this rank's error-feedback residuals (to save). A
    tensor-parallel model's split tensors are its TP parts here; ``tp_state.as_chunks`` makes them whole for DCP."""
    state: dict[str, Any] = {}
    for i, model in enumerate(models):
        state[f"model_{i}"] = get_model_state_dict(_unwrap(model))
        residuals = _residuals(model)
        if feedback and residuals is not None and residuals.enabled and residuals.state():
            state[_FEEDBACK.format(i)] = {_feedback_rank(): residuals.state()}
        if feedback and _chose(model) is not None:  # (the same on every rank: shard() checks that they agree)
            state[_CHOICE.format(i)] = _chose(model)
    for i, (model, optimizer) in enumerate(optimizers):
        state[f"optimizer_{i}"] = get_optimizer_state_dict(_unwrap(model), unwrap_optimizer(optimizer))
    if extra:
        state.update(extra)
    return state


_FEEDBACK = "commfuse_feedback_{}"  # model i's residuals: {"rank<r>of<world>": {name: tensor in feedback_dtype}}


_CHOICE = "commfuse_choice_{}"  # what model i's "auto" settings ran as, in words


def _chose(model: torch.nn.Module) -> str | None:
    """What ``shard()``'s ``"auto"`` settings became for ``model``: schedule, piece width, copies, collectives."""
    handle = handle_of(model)
    choice = handle.choice if handle is not None else None
    if choice is None:
        return None
    copies = choice.replicate if choice.replicate is not None else "as given"
    return (f"schedule={choice.schedule!r}, piece_shards={choice.piece_shards}, replicate={copies}, "
            f"collectives={choice.collectives!r}")


def _check_choice(path: str, i: int, model: torch.nn.Module, saved: str) -> None:
    """Warn (every rank alike) where this run's ``"auto"`` settings chose otherwise than the saved run's: training
    goes on, but no longer bit for bit as the uninterrupted run (another schedule sums in another order)."""
    now = _chose(model)
    if now is not None and saved and now != saved:
        logger.warning("load_sharded: %s was saved by a run whose \"auto\" settings ran %s; this run's chose %s "
                       "(they measured the machine again). Training continues, but not bit for bit as the saved "
                       "run would have: give those values in the CommFuseConfig to resume exactly", path, saved, now)


def _residuals(model: torch.nn.Module) -> Residuals | None:
    return residuals_of(model) or residuals_of(_unwrap(model))


def _feedback_rank() -> str:
    # Each rank's own key: DCP writes plain tensors under distinct keys from every rank, and reads back each
    # rank's own.
    world = dist.get_world_size() if dist.is_initialized() else 1
    return f"rank{_rank()}of{world}"


def _feedback_targets(path: str, models: list[torch.nn.Module]) -> dict[str, Any]:
    """Where ``load_sharded`` reads this rank's error-feedback residuals into (empty tensors shaped as saved, in
    the dtype they were saved in: ``Residuals.restore`` converts them where this run's ``feedback_dtype`` is
    another), for the models that keep them; ``ValueError`` on every rank (they all read the same metadata) when
    they were saved at another world size."""
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    targets: dict[str, Any] = {}
    for i, model in enumerate(models):
        residuals = _residuals(model)
        if residuals is None or not residuals.enabled:
            continue
        prefix = _FEEDBACK.format(i) + "."
        mine: dict[str, torch.Tensor] = {}
        worlds = set()
        for key, meta in saved.items():
            if not key.startswith(prefix):
                continue
            owner, _, name = key[len(prefix):].partition(".")
            worlds.add(owner.partition("of")[2])
            if owner == _feedback_rank():
                mine[name] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        world = str(dist.get_world_size() if dist.is_initialized() else 1)
        if worlds and worlds != {world}:
            raise ValueError(
                f"load_sharded: {path} holds error-feedback residuals saved at {', '.join(sorted(worlds))} ranks; "
                f"this run has {world} ranks and CommFuseConfig(error_feedback=True). A residual is what one rank's "
                f"encoding lost of its own gradient contributions and cannot move to another world size: resume "
                f"at {', '.join(sorted(worlds))} ranks, or with error_feedback=False")
        targets[_FEEDBACK.format(i)] = {_feedback_rank(): mine} if mine else {}
    return targets


def unwrap_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    # accelerate's AcceleratedOptimizer wraps the torch optimizer as .optimizer
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def save_sharded(path: str | os.PathLike, models: list[torch.nn.Module],
                 optimizers: list[tuple[torch.nn.Module, torch.optim.Optimizer]] = (), *,
                 extra: dict[str, Any] | None = None) -> None:
    """Every rank writes its shards of ``models`` and of each ``(model, optimizer)`` pair's state into the DCP
    folder ``path``. The folder is written beside its final name (``path.partial``) and renamed once every rank
    has finished, with a marker listing every file's size and SHA-256 (:func:`load_sharded` verifies them), so an
    interrupted or failed save never replaces the previous checkpoint at ``path`` and never looks complete.
    ``extra``: more DCP-serialisable entries (tensors, DTensors, numbers). Collective. :class:`AsyncSaver` does
    the same off the training thread.

    A write that fails on any rank (a full disk, a permission error) raises :class:`CheckpointError` on every rank
    naming the rank(s) and the cause; the partial folder is removed and the previous checkpoint is left as it was."""
    models, optimizers = list(models), list(optimizers)
    state = _state(models, optimizers, extra)
    undo = as_chunks(models, optimizers, state)  # (in the optimizer's own state dicts: put back after)
    try:
        _write_sharded(os.fspath(path).rstrip(os.sep), state, None)
    finally:
        put_back(undo)


def _write_sharded(path: str, state: dict[str, Any], group) -> None:
    """``save_sharded``'s steps for a state dict made already, with the collectives on ``group`` (None: the
    default group)."""
    tmp = path + ".partial"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier(group)
    try:
        dcp.save(state, checkpoint_id=tmp, process_group=group)
    except CheckpointException as err:  # raised alike on every rank (DCP gathers every rank's outcome)
        _barrier(group)
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"save_sharded: writing {path} failed ({_failures(err)}). The partial folder was "
                              f"removed; {_previous(path)}") from err
    _barrier(group)
    files = _files(tmp)
    digests = _gather_digests(tmp, files, group)
    if _rank() == 0:
        mark_complete(tmp, files=digests)
        # Never delete the previous folder in place (a kill inside rmtree could leave it half gone): move it
        # aside with one rename, move the new one in with another, and only then delete the old one.
        old = path + ".old"
        if os.path.exists(path):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    _barrier(group)


def load_sharded(path: str | os.PathLike, models: list[torch.nn.Module],
                 optimizers: list[tuple[torch.nn.Module, torch.optim.Optimizer]] = (), *,
                 extra: dict[str, Any] | None = None) -> None:
    """Reads a folder written by :func:`save_sharded` into ``models`` and the optimizers, in place (another world
    size is fine: DCP reshards; so are another ``tp_size`` and no tensor parallelism, saved or loaded). ``extra``
    is filled in place. Collective."""
    path = os.fspath(path).rstrip(os.sep)
    if not is_complete(path):
        raise FileNotFoundError(_incomplete_message(path))
    verify(path)
    models, optimizers = list(models), list(optimizers)
    state = _state(models, optimizers, extra, feedback=False)
    saved_keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for i in range(len(models)):
        if _CHOICE.format(i) in saved_keys:
            state[_CHOICE.format(i)] = ""
    feedback = _feedback_targets(path, models)
    state.update((k, v) for k, v in feedback.items() if v)  # (DCP fills non-tensor entries into this very dict)
    undo = as_chunks(models, optimizers, state)  # (tensor-parallel: read into whole-tensor views, in place)
    dcp.load(state, checkpoint_id=path)
    put_back(undo)
    for i, model in enumerate(models):
        set_model_state_dict(_unwrap(model), state[f"model_{i}"])
        mark_initialised(model)
        if _CHOICE.format(i) in state:
            _check_choice(path, i, model, state[_CHOICE.format(i)])
        if _FEEDBACK.format(i) in feedback:  # (none saved: they start again from zero, as at the first step)
            _residuals(model).restore(feedback[_FEEDBACK.format(i)].get(_feedback_rank(), {}))
    for i, (model, optimizer) in enumerate(optimizers):
        set_optimizer_state_dict(_unwrap(model), unwrap_optimizer(optimizer), state[f"optimizer_{i}"])
    if extra:
        for key in extra:
            extra[key] = state[key]
