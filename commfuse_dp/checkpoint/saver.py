"""``save_sharded`` off the training thread: ``AsyncSaver``."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .state import _state, _write_sharded
from .tp_state import as_chunks


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
        models, optimizers = list(models), list(optimizers)
        staged = self._staging.copy(_state(models, optimizers, extra))
        as_chunks(models, optimizers, staged)  # (tensor-parallel: whole-tensor views of the host copies)
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
