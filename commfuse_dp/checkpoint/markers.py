"""A checkpoint folder's completion marker, with every file's size and SHA-256: written last, checked on load."""

from __future__ import annotations

import errno
import hashlib
import json
import os

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from .common import _rank


_COMPLETE = "commfuse_complete"


def is_complete(path: str | os.PathLike) -> bool:
    """True for a folder that :func:`save_sharded` finished writing."""
    return os.path.isfile(os.path.join(os.fspath(path), _COMPLETE))


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
