"""DeepSpeed's communication backend with its data-parallel collectives on the rings: ``RingBackend`` wraps the
backend ``deepspeed.comm`` holds (``cdb``) and sends ``all_gather_into_tensor``, ``reduce_scatter_tensor``,
``all_reduce`` and ``reduce`` on the routed groups through ``commfuse_dp``'s ring collectives, counting them in a
``RingStats`` (``integrations/deepspeed.py`` installs it and says which calls go where)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from commfuse_dp.ring.collectives import ring_all_gather, ring_reduce_scatter
from commfuse_dp.ring.topology import get_ring


@dataclass
class RingStats:
    """What went through the rings since :func:`enable_ring_collectives`, per DeepSpeed collective.

    ``calls[op]`` and ``numel[op]`` (elements: the all-gather's output, the reduce-scatter's input, the
    all-reduced tensor) for ``op`` in ``all_gather_into_tensor``, ``reduce_scatter_tensor``, ``all_reduce``,
    ``reduce``; ``passed["op: reason"]``: calls on a data-parallel group that were left to DeepSpeed's backend."""

    calls: Counter = field(default_factory=Counter)
    numel: Counter = field(default_factory=Counter)
    passed: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {"calls": dict(self.calls), "numel": dict(self.numel), "passed": dict(self.passed)}


class _DoneWork(dist.Work):
    """The handle of an ``async_op`` call that already completed (CUDA: ordered on the current stream)."""

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _ThenWork(dist.Work):
    """Waits for ``works`` in order, then runs ``after`` (the copy of a padded all-reduce back into the tensor)."""

    def __init__(self, works: list, after) -> None:
        super().__init__()
        self._works, self._after, self._done = works, after, False

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self._done:
            for work in self._works:
                if work is not None:
                    work.wait()
            if self._after is not None:
                self._after()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done or all(w is None or w.is_completed() for w in self._works)


def _op_name(op: Any) -> str:
    """``"sum"``, ``"avg"`` or another name, for torch's ``ReduceOp`` and DeepSpeed's own ``ReduceOp`` enum."""
    if op == dist.ReduceOp.SUM:
        return "sum"
    if op == dist.ReduceOp.AVG:
        return "avg"
    name = getattr(op, "name", None)  # deepspeed.comm.reduce_op.ReduceOp (an Enum)
    return name.lower() if isinstance(name, str) else repr(op)


class RingBackend:
    """Stands in for ``deepspeed.comm.comm.cdb``: the four routed collectives on a data-parallel group run on the
    rings; every other attribute is the previous backend's."""

    def __init__(self, inner: Any, handle: Any, groups: tuple[dist.ProcessGroup, ...]) -> None:
        # handle: the RingCollectives that installed it (its config and stats)
        self._inner = inner
        self._handle = handle
        self._names = {group_name(g) for g in groups}

    def __getattr__(self, name: str) -> Any:  # only for names this class does not define
        return getattr(self._inner, name)

    # -- routing --

    def _routed(self, op: str, group: Any, tensors: tuple[torch.Tensor, ...],
                reduce_op: Any = None) -> dist.ProcessGroup | None:
        """The process group to run ``op`` on through the rings, or ``None`` to leave it to DeepSpeed."""
        pg = dist.group.WORLD if group is None else group
        if not isinstance(pg, dist.ProcessGroup) or group_name(pg) not in self._names:
            return None  # not a data-parallel group: untouched, not counted
        reason = None
        if reduce_op is not None and _op_name(reduce_op) not in ("sum", "avg"):
            reason = f"op {_op_name(reduce_op)}"
        elif reduce_op is not None and _op_name(reduce_op) == "avg" and not tensors[0].dtype.is_floating_point:
            reason = "avg of integers"
        elif dist.get_world_size(pg) <= 1:
            reason = "group of one rank"
        elif not all(isinstance(t, torch.Tensor) and t.is_contiguous() for t in tensors):
            reason = "non-contiguous tensor"
        else:
            device = tensors[0].device.type
            backend = str(dist.get_backend(pg))
            if device == "cpu" and "gloo" not in backend:
                reason = f"cpu tensor on a {backend} group"
            elif device == "cuda" and "nccl" not in backend:
                reason = f"cuda tensor on a {backend} group"
            elif device not in ("cpu", "cuda"):
                reason = f"{device} tensor"
        if reason is not None:
            self._handle.stats.passed[f"{op}: {reason}"] += 1
            return None
        return pg

    def _count(self, op: str, numel: int) -> None:
        self._handle.stats.calls[op] += 1
        self._handle.stats.numel[op] += numel

    # -- the routed collectives (signatures of deepspeed.comm.torch.TorchBackend) --

    def all_gather_into_tensor(self, output_tensor, input_tensor, group=None, async_op=False):
        pg = self._routed("all_gather_into_tensor", group, (output_tensor, input_tensor))
        if pg is None:
            return self._inner.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
        cfg = self._handle.config
        work = ring_all_gather(output_tensor, input_tensor, pg, async_op=async_op, **cfg.ring_kwargs)
        self._count("all_gather_into_tensor", output_tensor.numel())
        return _async_result(work, async_op)

    def reduce_scatter_tensor(self, output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        pg = self._routed("reduce_scatter_tensor", group, (output_tensor, input_tensor), op)
        if pg is None:
            return self._inner.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group,
                                                     async_op=async_op)
        cfg = self._handle.config
        work = ring_reduce_scatter(output_tensor, input_tensor, pg, _op_name(op), async_op=async_op,
                                   **cfg.ring_kwargs)
        self._count("reduce_scatter_tensor", input_tensor.numel())
        return _async_result(work, async_op)

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        pg = self._routed("all_reduce", group, (tensor,), op)
        if pg is None:
            return self._inner.all_reduce(tensor, op, group, async_op)
        work = self._ring_all_reduce(tensor, op, pg, async_op)
        self._count("all_reduce", tensor.numel())
        return work

    def reduce(self, tensor, dst, op=dist.ReduceOp.SUM, group=None, async_op=False):
        pg = self._routed("reduce", group, (tensor,), op)
        if pg is None:
            return self._inner.reduce(tensor, dst, op=op, group=group, async_op=async_op)
        work = self._ring_all_reduce(tensor, op, pg, async_op)  # the owner `dst` reads it; the others get it too
        self._count("reduce", tensor.numel())
        return work

    def _ring_all_reduce(self, tensor: torch.Tensor, op: Any, pg: dist.ProcessGroup, async_op: bool):
        """Ring reduce-scatter, then ring all-gather, in place in one flat buffer of ``N * ceil(numel / N)``."""
        cfg = self._handle.config
        ring = get_ring(pg, op="all_reduce")
        flat = tensor.view(-1)
        shard = math.ceil(flat.numel() / ring.size)
        if flat.numel() == shard * ring.size:
            buf = flat
        else:
            buf = flat.new_zeros(shard * ring.size)
            buf[:flat.numel()].copy_(flat)
        own = buf[ring.rank * shard:(ring.rank + 1) * shard]
        works = [ring_reduce_scatter(own, buf, pg, _op_name(op), async_op=async_op, **cfg.ring_kwargs),
                 ring_all_gather(buf, own, pg, async_op=async_op, **cfg.ring_kwargs)]

        def copy_back() -> None:
            if buf is not flat:
                flat.copy_(buf[:flat.numel()])

        if not async_op:
            copy_back()
            return None
        return _ThenWork(works, copy_back)


def _async_result(work: dist.Work | None, async_op: bool) -> dist.Work | None:
    if not async_op:
        return None
    return work if work is not None else _DoneWork()


def group_name(pg: dist.ProcessGroup) -> str:
    return getattr(pg, "group_name", None) or str(id(pg))
