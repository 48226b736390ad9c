"""FSDP2 ``Comm`` adapters: stock ``fully_shard`` all-gathers and reduce-scatters through the rings.

FSDP2 calls ``allocate`` for its flat buffers and ``__call__`` with them (``torch.distributed.fsdp``'s
``AllGather`` / ``ReduceScatter`` interfaces). The all-gather input is a view of the output at
``rank * numel``; the ring leaves it in place. FSDP2 waits on the all-gather's return value only when it is a
``dist.Work``: on CPU an ``async_op=True`` (prefetch) call returns one and the ring runs on the group's ring
thread meanwhile, which stock FSDP2 cannot do on CPU. The reduce-scatter's return value is ignored, so it is
complete when it returns (CPU) or ordered on FSDP2's reduce-scatter stream (CUDA).

FSDP2 passes the group of each call: the shard group (the ``fsdp`` dimension of an HSDP mesh), the smaller
post-forward group of ``reshard_after_forward=<int>``, or the group of ``set_separate_reduce_scatter_group``. Each
group has its own ring. HSDP's all-reduce of each unit's shard across the replicas runs on the replicate group's
ring too, in ``reduce_format`` ([Note: FSDP2's replica all-reduce on the rings], ``ring/all_reduce.py``).

[Note: FSDP2's GPU schedule on the rings]
``use_ring_collectives(model, overlap=True)`` (and ``shard()``'s ``schedule="fsdp2"``) runs stock FSDP2 as it runs
on a GPU, also on CPU where FSDP2 itself waits for every collective at once:
- forward: unit i's pre-forward issues unit i+1's all-gather asynchronously (``set_modules_to_forward_prefetch``,
  units in module order; the root prefetches the first), so it travels while unit i computes. On a GPU the host
  running ahead of the device gives the same one-unit lookahead.
- backward: its start issues the all-gather of the last unit that was resharded after the forward (the units
  after it stay gathered: ``reshard_after_forward=False``), the first the backward waits for; on a GPU the host
  running ahead into the backward issues it as the forward's compute ends. Each unit's pre-backward issues the
  previous unit's all-gather asynchronously (FSDP2's default backward prefetch, made asynchronous with
  ``_set_unshard_async_op(True)``).
- reduce-scatters: issued from each unit's post-backward on the ring thread and not waited for there; the
  gradients are views of their output (FSDP2 builds them so), and the backward's last autograd callback waits for
  all of them, as FSDP2's ``finalize_backward`` makes the compute stream wait for its reduce-scatter stream. Where
  FSDP2 reads the output right after the call (a gradient to accumulate into, a post-accumulate-grad hook, a cast
  to another dtype, a divide after the sum, HSDP's accumulation without the all-reduce) the reduce-scatter
  completes before it returns. Under HSDP the unit's all-reduce across the replicas follows its reduce-scatter on
  the replicate group's ring thread, also behind the compute, and the same callback waits for it.
The ring thread serves the all-gathers and reduce-scatters in the order they were issued: one link.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
from torch.utils._pytree import tree_leaves

from ..config import CommFuseConfig
from ..feedback import Residuals, residuals_of
from ..handle import engine_of, handle_of
from ..stats import StatsRecorder
from ..wire import RowFormat
from .all_reduce import RingReplicaGroup
from .collectives import ring_all_gather, ring_reduce_scatter

_SHARD_OWNER = "commfuse_dp.shard()"


class _RingComm:
    """What FSDP2's collective hooks share: the config, the step recorder, and the unit named in errors."""

    def __init__(self, config: CommFuseConfig | None = None, recorder: StatsRecorder | None = None,
                 label: str | None = None) -> None:
        self.config = config if config is not None else CommFuseConfig()
        self.recorder = recorder if recorder is not None and recorder.enabled else None
        self.label = label  # the unit, named in ring errors
        self.owner: str | None = None  # _SHARD_OWNER when commfuse_dp.shard() installed it
        self.param_group = None  # the FSDP2 parameter group it serves (set by use_ring_collectives)
        self._formats: dict[tuple, RowFormat | None] = {}

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def wire(self, fmt: str, row: torch.Tensor, gather: bool) -> RowFormat | None:
        """The narrow format of one rank's row of this unit's flat buffer ([Note: narrow formats]): each
        parameter's padded shard in turn, 2-D and larger ones in ``fmt``, 1-D ones as they are. None where the
        row travels as it is: the exact format, a row that is not the unit's shards (``reshard_after_forward``
        to a smaller group, a tensor subclass's own all-gather inputs), a bf16 gather of bf16 values."""
        if fmt == "exact" or self.param_group is None or not row.dtype.is_floating_point:
            return None
        if gather and fmt == "bf16" and row.dtype == torch.bfloat16:
            return None
        key = (fmt, row.dtype, row.numel())
        if key not in self._formats:
            segments = self.segments(row.numel())
            self._formats[key] = None if segments is None else RowFormat(fmt, row.dtype, row.numel(), segments,
                                                                         self.config.format_block)
        return self._formats[key]

    def segments(self, numel: int) -> list[tuple[int, int, bool]] | None:
        """A row of ``numel`` elements of this unit's flat buffer as ``(start, numel, 2-D or larger)`` per parameter
        (its padded shard), or None where the row is not the unit's shards."""
        if self.param_group is None:
            return None
        params = self.param_group.fsdp_params
        sizes = [p.padded_sharded_param_size.numel() for p in params]
        if sum(sizes) != numel:
            return None
        segments, at = [], 0
        for p, size in zip(params, sizes):
            segments.append((at, size, len(p._orig_size) >= 2))
            at += size
        return segments


class RingAllGather(_RingComm, AllGather):
    """``fully_shard``'s all-gather as a bucketed ring (``FSDPModule.set_custom_all_gather``)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        # its hops are counted and its wait timed where it is waited for (ring/issue.py)
        return ring_all_gather(output_tensor, input_tensor, group, async_op=async_op, label=self.label,
                               stats=self.recorder, wire=self.wire(self.config.gather_format, input_tensor, True),
                               **self.config.ring_kwargs)


class RingReduceScatter(_RingComm, ReduceScatter):
    """``fully_shard``'s reduce-scatter as a bucketed ring (``FSDPModule.set_custom_reduce_scatter``).

    ``op``: SUM and AVG as FSDP2 passes them, and ``ReduceOp.PREMUL_SUM(f)`` (what FSDP2 passes after
    ``set_gradient_divide_factor`` for fp32/bf16 reductions): the ring sums and the output is scaled by ``f``.
    With a ``DeferredReductions`` (``overlap``) it runs behind the compute where FSDP2 does not read its output at
    once ([Note: FSDP2's GPU schedule on the rings]).
    """

    def __init__(self, config: CommFuseConfig | None = None, recorder: StatsRecorder | None = None,
                 label: str | None = None, deferred: DeferredReductions | None = None,
                 residuals: Residuals | None = None, feedback_name: str = "unit") -> None:
        super().__init__(config, recorder, label)
        self.deferred = deferred
        # error feedback (``feedback``): the model's residuals, this unit's under its place in the model
        self.residuals = (residuals if residuals is not None
                          else Residuals(self.config.error_feedback, self.config.feedback_torch_dtype))
        self.feedback_name = feedback_name

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op=dist.ReduceOp.AVG, async_op: bool = False) -> None:
        # FSDP2 ignores the return value of its reduce-scatter: complete on return, or deferred (see above)
        wire = self.wire(self.config.reduce_format, output_tensor, False)
        residual = self.feedback(output_tensor, group) if wire is not None and wire.lossy else None
        replicas = replica_group(self.param_group)  # HSDP on the rings: the all-reduce FSDP2 calls next
        if self.deferred is not None and self.deferred.may_defer(self.param_group, output_tensor, op):
            work = ring_reduce_scatter(output_tensor, input_tensor, group, op, async_op=True, label=self.label,
                                       stats=self.recorder, wire=wire, residual=residual,
                                       **self.config.ring_kwargs)
            self.deferred.add(work)
            if replicas is not None:
                replicas.expect(output_tensor, self.segments(output_tensor.numel()) or (), self, work, self.deferred)
            return None
        scale = None
        if getattr(op, "op", None) == dist.ReduceOp.PREMUL_SUM:
            scale, op = op.factor, dist.ReduceOp.SUM
        ring_reduce_scatter(output_tensor, input_tensor, group, op, label=self.label, stats=self.recorder,
                            wire=wire, residual=residual, **self.config.ring_kwargs)
        if scale is not None:
            output_tensor.mul_(scale)
        if replicas is not None:
            replicas.expect(output_tensor, self.segments(output_tensor.numel()) or (), self)
        return None


    def feedback(self, output: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor | None:
        """With ``error_feedback``: what encoding lost of this rank's piece of each shard, kept from one
        reduce-scatter of the unit to the next (in ``feedback_dtype``, a row per shard)."""
        if not self.config.error_feedback:
            return None
        return self.residuals.get(self.feedback_name, (group.size(), output.numel()), output.device)


class DeferredReductions:
    """The reduce-scatters of one model's FSDP2 units that run behind the backward's compute, waited for by the
    backward's last autograd callback ([Note: FSDP2's GPU schedule on the rings]). CPU only: on CUDA the ring's
    reduce-scatter is ordered on its stream already and the host never waits for it."""

    def __init__(self) -> None:
        self.pending: list[dist.Work] = []
        self._queued: int | None = None  # the graph task whose callback waits for them
        self._finished: int | None = None  # the graph task whose callback ran already

    def may_defer(self, param_group, output: torch.Tensor, op) -> bool:
        """Whether FSDP2 leaves ``output`` unread until the end of the backward: it becomes the gradients' storage
        as it is (AVG: no divide after the sum; no cast; no HSDP all-reduce or hook), no gradient is accumulated
        into and no post-accumulate-grad hook reads one, inside a backward whose final callbacks have not run."""
        if output.device.type != "cpu" or param_group is None or op != dist.ReduceOp.AVG:
            return False
        task = torch._C._current_graph_task_id()
        if task == -1 or task == self._finished:
            return False
        if param_group._all_reduce_hook is not None:
            return False
        if isinstance(param_group.mesh_info, DDPMeshInfo):  # HSDP: its all-reduce follows on the rings, unread
            if replica_group(param_group) is None or not param_group.all_reduce_grads:
                return False  # (FSDP2's own all-reduce; or accumulation, which adds the output in at once)
            if param_group._partial_reduce_output is not None:
                return False  # (the partial sum of no-all-reduce micro-batches is added in at once)
        if param_group._orig_dtype not in (None, output.dtype):
            return False
        for fsdp_param in param_group.fsdp_params:
            param = fsdp_param.sharded_param
            if (param.grad is not None or fsdp_param.offload_to_cpu
                    or getattr(param, "_post_accumulate_grad_hooks", None)):
                return False
        return True

    def add(self, work: dist.Work | None) -> None:
        if work is None:  # (one rank: nothing in flight)
            return
        self.pending.append(work)
        task = torch._C._current_graph_task_id()
        if task != self._queued:
            self._queued = task
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._finished, self._queued = self._queued, None
        self.wait()

    def wait(self) -> None:
        """Wait for every deferred reduce-scatter (re-raising a ring error); each wait is timed as it is waited
        for (``ring/issue.py``)."""
        pending, self.pending = self.pending, []
        for work in pending:
            work.wait()


def replica_group(param_group) -> RingReplicaGroup | None:
    """The ``RingReplicaGroup`` an HSDP unit all-reduces with across the replicas (``use_ring_collectives``), or
    None (no HSDP, or FSDP2's own all-reduce)."""
    if param_group is None or not isinstance(param_group.mesh_info, DDPMeshInfo):
        return None
    group = getattr(param_group.mesh_info, "replicate_process_group", None)
    return group if isinstance(group, RingReplicaGroup) else None


def replica_groups(model: nn.Module) -> list[RingReplicaGroup]:
    """The ``RingReplicaGroup``s the HSDP units of ``model`` all-reduce with (one per replicate group; none without
    HSDP on the rings)."""
    found: dict[int, RingReplicaGroup] = {}
    for _, _, state in _units(model):
        for group in param_groups(state):
            replicas = replica_group(group)
            if replicas is not None:
                found.setdefault(id(replicas), replicas)
    return list(found.values())


def _units(model: nn.Module) -> list[tuple[str, FSDPModule, object]]:
    """``(name, module, FSDP state)`` per FSDP2 unit. ``fully_shard([a, b])`` makes ``a`` and ``b`` one unit (one state,
    one parameter group), as transformers does for a final norm and lm_head: it is listed once, named
    ``a+b``."""
    units: dict[int, tuple[list[str], FSDPModule, object]] = {}
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            units.setdefault(id(state), ([], module, state))[0].append(name or "(root)")
    return [("+".join(names), module, state) for names, module, state in units.values()]


def _check_replaceable(unit: str, kind: str, comm: object) -> None:
    if isinstance(comm, _RingComm):
        if comm.owner == _SHARD_OWNER:
            raise ValueError(
                f"use_ring_collectives: FSDP2 unit '{unit}' was sharded by commfuse_dp.shard(), which already runs "
                f"its collectives on rings, with its config's bucket_mb / timeout_s and step statistics; calling "
                f"use_ring_collectives again would drop both. Do not call it on a model shard() sharded: pass those "
                f"settings in the CommFuseConfig given to shard().")
        return  # ours, from an earlier use_ring_collectives: replaced
    if type(comm) not in (DefaultAllGather, DefaultReduceScatter):  # FSDP2's own; a subclass is someone's
        raise ValueError(
            f"use_ring_collectives: FSDP2 unit '{unit}' already has a custom {kind} ({type(comm).__name__}, from "
            f"set_custom_{kind.replace('-', '_')}, set_symm_mem_for_comm or "
            f"set_allocate_memory_from_process_group_for_comm); the rings would replace it. Remove it, or install "
            f"the rings only on the other units yourself: unit.set_custom_all_gather(RingAllGather(config)) and "
            f"unit.set_custom_reduce_scatter(RingReduceScatter(config)).")


def param_groups(state) -> list:
    """The unit's FSDP2 parameter groups: a list from torch 2.13 on; one group or None before (torch 2.11, which
    the GPU check of ``benchmarks/cuda_check.py`` met)."""
    if hasattr(state, "_fsdp_param_groups"):
        return state._fsdp_param_groups
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []


def use_ring_collectives(model: nn.Module, config: CommFuseConfig | None = None, *, overlap: bool = False,
                         recorder: StatsRecorder | None = None) -> nn.Module:
    """Install ``RingAllGather`` / ``RingReduceScatter`` on every FSDP2 unit inside ``model`` (itself included)
    and return ``model``. ``config`` gives ``bucket_mb`` and ``timeout_s`` (default ``CommFuseConfig()``);
    ``recorder`` is internal (``commfuse_dp.shard()`` passes its statistics). Calling it again replaces the
    rings it installed before.

    ``overlap=True``: FSDP2's GPU schedule, also on CPU ([Note: FSDP2's GPU schedule on the rings]): the next
    unit's all-gather issued one unit ahead and asynchronously in forward (units in module order) and backward,
    the reduce-scatters running behind the backward's compute and waited for at its end. Off (default): FSDP2's
    own prefetch settings are left as they are (on CPU FSDP2 waits for each collective where it issues it).

    Raises ``ValueError``, changing nothing, when no module was ``fully_shard``-ed; when a unit has several
    parameter groups (``shard_placement_fn`` with per-parameter meshes), which FSDP2's custom-comm hooks cannot
    serve; when a unit already has another custom collective; when ``commfuse_dp.shard()`` sharded the model
    (it installed its own rings). ``TypeError`` when ``model`` is not an ``nn.Module``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"use_ring_collectives: expected the model (an nn.Module), got {type(model).__name__}; "
                        f"pass the model that fully_shard / from_pretrained(distributed_config=...) returned")
    from_shard = recorder is not None  # only commfuse_dp.shard() passes a recorder
    if not from_shard:
        _refuse_shard_models(model)
    config = config if config is not None else CommFuseConfig()
    units = _units(model)
    if not units:
        raise ValueError(
            "use_ring_collectives: no module of this model was sharded with fully_shard. Call it after "
            "fully_shard(...) on the layers and the root, or on the model that "
            "from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=N)) returned (with "
            "dp_replicate_size * fsdp_size > 1; a DistributedConfig with only tp_size applies no FSDP2)")
    _check_units(units, from_shard)
    deferred = DeferredReductions() if overlap else None
    residuals = residuals_of(model)  # (shard() made them already; again here: the same, kept)
    if residuals is None:
        residuals = handle_of(model, create=True).residuals = Residuals()
    residuals.enabled, residuals.dtype = config.error_feedback, config.feedback_torch_dtype
    gathering = _install_rings(units, config, recorder, from_shard, deferred, residuals)
    _install_schedule(model, gathering, overlap, deferred)
    return model


def _refuse_shard_models(model: nn.Module) -> None:
    """A model that ``commfuse_dp.shard()`` sharded (or holds one) runs its rings already: refused."""
    for name, module in model.named_modules():
        if engine_of(module, through_wrapper=False) is not None:
            where = f"submodule '{name}'" if name else "this model"
            raise ValueError(
                f"use_ring_collectives: {where} was sharded by commfuse_dp.shard(), which already runs every "
                f"collective of it on rings (fused layers and FSDP2 units alike), with its config's bucket_mb / "
                f"timeout_s and step statistics; calling use_ring_collectives again would drop both. Do not "
                f"call it on a model shard() sharded: pass those settings in the CommFuseConfig given to "
                f"shard().")


def _check_units(units: list, from_shard: bool) -> None:
    """Every unit can take the rings: one parameter group, FSDP2's own collectives (or ours), cpu or cuda."""
    for unit, module, state in units:
        groups = param_groups(state)
        if len(groups) > 1:
            raise ValueError(
                f"use_ring_collectives: module '{unit}' ({type(module).__name__}) has {len(groups)} parameter "
                f"groups (per-parameter meshes from shard_placement_fn); FSDP2 can install a custom collective only "
                f"on a unit with one group. Shard that unit's parameters on one mesh, or leave it out of fully_shard's "
                f"shard_placement_fn.")
        for group in groups:
            if not from_shard:
                _check_replaceable(unit, "all-gather", group._all_gather_comm)
                _check_replaceable(unit, "reduce-scatter", group._reduce_scatter_comm)
            if group.device.type not in ("cpu", "cuda"):
                raise ValueError(f"use_ring_collectives: FSDP2 unit '{unit}' is on {group.device.type!r}; the "
                                 f"rings run on cpu (gloo) and cuda (nccl) only")


def _install_rings(units: list, config: CommFuseConfig, recorder: StatsRecorder | None, from_shard: bool,
                   deferred: DeferredReductions | None, residuals: Residuals) -> list[nn.Module]:
    """A ``RingAllGather`` and a ``RingReduceScatter`` on each unit with parameters; returns those units, in module
    order. ``residuals``: the model's error-feedback residuals (``feedback.py``)."""
    gathering = []  # the units with parameters, in module order
    replicas: dict[int, RingReplicaGroup] = {}  # per replicate process group
    for unit, module, state in units:
        groups = param_groups(state)
        if not groups:  # a unit whose parameters all went to inner units: nothing to gather
            continue
        gathering.append(module)
        gather = RingAllGather(config, recorder, f"FSDP2 unit {unit} (all-gather)")
        scatter = RingReduceScatter(config, recorder, f"FSDP2 unit {unit} (reduce-scatter)", deferred, residuals,
                                    f"unit:{len(gathering) - 1}")
        gather.param_group = scatter.param_group = groups[0]
        info = groups[0].mesh_info
        if isinstance(info, DDPMeshInfo):  # HSDP: the all-reduce across the replicas on their ring
            current = info.replicate_process_group
            real = current.group if isinstance(current, RingReplicaGroup) else current
            if id(real) not in replicas:
                replicas[id(real)] = RingReplicaGroup(real, config.reduce_format, config.format_block,
                                                      config.error_feedback, config.ring_kwargs, recorder,
                                                      residuals)
            info.replicate_process_group = replicas[id(real)]
        if from_shard:
            gather.owner = scatter.owner = _SHARD_OWNER
        module.set_custom_all_gather(gather)
        module.set_custom_reduce_scatter(scatter)
    return gathering


def _install_schedule(model: nn.Module, gathering: list[nn.Module], overlap: bool,
                      deferred: DeferredReductions | None) -> None:
    """FSDP2's GPU schedule on the units (``overlap``), or FSDP2's own settings back where an earlier call set it."""
    handle = handle_of(model, create=True)
    if overlap or handle.deferred_reductions is not None:  # (un)install the schedule
        for module, following in zip(gathering, gathering[1:] + [None]):
            module._set_unshard_async_op(overlap)
            module.set_modules_to_forward_prefetch([following] if overlap and following is not None else [])
    if handle.backward_gather is not None:
        handle.backward_gather.remove()
    handle.backward_gather = (model.register_forward_hook(_gather_for_backward)
                              if overlap and isinstance(model, FSDPModule) else None)
    handle.deferred_reductions = deferred


def _gather_for_backward(root: nn.Module, args, output) -> None:
    """The root's forward ended: once a backward reaches its outputs, issue the all-gather of the last unit of the
    forward that was resharded after it, the first the backward waits for, as a GPU's host does by running ahead
    into the backward ([Note: FSDP2's GPU schedule on the rings]). FSDP2's own backward prefetch then finds it
    issued. A forward that no backward follows (gradients on, but the outputs dropped) issues nothing."""
    if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
        return
    needing = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not needing:
        return
    order = root._get_fsdp_state()._comm_ctx.post_forward_order

    def backward_begins(grads) -> None:
        for group in reversed(order):
            if not group.is_unsharded:
                FSDPParamGroup._prefetch_unshard(group, "backward")
                return

    torch.autograd.graph.register_multi_grad_hook(needing, backward_begins, mode="any")
