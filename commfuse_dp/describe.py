"""``describe(model)``: what ``shard()`` fused, what it left to FSDP2, what it excluded, and what each part moves.

    report = commfuse_dp.describe(model)
    print(report)                 # a table
    json.dumps(report.as_dict())  # the same, as plain values

The report is read off the sharded model itself: fused linears carry ``_cf_group`` / ``_cf_index``
(``fused/modules.py``), ring embeddings ``_cf_embedding``, FSDP2 units are ``FSDPModule`` s, the world size is
that of the engine's ring and the excluded modules are the model's handle's (``handle_of(model)``).

Bytes are those one rank *sends* in one training step (forward + backward, gradient sync on); it receives as many.
With N ranks, for

- a fused linear group of ``s`` elements per rank (its packed weight and bias shards, rows padded to
  ``ceil(out / N)``): forward all-gather ``(N-1)·s``, backward all-gather ``(N-1)·s`` (to form the input gradient),
  reduce-scatter ``(N-1)·s`` gradient elements. The last fused group of the forward (usually the lm_head) keeps its
  gathered weight for its backward (``slicing``; ``fused`` with ``prefetch_next``), from the second step on: its
  backward all-gather is 0. Which group is last is taken from module order here.
- an FSDP2 unit (its own parameters, without fused ones or nested units', each padded to a multiple of N rows;
  ``fully_shard([a, b])`` is one unit, named ``a+b``): all-gather forward and backward and reduce-scatter,
  ``(N-1)/N`` of the unit's padded bytes each. The root is not resharded after forward (FSDP2's default), nor is a
  unit made with ``reshard_after_forward=False`` (the peer's last layer, final norm and lm_head), so they gather
  once.
- a ring embedding: it depends on the tokens. The figures are those of its *table* path (all-gather the table
  shards, reduce-scatter the table gradient), an upper bound: the *rows* path, taken where it moves less, receives
  at most ``T·H`` elements each way with ``T`` tokens per rank (one direct exchange).

Gathers move the compute dtype (``param_dtype``, else the parameter's), reduce-scatters ``reduce_dtype`` (else the
compute dtype), unless ``gather_format`` / ``reduce_format`` narrows them: then the bytes are the encoded rows'
(``commfuse_dp/wire.py``: 2-D parameters in the format, scales included; 1-D ones as they are). Ring embeddings
travel as they are. ``error_feedback_bytes``: the residuals ``error_feedback`` keeps on this rank, in
``feedback_dtype`` (``feedback_dtype``'s element size x world x the shard elements of every fused group and unit
whose gradients travel narrow; under HSDP also one copy of each such gradient shard for the exchange across the
copies).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from .config import CommFuseConfig
from .handle import engine_of, handle_of
from .ring.fsdp_comm import param_groups
from .runtime.layout import conv1d_class
from .wire import row_bytes

logger = logging.getLogger("commfuse_dp")

FUSED_FRACTION_WARNING = 0.5  # shard() warns when fewer of the parameter bytes than this are fused


@dataclass
class FusedGroupInfo:
    modules: list[str]
    weight_shapes: list[tuple[int, ...]]
    shard_numel: int  # elements per rank in the group's ring buffer (weights and biases, padded rows)
    forward_gather_bytes: int
    backward_gather_bytes: int
    reduce_scatter_bytes: int
    note: str = ""


@dataclass
class EmbeddingInfo:
    module: str
    shape: tuple[int, ...]
    shard_numel: int
    forward_gather_bytes: int  # table path: an upper bound
    backward_gather_bytes: int
    reduce_scatter_bytes: int
    note: str = "upper bound (table path); the rows path, taken where it moves less, receives at most T*H elements each way"


@dataclass
class UnitInfo:
    module: str
    params: int  # parameter tensors this unit shards itself
    numel: int  # their elements (full, unsharded)
    forward_gather_bytes: int
    backward_gather_bytes: int
    reduce_scatter_bytes: int
    note: str = ""
    shard_numel: int = 0  # elements of one rank's row (each parameter's shard padded)
    second_copy_bytes: int = 0  # hpZ (CommFuseConfig.hpz_size): its weights' second copy on this rank, fwd to bwd


@dataclass
class ShardReport:
    """What ``shard()`` made of a model (``describe``). ``str()`` is a table, ``as_dict()`` plain values."""

    world: int
    schedule: str
    fused_groups: list[FusedGroupInfo] = field(default_factory=list)
    ring_embeddings: list[EmbeddingInfo] = field(default_factory=list)
    fsdp_units: list[UnitInfo] = field(default_factory=list)
    excluded: dict[str, str] = field(default_factory=dict)
    fused_param_bytes: int = 0  # full bytes of the parameters in fused linears and ring embeddings
    total_param_bytes: int = 0
    choice: dict[str, Any] = field(default_factory=dict)  # what CommFuseConfig's "auto" settings became (choose.py)
    copies: int = 1  # HSDP: the model's copies, each sharded over ``world`` ranks (CommFuseConfig.replicate)
    gather_format: str = "exact"  # what weight gathers put on the wire (CommFuseConfig.gather_format)
    reduce_format: str = "exact"
    error_feedback_bytes: int = 0  # residuals kept on this rank (CommFuseConfig.error_feedback)
    feedback_dtype: str = "bfloat16"  # what they are kept in (CommFuseConfig.feedback_dtype)
    tensor_parallel: dict[str, Any] = field(default_factory=dict)  # CommFuseConfig.tp_size (tp.TensorParallel.report)

    def bytes_per_step(self) -> dict[str, int]:
        """Bytes this rank sends per training step, per part and in all."""
        parts = {"fused_linears": self.fused_groups, "ring_embeddings": self.ring_embeddings,
                 "fsdp_units": self.fsdp_units}
        out = {name: sum(i.forward_gather_bytes + i.backward_gather_bytes + i.reduce_scatter_bytes for i in items)
               for name, items in parts.items()}
        out["total"] = sum(out.values())
        return out

    @property
    def fused_fraction(self) -> float:
        return self.fused_param_bytes / self.total_param_bytes if self.total_param_bytes else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["bytes_per_step"] = self.bytes_per_step()
        out["fused_fraction"] = self.fused_fraction
        return out

    def __str__(self) -> str:
        copies = f" in each of {self.copies} copies (HSDP)" if self.copies > 1 else ""
        lines = [f"commfuse_dp: {self.world} ranks{copies}, {self.schedule} schedule; "
                 f"{_size(self.fused_param_bytes)} of {_size(self.total_param_bytes)} parameters ({self.fused_fraction:.0%}) in fused linears and ring "
                 f"embeddings; bytes sent per rank per training step"]
        lines += _tensor_parallel_lines(self.tensor_parallel)
        copy = sum(u.second_copy_bytes for u in self.fsdp_units)
        if copy:
            lines.append(f"hpZ: the units' backward gathers run inside groups of ranks (a node) from a second copy "
                         f"of their weights, {_size(copy)} a rank in all, each unit's held from its forward to its "
                         f"backward")
        if (self.gather_format, self.reduce_format) != ("exact", "exact"):
            lines.append(f"on the wire: gathers {self.gather_format}, gradients {self.reduce_format} (2-D parameters; "
                         f"1-D ones and ring embeddings as they are)" + (
                             f"; error feedback keeps {_size(self.error_feedback_bytes)} of {self.feedback_dtype} "
                             f"residuals"
                             if self.error_feedback_bytes else ""))
        if self.choice:
            replicate = f"replicate {self.choice['replicate']}, " if "replicate" in self.choice else ""
            replicate += f"hpz_size {self.choice['hpz_size']}, " if "hpz_size" in self.choice else ""
            lines.append(f"chosen: {replicate}schedule {self.choice['schedule']!r}, piece_shards "
                         f"{self.choice['piece_shards']}: "
                         f"{self.choice['reason']}" + (f" [{self.choice['machine']}]" if self.choice["machine"] else ""))
            if self.choice["predicted_s"]:
                lines.append("  predicted step s: " + ", ".join(
                    f"{name} {seconds:.4g}" for name, seconds in self.choice["predicted_s"].items()))
        head = ("fwd gather", "bwd gather", "reduce-scatter")
        rows = [(_group_name(g.modules), " ".join("x".join(map(str, s)) for s in g.weight_shapes), str(g.shard_numel),
                 *_moves(g), g.note) for g in self.fused_groups]
        lines += _table(f"fused linear groups ({len(rows)})", ("modules", "weight shapes", "shard elems", *head, ""),
                        rows)
        rows = [(e.module, "x".join(map(str, e.shape)), str(e.shard_numel), *_moves(e), e.note)
                for e in self.ring_embeddings]
        lines += _table(f"ring embeddings ({len(rows)})", ("module", "table", "shard elems", *head, ""), rows)
        rows = [(u.module or "(root)", str(u.params), str(u.numel), *_moves(u), u.note) for u in self.fsdp_units]
        lines += _table(f"FSDP2 units ({len(rows)})", ("module", "params", "elements", *head, ""), rows)
        rows = [(name, reason) for name, reason in self.excluded.items()]
        lines += _table(f"excluded from the fused path ({len(rows)})", ("module", "why"), rows)
        totals = self.bytes_per_step()
        lines.append("total sent per rank per step: " + ", ".join(
            f"{name.replace('_', ' ')} {_size(b)}" for name, b in totals.items()))
        return "\n".join(lines)


def describe(model: nn.Module) -> ShardReport:
    """The report of a model sharded by ``commfuse_dp.shard()`` (see the module docstring for the byte counts)."""
    handle = handle_of(model)
    engine = handle.engine if handle is not None else None
    if engine is None:
        raise ValueError("describe: this model was not sharded with commfuse_dp.shard(); call shard(model, config) "
                         "first")
    config: CommFuseConfig = engine.config
    world = engine.ring.size
    choice = handle.choice
    report = ShardReport(world=world, schedule=config.schedule, excluded=dict(handle.excluded),
                         choice=choice.as_dict() if choice is not None else {}, gather_format=config.gather_format,
                         reduce_format=config.reduce_format, feedback_dtype=config.feedback_dtype,
                         copies=engine.replicas.size if engine.replicas is not None else 1,
                         tensor_parallel=handle.tp.report() if handle.tp is not None else {})
    named = list(model.named_modules())
    fused_params: set[int] = set()
    groups: dict[int, list[tuple[int, str, nn.Module]]] = {}
    for name, m in named:
        group = m.__dict__.get("_cf_group")
        if group is not None:
            groups.setdefault(id(group), []).append((m._cf_index, name, m))
            fused_params.update(id(p) for p in m.parameters(recurse=False))
        elif m.__dict__.get("_cf_embedding") is not None:
            fused_params.update(id(p) for p in m.parameters(recurse=False))
            report.ring_embeddings.append(_embedding_info(name, m, world, config))
    keeps_last = world > 1 and (config.schedule == "slicing" or config.prefetch_next)
    for i, members in enumerate(groups.values()):
        members.sort(key=lambda t: t[0])
        report.fused_groups.append(_group_info(members, world, config, keeps_last and i == len(groups) - 1))
    units: dict[int, list[tuple[str, nn.Module]]] = {}  # fully_shard([a, b]): one unit, one state
    for name, m in named:
        if isinstance(m, FSDPModule):
            units.setdefault(id(m._get_fsdp_state()), []).append((name, m))
    for members in units.values():
        report.fsdp_units.append(_unit_info(members, model, fused_params, world, config))
    if config.error_feedback and config.reduce_format != "exact" and world > 1:
        reduced = [g.shard_numel for g in report.fused_groups if g.reduce_scatter_bytes]
        reduced += [u.shard_numel for u in report.fsdp_units if u.reduce_scatter_bytes]
        item = config.feedback_torch_dtype.itemsize
        report.error_feedback_bytes = item * world * sum(reduced)  # a row per shard of each
        if engine.replicas is not None:  # HSDP: the exchange across the copies keeps one of each shard too
            report.error_feedback_bytes += item * sum(reduced)
    params = list(model.parameters())
    report.total_param_bytes = sum(_bytes(p) for p in params)
    report.fused_param_bytes = sum(_bytes(p) for p in params if id(p) in fused_params)
    return report


def warn_if_little_fused(model: nn.Module, config: CommFuseConfig, asked_schedule: str = "fused",
                         predict: Callable[[int], Any] | None = None) -> None:
    """On rank 0 of the group: a WARNING when fewer than half of the parameter bytes were fused, with the figures
    and the setting that would fuse the linears it left out for being small. ``asked_schedule``: the schedule the
    user's config named (``"auto"`` settles on fsdp2 where fusing is predicted to lose, so the setting names
    ``schedule='fused'`` then); ``predict(min_fuse_numel)``: the planner's ``Choice`` for the fused schedule with
    that threshold, whose predicted step the warning sets beside the one chosen now."""
    engine = engine_of(model)
    if engine.ring.rank != 0:
        return
    report = describe(model)
    if report.total_param_bytes == 0 or report.fused_fraction >= FUSED_FRACTION_WARNING:
        return
    small = _small_linears(model, engine.ring.size, config)
    hints = []
    if small:
        least = min(small)
        setting = (f"schedule='fused', min_fuse_numel={least}" if asked_schedule == "auto"
                   else f"min_fuse_numel={least}")
        hints.append(f"{len(small)} linears were left out for weight shards below min_fuse_numel="
                     f"{config.min_fuse_numel} elements (largest {max(small)}, smallest {least}); "
                     f"CommFuseConfig({setting}) would fuse them all{_predicted(model, config, predict, least)}")
    if report.excluded:
        hints.append(f"{len(report.excluded)} modules are excluded (CommFuseConfig.exclude / exclude_data_dependent; "
                     f"the INFO log of commfuse_dp says why)")
    hint = "; ".join(hints) or "no linear was left out for its size or excluded (the INFO log of commfuse_dp says why)"
    logger.warning("commfuse_dp.shard: only %s of %s parameter bytes (%.0f%%) are in fused linears and ring "
                   "embeddings (%d fused groups, %d ring embeddings); the rest goes through FSDP2 with the "
                   "bucketed rings, so CommFuse hides little communication. %s. commfuse_dp.describe(model) "
                   "lists every part", _size(report.fused_param_bytes), _size(report.total_param_bytes),
                   100 * report.fused_fraction, len(report.fused_groups), len(report.ring_embeddings), hint)


def _predicted(model: nn.Module, config: CommFuseConfig, predict: Callable[[int], Any] | None, least: int) -> str:
    """The planner's step with every linear fused against the step chosen now, where it predicted both."""
    chosen = handle_of(model).choice
    now = chosen.predicted_s.get(f"fused, piece_shards={config.piece_shards}") if chosen is not None else None
    lower = predict(least) if predict is not None and now is not None else None
    if lower is None or not lower.predicted_s:
        return ""
    then = lower.predicted_s[f"fused, piece_shards={lower.piece_shards}"]
    verdict = "; layers this small cost more in hops than they hide here" if then > now else ""
    return f" (the planner predicts {then:.3g} s a step with them fused, against {now:.3g} s now{verdict})"


# ---- the parts -------------------------------------------------------------------------------------------

def _group_info(members: list[tuple[int, str, nn.Module]], world: int, config: CommFuseConfig,
                keeps: bool) -> FusedGroupInfo:
    numel, shapes, trainable, segments = 0, [], False, []
    for _, _, m in members:
        shape = tuple(m.weight.shape)
        out_f, in_f = (shape[1], shape[0]) if m._cf_transposed else shape
        chunk = -(-out_f // world)
        segments.append((numel, chunk * in_f, True))
        if m.bias is not None:
            segments.append((numel + chunk * in_f, chunk, False))
        numel += chunk * in_f + (chunk if m.bias is not None else 0)
        shapes.append(shape)
        trainable |= any(p.requires_grad for p in m.parameters(recurse=False))
    weight = members[0][2].weight
    gather = (world - 1) * _row(config.gather_format, _compute(config, weight.dtype), segments, True, config, world)
    reduce = (world - 1) * _row(config.reduce_format, _reduce(config, weight.dtype), segments, False, config,
                                world) if trainable else 0
    notes = []
    if keeps:
        notes.append("last fused group of the forward (by module order): keeps its weight for its backward")
    if not trainable:
        notes.append("frozen: no gradient")
    return FusedGroupInfo([n for _, n, _ in members], shapes, numel, gather, 0 if keeps else gather, reduce,
                          "; ".join(notes))


def _embedding_info(name: str, m: nn.Module, world: int, config: CommFuseConfig) -> EmbeddingInfo:
    rows, hidden = m.weight.shape
    shard = -(-rows // world) * hidden
    gather = (world - 1) * shard * _compute(config, m.weight.dtype).itemsize
    reduce = (world - 1) * shard * _reduce(config, m.weight.dtype).itemsize if m.weight.requires_grad else 0
    return EmbeddingInfo(name, (rows, hidden), shard, gather, 0, reduce)


def _unit_info(members: list[tuple[str, nn.Module]], model: nn.Module, fused: set[int], world: int,
               config: CommFuseConfig) -> UnitInfo:
    mine = {id(m) for _, m in members}
    nested = {id(p) for _, unit in members for m in unit.modules()
              if id(m) not in mine and isinstance(m, FSDPModule) for p in m.parameters()}
    # 0-d parameters are no unit's: replicated, averaged after backward (scalars.py)
    own = list({id(p): p for _, unit in members for p in unit.parameters()
                if id(p) not in fused and id(p) not in nested and p.dim() > 0}.values())
    segments, at = _segments(own, world)
    dtype = own[0].dtype if own else torch.float32
    gather = (world - 1) * _row(config.gather_format, _compute(config, dtype), segments, True, config, world)
    reduce = (world - 1) * _row(config.reduce_format, _reduce(config, dtype), segments, False, config, world) \
        if any(p.requires_grad for p in own) else 0
    root = members[0][1] is model
    groups = param_groups(members[0][1]._get_fsdp_state())
    kept = not root and bool(groups) and groups[0].post_forward_mesh_info is None  # reshard_after_forward=False
    after = groups[0].post_forward_mesh_info if groups and not kept and not root else None
    second = after.shard_mesh_size if after is not None and after.shard_mesh_size < world else 0  # hpZ
    note = ("root: stays gathered from forward to backward" if root else
            "kept gathered from forward to backward (reshard_after_forward=False)" if kept else
            f"a second copy over {second} ranks after the forward (hpZ): the backward gathers there" if second else "")
    backward, copy = (0 if root or kept else gather), 0
    if second:
        rows, numel = _segments(own, second)
        backward = (second - 1) * _row(config.gather_format, _compute(config, dtype), rows, True, config, second)
        copy = numel * _compute(config, dtype).itemsize
    return UnitInfo("+".join(name for name, _ in members), len(own), sum(p.numel() for p in own), gather,
                    backward, reduce, note, at, copy)


def _segments(params: list[torch.Tensor], world: int) -> tuple[list[tuple[int, int, bool]], int]:
    """One rank's row of ``params`` sharded over ``world``: (offset, padded shard elements, 2-D) each, and its
    elements."""
    segments, at = [], 0
    for p in params:
        segments.append((at, _padded_shard(p, world), p.dim() >= 2))
        at += segments[-1][1]
    return segments, at


def _row(fmt: str, dtype: torch.dtype, segments: list[tuple[int, int, bool]], gather: bool, config: CommFuseConfig,
         world: int) -> int:
    """Bytes of one rank's row on the wire (``wire.row_bytes``; one rank moves nothing, so its format is moot)."""
    if not segments or sum(n for _, n, _ in segments) == 0:
        return 0
    return row_bytes(fmt if world > 1 else "exact", dtype, segments, gather, config.format_block)


def _padded_shard(p: torch.Tensor, world: int) -> int:
    rest = p.numel() // p.shape[0] if p.shape[0] else 0
    return -(-p.shape[0] // world) * rest


def _small_linears(model: nn.Module, world: int, config: CommFuseConfig) -> list[int]:
    """Weight shard sizes of the plain linears that were not fused only for being below ``min_fuse_numel``."""
    kinds = tuple(k for k in (nn.Linear, conv1d_class()) if k is not None)
    excluded = handle_of(model).excluded
    owners = Counter(id(p) for m in model.modules() for p in m.parameters(recurse=False))
    sizes = []
    for name, m in model.named_modules():
        if type(m) not in kinds or "_cf_group" in m.__dict__ or _under(name, excluded):
            continue
        if owners[id(m.weight)] == 1 and (m.bias is None or owners[id(m.bias)] == 1):
            shard = m.weight.numel() // world
            if shard < config.min_fuse_numel:
                sizes.append(shard)
    return sizes


def _under(name: str, excluded: dict[str, str]) -> bool:
    parts = name.split(".")
    return any(".".join(parts[:end]) in excluded for end in range(len(parts), 0, -1))


def _compute(config: CommFuseConfig, dtype: torch.dtype) -> torch.dtype:
    return config.param_dtype or dtype


def _reduce(config: CommFuseConfig, dtype: torch.dtype) -> torch.dtype:
    return config.reduce_dtype or _compute(config, dtype)


def _bytes(p: torch.Tensor) -> int:
    return p.numel() * p.dtype.itemsize


# ---- text ----------------------------------------------------------------------------------------------

def _moves(info) -> tuple[str, str, str]:
    return _size(info.forward_gather_bytes), _size(info.backward_gather_bytes), _size(info.reduce_scatter_bytes)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _group_name(names: list[str]) -> str:
    """``a.b.{q_proj,k_proj,v_proj}`` for siblings, else the names joined."""
    parents = {n.rpartition(".")[0] for n in names}
    if len(names) > 1 and len(parents) == 1:
        parent = parents.pop()
        leaves = ",".join(n.rpartition(".")[2] for n in names)
        return f"{parent}.{{{leaves}}}" if parent else f"{{{leaves}}}"
    return ", ".join(names)


def _tensor_parallel_lines(tp: dict[str, Any]) -> list[str]:
    """The mesh and the TP layers' rings (``CommFuseConfig.tp_size``)."""
    if not tp:
        return []
    mesh = " x ".join(f"{name} {size}" for name, size in tp["mesh"].items())
    schedule = "each hop beside a GEMM piece" if tp["fused"] else "the reference schedule (fused=False)"
    return [f"tensor parallel: {tp['size']} ranks, sequence-parallel, {schedule}; mesh {mesh}; this rank's TP group "
            f"{tp['group']} (the data-parallel rings below run over the ranks at its TP position); "
            f"{tp['ring_ops']} ring operations a step, {_size(round(tp['bytes_per_token']))} sent per token of the "
            f"sequence",
            *_table(f"TP layers ({len(tp['layers'])})", ("module", "this rank holds", "forward rings",
                                                         "backward rings"), [tuple(r) for r in tp["layers"]])]


def _table(title: str, head: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    if not rows:
        return [f"{title}: none"]
    widths = [max(len(str(r[i])) for r in (head, *rows)) for i in range(len(head))]
    fmt = lambda r: "  " + "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return [f"{title}:", fmt(head), *(fmt(r) for r in rows)]
