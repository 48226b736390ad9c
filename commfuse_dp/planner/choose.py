"""What ``CommFuseConfig``'s ``"auto"`` settings become for one model on its ranks.

``schedule="auto"`` (the default) runs the fused schedule only where the planner's plays (``plays.py``, the same
that ``commfuse-dp plan`` prints) predict it faster than the peer, stock FSDP2 over torchtitan's units as it runs
on a GPU (``schedule="fsdp2"``), by at least ``MARGIN``; elsewhere the model runs the peer. ``piece_shards="auto"``
takes the piece width with the shortest predicted fused step (on a GPU thin GEMM pieces cost time; on a CPU they do
not, and 1 is kept). ``fsdp2_collectives="auto"``: the peer's units on NCCL's own collectives on CUDA unless the
plays predict the rings faster by ``MARGIN``; the rings on CPU. The plays read:

- the model's shapes: its transformers config (hidden, intermediate and vocabulary sizes, layers, heads);
- the ranks of the shard group;
- the link: ``CommFuseConfig.link_gbps`` and ``ring_latency_us`` where given, else measured at ``shard()`` on the
  shard group (``measure.py``; without a group, as ``commfuse-dp plan`` and the tests call ``choose``: NVLink's
  450 GB/s on CUDA inside one node, 50 GB/s across nodes, 1.25 GB/s on CPU, assumed);
- the GEMM rate: ``CommFuseConfig.tflops`` where given, else measured on the model's layer shapes (without a group:
  400 TFLOP/s in bf16/fp16 and 50 in fp32 on CUDA, 50 GFLOP/s on CPU, assumed);
- the device's other costs: on CUDA the GEMM-piece cost and host time measured on an H200 (the host issuing ahead
  of the device); on CPU whole-GEMM pieces, this library's host time and FSDP2's copies into and out of its flat
  buffers on the computing thread (both measured on this project's 2-core machines);
- the tokens of one rank's step: ``CommFuseConfig.tokens_per_rank`` where given, else the first batch where the
  Trainer integrations shard the model, else 8 sequences of the model's context (``max_position_embeddings``: the
  Trainer's default per-device batch of full sequences), at most 8192.

Measured figures are the median rank's, so every rank makes the same choice (``shard()`` checks before that the
ranks agree on the config and the model). ``describe(model)`` prints the choice with its predictions and says of
each input whether it was given, measured or assumed; an explicit setting is kept as given.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch
import torch.nn as nn

from ..config import CommFuseConfig
from ..handle import handle_of
from .measure import Measured, layer_shapes, measure_machine
from .plan import MARGIN, UNPLAYED, decide, peer_step, with_formats
from .costs import CPU_HOST_FIT, H200_HOST_FIT, H200_PIECE_FIT, Cluster, Unit, peer_host_on_cpu, placed, units_for

__all__ = ["MARGIN", "Choice", "Resolved", "choose", "decide", "resolve"]

# a narrow format's codec, seconds per element and pass, where it was not measured (``choose`` without a group):
# on CUDA the figure the planner's GPU sweeps take; on a CPU (False) the median of 3 ``wire.measure_codec`` runs of
# a 256 Ki-element fp32 row on a 2-core AMD EPYC
ASSUMED_CODEC_S = {True: dict.fromkeys(("bf16", "fp8", "int8"), 0.002e-9),
                   False: {"bf16": 0.16e-9, "int8": 0.58e-9, "fp8": 1.66e-9}}
DEFAULT_BATCH = 8  # sequences per micro-batch where nothing says: the Trainer's per_device_train_batch_size
DEFAULT_TOKENS_CAP = 8192


class Plan(NamedTuple):
    """The cost model the plays run on (``costs.py``), built once per choice by :func:`cost_model`."""

    units: list[Unit]  # the model's parts at this rank's tokens
    cluster: Cluster  # ranks, link, GEMM rate, host, and the peer's host work and collectives
    described: str  # the cluster in words, each input with where it came from


@dataclass(frozen=True)
class Choice:
    """What ``"auto"`` became, and why (``describe`` prints it)."""

    schedule: str
    piece_shards: int
    reason: str
    predicted_s: dict[str, float] = field(default_factory=dict)  # step seconds per candidate
    machine: str = ""  # the cluster the plays ran on, in words, each input with where it came from
    collectives: str = "rings"  # the fsdp2 schedule's: "rings" or "torch" (FSDP2 as shipped)
    measured: Measured | None = field(default=None, compare=False)  # what the plays read that was measured
    plan: Plan | None = field(default=None, compare=False, repr=False)  # the cost model played; None: none was
    replicate: int | None = None  # on a multi-node launch, the copies chosen (1: one flat ring); None: not chosen
    between: dict | None = None  # on a multi-node launch, the tier between nodes played (``nodes.Machines``'s figures)
    hpz_size: int = 1  # on a multi-node launch, hpZ's group chosen (CommFuseConfig.hpz_size; 1: none)

    def as_dict(self) -> dict:
        out = {"schedule": self.schedule, "piece_shards": self.piece_shards, "reason": self.reason,
               "predicted_s": dict(self.predicted_s), "machine": self.machine, "collectives": self.collectives}
        if self.replicate is not None:
            out["replicate"] = self.replicate
        if self.hpz_size > 1:
            out["hpz_size"] = self.hpz_size
        if self.plan is not None:  # the figures the plays ran on (a shard group's ranks and links)
            cl = self.plan.cluster
            out["played"] = {"ranks": cl.ranks, "link_gbps": cl.bytes_per_s / 1e9, "latency_us": cl.latency_s * 1e6,
                             "tflops": cl.flops_per_s / 1e12, "element_bytes": cl.param_bytes,
                             "tokens": self.plan.units[0].tokens if self.plan.units else None,
                             **({"between_nodes": dict(self.between)} if self.between else {})}
        return out

    def fused_with(self, min_fuse_numel: int) -> Choice | None:
        """The fused schedule at its best piece width on this choice's cost model with ``min_fuse_numel`` instead:
        what ``choose`` gives for ``schedule="fused"`` with that threshold (the little-fused warning sets its step
        beside this one's). None where nothing was played."""
        if self.plan is None:
            return None
        cl = replace(self.plan.cluster, min_fuse_numel=min_fuse_numel)
        _, width, predicted = decide(self.plan.units, cl, "fused", "auto")
        reason = f"schedule='fused' as given; piece_shards={width}: the shortest predicted fused step"
        return Choice("fused", width, reason, predicted, self.plan.described, "rings", self.measured,
                      self.plan._replace(cluster=cl))


class Resolved(NamedTuple):
    """What :func:`resolve` made of a config's ``"auto"`` settings."""

    config: CommFuseConfig  # the schedule, piece width and (under fsdp2) collectives as chosen
    choice: Choice  # what they became and why, with the cost model that was played


def model_shape(model: nn.Module) -> tuple[int, int, int, int, int, int] | None:
    """(hidden, intermediate, layers, heads, kv heads, vocab) from a transformers config, or None."""
    c = getattr(model, "config", None)
    if c is None:
        return None
    get = lambda *names: next((getattr(c, n) for n in names if isinstance(getattr(c, n, None), int)), None)  # noqa
    hidden, layers = get("hidden_size", "n_embd", "d_model"), get("num_hidden_layers", "n_layer", "num_layers")
    heads, vocab = get("num_attention_heads", "n_head", "num_heads"), get("vocab_size")
    if None in (hidden, layers, heads, vocab) or min(hidden, layers, heads, vocab) < 1:
        return None
    intermediate = get("intermediate_size", "n_inner", "d_ff") or 4 * hidden
    return hidden, intermediate, layers, heads, get("num_key_value_heads") or heads, vocab


def tokens_of(model: nn.Module, config: CommFuseConfig) -> tuple[int, str]:
    """A rank's tokens per step and where they came from: given, a Trainer's first batch (``batch_tokens``), or
    assumed: ``DEFAULT_BATCH`` sequences of the model's context, at most ``DEFAULT_TOKENS_CAP``."""
    if config.tokens_per_rank is not None:
        return config.tokens_per_rank, "given"
    handle = handle_of(model, through_wrapper=False)
    from_batch = handle.batch_tokens if handle is not None else None
    if from_batch is not None:
        return from_batch
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(context, int) and context > 0:
        return (min(DEFAULT_BATCH * context, DEFAULT_TOKENS_CAP),
                f"assumed: {DEFAULT_BATCH} sequences of the model's context, at most {DEFAULT_TOKENS_CAP}")
    return 2048, "assumed"


def batch_tokens(model: nn.Module, tokens: int, where: str) -> None:
    """Tell ``shard()``'s defaults a rank's tokens per step, read off a batch (``where`` says which), for a model
    about to be sharded with ``tokens_per_rank`` unset."""
    handle_of(model, create=True).batch_tokens = (int(tokens), where)


def needs_machine(config: CommFuseConfig, ranks: int, model: nn.Module, device: torch.device) -> tuple[bool, bool]:
    """Whether ``choose`` will decide something from the machine, and so wants the link and the GEMM rate measured:
    (link, GEMMs), each only where not given. The schedule under ``"auto"``; under ``"fused"`` the piece width on
    CUDA (on a CPU pieces cost what whole GEMMs do: 1); under ``"fsdp2"`` the collectives on CUDA."""
    if ranks == 1 or model_shape(model) is None:
        return False, False
    cuda = device.type == "cuda"
    plans = {"auto": config.replicate in (1, "auto"), "fused": config.piece_shards == "auto" and cuda,
             "fsdp2": config.fsdp2_collectives == "auto" and cuda}.get(config.schedule, False)
    return plans and (config.link_gbps is None or config.ring_latency_us is None), plans and config.tflops is None


def machine(config: CommFuseConfig, ranks: int, device: torch.device, dtype: torch.dtype, one_node: bool,
            measured: Measured | None = None) -> tuple[Cluster, str]:
    """The cluster the plays run on, and how it was described (each input given, measured or assumed)."""
    nbytes = torch.empty((), dtype=config.param_dtype or dtype).element_size()
    low = nbytes <= 2
    link = measured.link if measured is not None else None
    gemm = measured.gemm if measured is not None else None
    cuda = device.type == "cuda"
    if config.link_gbps is not None:
        bandwidth, b_from = config.link_gbps * 1e9, "given"
    elif link is not None:
        bandwidth, b_from = link.bytes_per_s, f"measured: hops of {link.sizes}"
    else:
        bandwidth = (450e9 if one_node else 50e9) if cuda else 1.25e9
        b_from = ("assumed: NVLink, one node" if one_node else "assumed: across nodes") if cuda else \
            "assumed: 10 Gb Ethernet"
    if config.ring_latency_us is not None:
        latency, l_from = config.ring_latency_us * 1e-6, "given"
    elif link is not None:
        latency, l_from = link.latency_s, "measured"
    else:
        latency, l_from = (15e-6 if cuda else 100e-6), "assumed"
    if config.tflops is not None:
        flops, f_from = config.tflops * 1e12, "given"
    elif gemm is not None:
        flops, f_from = gemm.flops_per_s, f"measured: {gemm.rows} rows on the model's layer shapes"
    else:
        flops, f_from = (400e12 if low else 50e12) if cuda else 50e9, "assumed"
    if cuda:
        cl = Cluster(ranks, bandwidth, latency, flops, nbytes, nbytes, piece_fit=H200_PIECE_FIT,
                     host_fit=H200_HOST_FIT, min_fuse_numel=config.min_fuse_numel)
    else:
        cl = Cluster(ranks, bandwidth, latency, flops, nbytes, nbytes, host_fit=CPU_HOST_FIT, host_on_compute=True,
                     min_fuse_numel=config.min_fuse_numel)
    cl = replace(cl, lookahead_bytes=None if config.lookahead_mb == "auto" else config.lookahead_mb * 2**20,
                 prefetch_depth=config.prefetch_depth)
    return cl, (f"{device.type}, {ranks} ranks, link {bandwidth / 1e9:.3g} GB/s ({b_from}), "
                f"{latency * 1e6:.0f} us a hop ({l_from}), {flops / 1e12:.3g} TFLOP/s ({f_from}), "
                f"{nbytes}-byte elements")


def choose(model: nn.Module, config: CommFuseConfig, ranks: int, device: torch.device, one_node: bool = True,
           measured: Measured | None = None) -> Choice:
    """The schedule, piece width and the fsdp2 schedule's collectives that ``config``'s ``"auto"`` settings stand
    for on this model and machine (``measured``: what ``shard()`` measured of it, ``measure.py``)."""
    explicit_pieces = config.piece_shards != "auto"
    pieces = config.piece_shards if explicit_pieces else 1
    fixed = config.schedule if config.schedule != "auto" else None
    collectives = _collectives(config, device)
    if fixed not in (None, "fused", "fsdp2") or (fixed == "fused" and explicit_pieces):
        return Choice(fixed, pieces, f"schedule={fixed!r} as given")
    if ranks == 1:
        return Choice(fixed or "fused", pieces, "one rank: nothing moves", collectives=collectives or "rings")
    if config.replicate not in (1, "auto") and fixed is None:  # ("auto" here: one node, one copy)
        return Choice("fused", pieces, "HSDP (replicate > 1): the fused rings inside each copy, gradients across them")
    shape = model_shape(model)
    if shape is None:
        if fixed == "fsdp2":
            return Choice("fsdp2", pieces, "schedule='fsdp2' as given", collectives=collectives or "torch")
        return Choice(fixed or "fused", pieces, "the model has no transformers config giving its shapes: "
                                                "fused, not planned")
    plan = cost_model(model, config, shape, ranks, device, one_node, measured, collectives)
    units, cl, described = plan
    formats = ""
    if narrow_formats(config):  # their bytes and their codec played, both schedules on the rings (only they carry them)
        codec, c_from = ((measured.codec, "measured") if measured is not None and measured.codec else
                         (ASSUMED_CODEC_S[device.type == "cuda"], "assumed"))
        cl = replace(with_formats(cl, config.gather_format, config.reduce_format, cl.param_bytes, codec),
                     peer_nccl=False)
        formats = (f" with gather_format={config.gather_format!r}, reduce_format={config.reduce_format!r} "
                   f"({cl.codec_s_per_elem * 1e9:.3g} ns an element and pass, {c_from})")
        described += formats
        plan = Plan(units, cl, described)
    if fixed == "fsdp2":
        predicted: dict[str, float] = {}
        predicted["fsdp2"] = peer_step(units, cl, predicted)
        return Choice("fsdp2", pieces, "schedule='fsdp2' as given" + (_on(predicted) if collectives is None else ""),
                      predicted, described, _collectives_chosen(collectives, predicted), measured, plan)
    schedule, width, predicted = decide(units, cl, config.schedule, config.piece_shards)
    fused_s = predicted[f"fused, piece_shards={width}"] if schedule == "fused" else min(
        v for k, v in predicted.items() if k.startswith("fused"))  # (a lower bound where UNPLAYED is the least)
    if fixed is not None:
        reason = f"schedule='fused' as given; piece_shards={width}: the shortest predicted fused step"
    elif schedule == "fused" and not any(u.groups or u.table for u in placed(units, cl, elastic=True)):
        reason = (f"no layer reaches min_fuse_numel={config.min_fuse_numel}, so none is fused: the FSDP2 units on "
                  f"the library's rings predicted {fused_s:.3g} s a step, the peer (fsdp2) "
                  f"{predicted['fsdp2']:.3g} s: {1 - fused_s / predicted['fsdp2']:.0%} faster")
    elif schedule == "fused":
        reason = (f"fused predicted {fused_s:.3g} s a step, the peer (fsdp2) {predicted['fsdp2']:.3g} s: "
                  f"{1 - fused_s / predicted['fsdp2']:.0%} faster" + formats)
    else:
        reason = (f"the peer (fsdp2) predicted {predicted['fsdp2']:.3g} s a step, {_fused_at_best(predicted)}: "
                  f"fusing does not win by {MARGIN:.0%} here" + (_on(predicted) if collectives is None else "")
                  + formats)
    return Choice(schedule, width, reason, predicted, described,
                  _collectives_chosen(collectives, predicted) if schedule == "fsdp2" else "rings", measured, plan)


def cost_model(model: nn.Module, config: CommFuseConfig, shape: tuple[int, ...], ranks: int, device: torch.device,
               one_node: bool, measured: Measured | None, collectives: str | None) -> Plan:
    """The planner's model of ``model`` (its ``shape``, ``model_shape``) on this machine, in one pass: the cluster
    (``machine``), the units at a rank's tokens (``tokens_of``), the peer's host work on CPU, and the collectives the
    peer plays on (``collectives``: "rings", else NCCL's own on CUDA, both where None)."""
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    cl, described = machine(config, ranks, device, dtype, one_node, measured)
    tokens, t_from = tokens_of(model, config)
    seq = min(tokens, getattr(model.config, "max_position_embeddings", tokens) or tokens)
    described += f", {tokens} tokens per rank ({t_from})"
    units = units_for(*shape, tokens=tokens, seq=seq)
    if device.type != "cuda":  # FSDP2's copies on the computing thread
        cl = replace(cl, peer_host_s=peer_host_on_cpu(units, cl))
    cl = replace(cl, peer_nccl=device.type == "cuda" and collectives != "rings")  # (plays NCCL's and the rings)
    return Plan(units, cl, described)


def narrow_formats(config: CommFuseConfig) -> bool:
    """Whether ``config`` puts a narrow format on the wire ([Note: narrow formats])."""
    return config.gather_format != "exact" or config.reduce_format != "exact"


def _collectives(config: CommFuseConfig, device: torch.device) -> str | None:
    """The fsdp2 schedule's collectives where they need no play: as given, or the rings on CPU (None: CUDA's
    "auto", played)."""
    if config.fsdp2_collectives != "auto":
        return config.fsdp2_collectives
    if narrow_formats(config):
        return "rings"  # (only the rings carry the narrow formats)
    return None if device.type == "cuda" else "rings"


def _collectives_chosen(known: str | None, predicted: dict[str, float]) -> str:
    if known is not None:
        return known
    return "rings" if predicted["fsdp2 on the rings"] <= (1 - MARGIN) * predicted["fsdp2 on NCCL"] else "torch"


def _fused_at_best(predicted: dict[str, float]) -> str:
    """The best fused step ``decide`` knows of, in words: the least played, or where the piece widths it did not
    play (``UNPLAYED``: a lower bound of their steps from compute, GEMM pieces, host time and the link's work) might
    be lower, that bound."""
    played = [v for k, v in predicted.items() if k.startswith("fused, piece_shards=")]
    bound = predicted.get(UNPLAYED)
    if bound is None or (played and min(played) <= bound):
        return f"fused at best {min(played):.3g} s"
    if not played:
        return f"fused at least {bound:.3g} s at every piece width (a lower bound; none could win, none was played)"
    return (f"fused {min(played):.3g} s at best at the piece widths played, at least {bound:.3g} s at the others "
            f"(a lower bound; they could not win and were not played)")


def _on(predicted: dict[str, float]) -> str:
    """Which collectives the peer plays on, where both were played."""
    if "fsdp2 on NCCL" not in predicted:
        return ""
    nccl, rings = predicted["fsdp2 on NCCL"], predicted["fsdp2 on the rings"]
    if rings <= (1 - MARGIN) * nccl:
        return (f"; on the rings ({rings:.3g} s), {1 - rings / nccl:.0%} faster than on NCCL's collectives "
                f"({nccl:.3g} s)")
    return (f"; on NCCL's own collectives ({nccl:.3g} s; the rings {rings:.3g} s: N-1 host-issued hops per "
            f"collective against one kernel, at the same bandwidth)")


def resolve(model: nn.Module, config: CommFuseConfig, ranks: int, device: torch.device, one_node: bool = True,
            group=None) -> Resolved:
    """``config`` with its ``"auto"`` schedule, piece width and fsdp2 collectives replaced by what ``choose`` picks,
    and the choice. ``group``: the shard group, on which what is not given is measured first (every rank calls this
    alike)."""
    measured = None
    if group is not None:
        link, gemm = needs_machine(config, ranks, model, device)
        formats = (config.gather_format, config.reduce_format) if (
            config.schedule == "auto" and narrow_formats(config) and (link or gemm or ranks > 1)
            and model_shape(model) is not None and config.replicate in (1, "auto")) else ()
        if link or gemm or formats:
            shape = model_shape(model)
            dtype = config.param_dtype or next((p.dtype for p in model.parameters() if p.is_floating_point()),
                                               torch.float32)
            measured = measure_machine(group, device, dtype, layer_shapes(*shape[:2], *shape[3:5]),
                                       tokens_of(model, config)[0], link, gemm, formats)
    choice = choose(model, config, ranks, device, one_node, measured)
    collectives = choice.collectives if choice.schedule == "fsdp2" else config.fsdp2_collectives
    return Resolved(config.replace(schedule=choice.schedule, piece_shards=choice.piece_shards,
                                   fsdp2_collectives=collectives), choice)
