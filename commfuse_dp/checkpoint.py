"""Saving and loading a commfuse-sharded model: every rank's shards, nothing kept from rank 0 alone.

Two kinds of output, both built on ``torch.distributed.checkpoint`` (DCP) and its state-dict helpers, so nothing
here gathers by hand:

* **Sharded state, to resume** -- :func:`save_sharded` / :func:`load_sharded`: the models' and optimizers' DTensor
  shards of every rank, written by every rank in parallel into one DCP folder
  (``get_model_state_dict`` / ``get_optimizer_state_dict`` keyed by parameter names, so optimizer state belongs to a
  name, not to a position), and each rank's error-feedback residuals (``feedback.py``) under its rank. DCP reshards
  on load: the folder can be read back by another world size (with error feedback on: by the same world size).
* **A consolidated Hugging Face folder** -- :func:`save_pretrained`: every rank takes part in gathering the full
  parameters (``StateDictOptions(full_state_dict=True, cpu_offload=True)``: the full copy exists on rank 0 only, in
  CPU memory), and rank 0 writes it with the model's own ``save_pretrained`` (config, safetensors, tied weights
  and weight-name conversions handled by transformers), so ``from_pretrained`` loads it in one process.
  :func:`full_state_dict` is the gather alone (what ``Accelerator.get_state_dict`` returns for such a model), and
  :func:`load_full_state_dict` the reverse: a full state dict present on every rank, each keeping its own slices.

Every function here is collective: call it on every rank of the model's process group, in the same order.
"""

from __future__ import annotations

import errno
import logging
import hashlib
import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from typing import Any, Iterable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from .feedback import Residuals, residuals_of
from .hf_safetensors import _named_tensors, _read_slice, _size_in_bytes, _stored_keys, _streamable, _write_safetensors

__all__ = ["CheckpointError", "is_sharded", "is_complete", "mark_complete", "unmark_complete", "latest_complete",
           "full_state_dict", "load_full_state_dict", "load_hf_weights", "load_pretrained_weights",
           "mark_initialised", "save_pretrained", "save_sharded", "AsyncSaver", "load_sharded", "verify",
           "optimizer_model", "unwrap_optimizer"]

_COMPLETE = "commfuse_complete"
logger = logging.getLogger(__name__)


def is_sharded(model: Any) -> bool:
    """True for a model (or a wrapper with ``.module``) that :func:`commfuse_dp.shard` sharded."""
    return getattr(model, "_commfuse_engine", None) is not None \
        or getattr(getattr(model, "module", None), "_commfuse_engine", None) is not None


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model if getattr(model, "_commfuse_engine", None) is not None else getattr(model, "module", model)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier(group=None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


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
                    _read_slice(f, key, t)
    mark_initialised(inner)


def load_pretrained_weights(model: torch.nn.Module, folder: str | os.PathLike, *, strict: bool = True) -> None:
    """The former name of :func:`load_hf_weights` (same behaviour: every rank reads only its own slices)."""
    load_hf_weights(model, folder, strict=strict)


def mark_initialised(model: torch.nn.Module) -> None:
    """Declares the parameters of a model sharded on the meta device set (``shard()`` refuses a forward until
    then). The loaders call it; call it yourself only after initialising the shards some other way."""
    inner = _unwrap(model)
    handle = inner.__dict__.pop("_commfuse_empty_weights", None)
    if handle is not None:
        handle.remove()


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
           extra: dict[str, Any] | None, feedback: bool = True) -> dict[str, Any]:
    """What a checkpoint holds; ``feedback``: with this rank's error-feedback residuals (to save)."""
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
    choice = getattr(model, "_commfuse_choice", None) or getattr(_unwrap(model), "_commfuse_choice", None)
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
    _write_sharded(os.fspath(path).rstrip(os.sep), _state(list(models), list(optimizers), extra), None)


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


class AsyncSaver:
    """:func:`save_sharded` off the training thread. ``save`` copies this rank's shards of the models and the
    optimizers' state into host memory (buffers kept and reused by the next save: ``_Staging``) and returns; a
    background thread then writes the copy with ``save_sharded``'s steps (DCP into ``path.partial``, every file's
    size and SHA-256, the marker, the renames) and runs ``then``, on a gloo process group of its own, so that its
    collectives never meet the training's. Training goes on meanwhile.

    - The next ``save`` first waits for the one before (so one copy is held at most: ``staged_bytes``).
    - A process killed during the write leaves ``path.partial`` unmarked: the previous checkpoint at ``path`` is
      still the newest complete one.
    - A write that fails (a full disk) raises :class:`CheckpointError` on every rank at the next ``save`` or
      ``wait``, the partial folder removed and the previous checkpoint untouched.

    Collective: call ``save`` and ``wait`` on every rank alike, and ``wait`` before the process ends (a write
    still running is lost when the process exits: it never looks complete). The thread is a daemon thread, so a
    rank whose peer died is not held at exit by a write that cannot finish."""

    def __init__(self) -> None:
        self._job: threading.Thread | None = None
        self._error: BaseException | None = None
        self._group = None
        self._staging = _Staging()
        self.staged_bytes = 0  # host memory the last save's copy holds (kept for the next save to reuse)
        self.write_s = 0.0  # the last finished write: seconds on the writing thread's clock, and CPU seconds
        self.write_cpu_s = 0.0

    @property
    def writing(self) -> bool:
        """Whether a write is still running (this rank's view; never decide a collective on it)."""
        return self._job is not None and self._job.is_alive()

    def save(self, path: str | os.PathLike, models: list[torch.nn.Module],
             optimizers: list[tuple[torch.nn.Module, torch.optim.Optimizer]] = (), *,
             extra: dict[str, Any] | None = None, then: Callable[[], None] | None = None) -> None:
        """Copy the state now, write it in the background (``save_sharded``'s arguments); ``then``: run on the
        writing thread of every rank once the folder is complete (e.g. mark an enclosing folder complete)."""
        self.wait()
        path = os.fspath(path).rstrip(os.sep)
        group = self._process_group()
        staged = self._staging.copy(_state(list(models), list(optimizers), extra))
        self.staged_bytes = self._staging.nbytes

        def write() -> None:
            began, cpu = time.perf_counter(), time.thread_time()
            try:
                _write_sharded(path, staged, group)
                if then is not None:
                    then()
            except BaseException as err:  # handed to the training thread by wait()
                self._error = err
            self.write_s, self.write_cpu_s = time.perf_counter() - began, time.thread_time() - cpu

        self._job = threading.Thread(target=write, name="commfuse-async-save", daemon=True)
        self._job.start()

    def wait(self) -> None:
        """Block until the write in flight (if any) is complete; re-raise its error. Collective."""
        job, self._job = self._job, None
        if job is not None:
            job.join()
        error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        """``wait``, then free the host copy."""
        self.wait()
        self._staging = _Staging()
        self.staged_bytes = 0

    def _process_group(self):
        if self._group is None and dist.is_initialized() and dist.get_world_size() > 1:
            self._group = dist.new_group(backend="gloo")  # collective: every rank's first save makes it alike
        return self._group


class _Staging:
    """Host copies of a state dict's tensors, one buffer per entry, reused by the next copy of the same shapes:
    a DTensor's local shard is copied and wrapped again with its mesh, placements and global shape; a plain
    tensor is copied; anything else (a step number) is taken as it is."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, torch.Tensor] = {}
        self.nbytes = 0

    def copy(self, state: dict[str, Any]) -> dict[str, Any]:
        self.nbytes = 0
        return {key: self._copy(value, (key,)) for key, value in state.items()}

    def _copy(self, value: Any, where: tuple) -> Any:
        if isinstance(value, DTensor):
            local = self._tensor(value.to_local(), where)
            return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False,
                                      shape=value.shape, stride=value.stride())
        if isinstance(value, torch.Tensor):
            return self._tensor(value, where)
        if isinstance(value, dict):
            return {key: self._copy(item, (*where, key)) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._copy(item, (*where, i)) for i, item in enumerate(value))
        return value

    def _tensor(self, tensor: torch.Tensor, where: tuple) -> torch.Tensor:
        buffer = self._buffers.get(where)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = self._buffers[where] = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu",
                                                        pin_memory=tensor.is_cuda)
        buffer.copy_(tensor.detach())
        self.nbytes += buffer.numel() * buffer.element_size()
        return buffer


def load_sharded(path: str | os.PathLike, models: list[torch.nn.Module],
                 optimizers: list[tuple[torch.nn.Module, torch.optim.Optimizer]] = (), *,
                 extra: dict[str, Any] | None = None) -> None:
    """Reads a folder written by :func:`save_sharded` into ``models`` and the optimizers, in place (another world
    size is fine: DCP reshards). ``extra`` is filled in place. Collective."""
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
    dcp.load(state, checkpoint_id=path)
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


def mark_complete(path: str | os.PathLike, files: dict[str, list] | None = None) -> None:
    """Writes the completion marker that :func:`is_complete` looks for into the folder ``path`` (the file appears
    whole or not at all: written beside it, then renamed). Call it once everything in the folder is written.
    ``files``: each file's ``[size, sha256]`` (relative names), which :func:`verify` checks on load."""
    path = os.fspath(path)
    tmp = os.path.join(path, _COMPLETE + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"world_size": dist.get_world_size() if dist.is_initialized() else 1, "files": files}, f,
                  indent=1)
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


# ---- integrity -------------------------------------------------------------------------------------------------

class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or the one found is damaged. Raised alike on every rank."""


def _files(folder: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(root, name), folder)
                  for root, _, names in os.walk(folder) for name in names if name != _COMPLETE)


def _digest(file: str) -> list:
    with open(file, "rb") as f:
        return [os.fstat(f.fileno()).st_size, hashlib.file_digest(f, "sha256").hexdigest()]


def _gather_digests(folder: str, files: list[str], group=None) -> dict[str, list]:
    """Size and SHA-256 of every file, each rank hashing its share of the files (the same list on every rank)."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    mine = {name: _digest(os.path.join(folder, name)) for name in files[_rank()::world]}
    if world == 1:
        return mine
    parts: list[dict] = [{} for _ in range(world)]
    dist.all_gather_object(parts, mine, group=group)
    return {name: value for part in parts for name, value in sorted(part.items())}


def verify(path: str | os.PathLike) -> None:
    """Checks every file of a complete :func:`save_sharded` folder against the sizes and SHA-256 digests in its
    marker, the ranks sharing the reading; a missing, truncated, extended or altered file raises
    :class:`CheckpointError` on every rank, naming the files. Collective when a process group is initialised."""
    path = os.fspath(path)
    with open(os.path.join(path, _COMPLETE)) as f:
        text = f.read()
    try:
        expected = json.loads(text)["files"]
    except (ValueError, KeyError, TypeError):
        expected = None
    if not isinstance(expected, dict):
        return  # a marker without digests (an older save, or a Trainer checkpoint folder): nothing to compare
    names = sorted(set(expected) | set(_files(path)))
    world = dist.get_world_size() if dist.is_initialized() else 1
    problems = []
    for name in names[_rank()::world]:
        file = os.path.join(path, name)
        if name not in expected:
            problems.append(f"{name}: not written by the save")
        elif not os.path.isfile(file):
            problems.append(f"{name}: missing")
        else:
            size, sha = _digest(file)
            if size != expected[name][0]:
                problems.append(f"{name}: {size} bytes, the save wrote {expected[name][0]} (truncated or extended)")
            elif sha != expected[name][1]:
                problems.append(f"{name}: its content changed since the save (SHA-256 differs: corrupted)")
    if world > 1:
        every: list[list] = [[] for _ in range(world)]
        dist.all_gather_object(every, problems)
        problems = sorted(p for part in every for p in part)
    if problems:
        raise CheckpointError(f"checkpoint {path} is damaged: " + "; ".join(problems) + ". Nothing was loaded. "
                              "Restore the folder from a copy, or resume from an earlier checkpoint")


def _failures(err: CheckpointException) -> str:
    parts = []
    for rank, failure in sorted(err.failures.items()):
        exc = failure[0] if isinstance(failure, tuple) else failure
        cause = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            cause += " -- the disk is full: free space there or save elsewhere, then save again"
        parts.append(f"rank {rank}: {cause}")
    return "; ".join(parts)


def _previous(path: str) -> str:
    if is_complete(path):
        return f"the previous checkpoint at {path} is untouched"
    return f"there was no earlier complete checkpoint at {path}"
