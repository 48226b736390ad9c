"""DeepSpeed's communication backend with its data-parallel collectives on the rings: ``RingBackend`` wraps the
backend ``deepspeed.comm`` holds (``cdb``) and sends ``all_gather_into_tensor``, ``reduce_scatter_tensor``,
``all_reduce`` and ``reduce`` on the routed groups through ``commfuse_dp``'s ring collectives, counting them in a
``RingStats`` (``commfuse_dp/integrations/deepspeed.py`` says which calls go where).

Below the entry points, and used by ``commfuse_dp/integrations/attach.py`` for ``backend="deepspeed"``: the ``"commfuse"``
section of a DeepSpeed config (:func:`config_from_deepspeed`, :func:`ring_config`), the data-parallel groups to route
(:func:`dp_groups`), the install and its handle (:func:`install`, :class:`RingCollectives`), and the checks. Nothing
here imports ``deepspeed`` until it runs."""

from __future__ import annotations

import difflib
import math
import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from commfuse_dp.config import CommFuseConfig
from commfuse_dp.handle import engine_of
from commfuse_dp.ring.collectives import ring_all_gather, ring_reduce_scatter
from commfuse_dp.ring.topology import get_ring, register_exit_drain


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
        ring = get_ring(pg, caller="all_reduce")
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


RING_FIELDS = ("bucket_mb", "direct_kb", "timeout_s")
"""The ``CommFuseConfig`` fields that apply to DeepSpeed's collectives (the rest configure ``commfuse_dp.shard``)."""

_lock = threading.Lock()


# ---- configuration -------------------------------------------------------------------------------------------

def config_from_deepspeed(ds_config: Mapping[str, Any] | None) -> CommFuseConfig | None:
    """The ``CommFuseConfig`` of the ``"commfuse"`` section of a DeepSpeed config dict, or ``None`` without one.

    Only :data:`RING_FIELDS` are accepted; an unknown key, a ``CommFuseConfig`` field that does nothing to
    DeepSpeed's collectives, or a bad value raises ``ValueError`` naming it."""
    if not ds_config or "commfuse" not in ds_config:
        return None
    section = ds_config["commfuse"]
    where = 'DeepSpeed config, "commfuse" section'
    if section is None:
        section = {}
    if not isinstance(section, Mapping):
        raise ValueError(f"{where}: expected a mapping such as {{\"bucket_mb\": 25}}, got {type(section).__name__} "
                         f"{section!r}")
    known = {f.name for f in fields(CommFuseConfig)}
    for key in section:
        if key not in known:
            close = difflib.get_close_matches(str(key), RING_FIELDS, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(f"{where}: unknown key {key!r}; {hint}the section takes {list(RING_FIELDS)}")
        if key not in RING_FIELDS:
            raise ValueError(f"{where}: {key!r} configures commfuse_dp.shard() and does nothing to DeepSpeed's "
                             f"collectives; remove it (the section takes {list(RING_FIELDS)})")
    try:
        return CommFuseConfig.from_dict(section)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from err


def ring_config_arg(cfg: CommFuseConfig | Mapping[str, Any] | None) -> CommFuseConfig | None:
    if cfg is None or isinstance(cfg, CommFuseConfig):
        return cfg
    if isinstance(cfg, Mapping):
        return config_from_deepspeed({"commfuse": cfg})
    raise TypeError(f"enable_ring_collectives: cfg must be a CommFuseConfig, a mapping of {list(RING_FIELDS)} or "
                    f"None, got {type(cfg).__name__}")


def ring_config(own: CommFuseConfig | None, section: CommFuseConfig | None, who: str, own_wins: bool
                ) -> tuple[CommFuseConfig, str]:
    """The ring config and where it came from (``RingCollectives.source``), of the entry's own config ``own`` and
    the DeepSpeed config's ``"commfuse"`` section. ``own_wins``: ``own`` is an explicit choice and wins over the
    section (``enable_ring_collectives(engine, cfg)``, ``CommFuseAccelerator``); else the section wins, and a ring
    field that ``own`` sets to a non-default value different from the section's is an error (``CommFuseCallback``:
    its config always exists, ``CommFuseConfig.from_env()`` without an argument, so only the fields that differ
    from the defaults were set by the user)."""
    if own_wins:
        source = "cfg" if own is not None else "the DeepSpeed config" if section is not None else "defaults"
        return own or section or CommFuseConfig(), source
    if section is not None and own is not None:
        default = CommFuseConfig()
        clash = [f for f in RING_FIELDS
                 if getattr(own, f) != getattr(default, f) and getattr(own, f) != getattr(section, f)]
        if clash:
            diff = ", ".join(f"{f}: DeepSpeed config {getattr(section, f)!r}, {who} {getattr(own, f)!r}"
                             for f in clash)
            raise ValueError(f"{who}: the DeepSpeed config's \"commfuse\" section and the callback's "
                             f"CommFuseConfig disagree ({diff}); set the ring fields in one place")
    return section or own or CommFuseConfig(), "the DeepSpeed config" if section is not None else who


# ---- what a run reports ----------------------------------------------------------------------------------------

class RingCollectives:
    """The handle :func:`enable_ring_collectives` returns: ``stats``, ``config``, ``group_ranks`` (the ranks of each
    data-parallel process group routed to the rings), ``disable()`` (DeepSpeed's previous backend again); also a
    context manager that disables on exit."""

    def __init__(self, config: CommFuseConfig, groups: tuple[dist.ProcessGroup, ...], source: str) -> None:
        self.config = config
        # Ranks only: a reference to a group would keep it (and gloo's worker threads) alive after
        # destroy_process_group() for as long as this handle lives.
        self.group_ranks = [dist.get_process_group_ranks(g) for g in groups]
        self.source = source  # where the config came from, for messages
        self.stats = RingStats()
        self._backend: RingBackend | None = None

    @property
    def enabled(self) -> bool:
        return self._backend is not None

    def disable(self) -> None:
        """Put DeepSpeed's previous backend back. Idempotent. Raises if something replaced the backend since."""
        import deepspeed.comm.comm as ds_comm

        with _lock:
            if self._backend is None:
                return
            if ds_comm.cdb is not self._backend:
                raise RuntimeError(f"RingCollectives.disable: deepspeed.comm.comm.cdb was replaced since the rings "
                                   f"were enabled (it is now {type(ds_comm.cdb).__name__}); disable whatever replaced "
                                   f"it first, in reverse order")
            ds_comm.cdb = self._backend._inner
            self._backend = None

    def __enter__(self) -> RingCollectives:
        return self

    def __exit__(self, *exc: object) -> None:
        self.disable()

    def __repr__(self) -> str:
        state = "enabled" if self.enabled else "disabled"
        return (f"RingCollectives({state}, bucket_mb={self.config.bucket_mb:g}, direct_kb={self.config.direct_kb:g}, "
                f"timeout_s={self.config.timeout_s:g}, groups={self.group_ranks}, calls={dict(self.stats.calls)})")


# ---- which groups are data-parallel ---------------------------------------------------------------------------

def dp_groups(module: torch.nn.Module | None, optimizer: Any, engine: Any = None) -> tuple[dist.ProcessGroup, ...]:
    from deepspeed.utils import groups as ds_groups

    found: list[Any] = []
    if engine is not None:
        found += [getattr(engine, "data_parallel_group", None), getattr(engine, "seq_data_parallel_group", None)]
    else:
        found += [ds_groups._get_data_parallel_group(), ds_groups._get_sequence_data_parallel_group()]
    while optimizer is not None:  # accelerate's DeepSpeedOptimizerWrapper -> the ZeRO optimizer
        found.append(getattr(optimizer, "dp_process_group", None))
        inner = getattr(optimizer, "optimizer", None)
        optimizer = inner if inner is not optimizer else None
    if module is not None:
        found += [getattr(p, "ds_process_group", None) for p in module.parameters()]  # ZeRO-3
    if engine is None and module is None:
        # Before an engine exists: ZeRO-3 / zero.Init partition over dist.get_world_group() when no mpu is given,
        # so the world is a data-parallel group whenever DeepSpeed's data-parallel group spans it.
        dp = found[0]
        if dp is not None and dist.get_world_size(dp) == dist.get_world_size():
            found.append(dist.group.WORLD)
    out: dict[str, dist.ProcessGroup] = {}
    for g in found:
        if isinstance(g, dist.ProcessGroup):
            out.setdefault(group_name(g), g)
    return tuple(out.values())


# ---- installing and checking ------------------------------------------------------------------------------

def install(config: CommFuseConfig, groups: tuple[dist.ProcessGroup, ...], source: str) -> RingCollectives:
    import deepspeed.comm.comm as ds_comm

    if not groups:
        raise RuntimeError("enable_ring_collectives: found no data-parallel process group of DeepSpeed to route")
    handle = RingCollectives(config, groups, source)
    with _lock:
        current = ds_comm.cdb
        if isinstance(current, RingBackend):
            raise ValueError(f"enable_ring_collectives: DeepSpeed's collectives already run on the rings "
                             f"({current._handle!r}); call .disable() on that handle first")
        handle._backend = RingBackend(current, handle, groups)
        ds_comm.cdb = handle._backend
        register_exit_drain()
    return handle


def require_deepspeed_comm() -> None:
    import deepspeed.comm.comm as ds_comm

    if ds_comm.cdb is None or not ds_comm.cdb.is_initialized() or not dist.is_initialized():
        raise RuntimeError("enable_ring_collectives: deepspeed.comm is not initialised; call "
                           "deepspeed.init_distributed() (or deepspeed.initialize(...)) first, in a process started "
                           "by torchrun or the deepspeed launcher")


def refuse_commfuse_sharded(module: Any, who: str) -> None:
    if engine_of(module) is not None:
        raise ValueError(f"{who}: this model was sharded by commfuse_dp.shard(), and DeepSpeed ZeRO shards it too; "
                         f"one model cannot be sharded twice. Either give DeepSpeed the plain (unsharded) model and "
                         f"let enable_ring_collectives switch DeepSpeed's collectives to the rings, or drop DeepSpeed "
                         f"and train the commfuse-sharded model with a torch optimizer")
