"""What ``CommFuseConfig``'s ``"auto"`` settings become on a launch over several nodes (``choose.py`` decides for one).

On a multi-node launch (``node_layout.read``: the launcher says how many ranks a node holds) ``shard()`` builds the
2-D mesh ``(nodes, ranks per node)`` and hands it here. Where something is left to choose (``replicate="auto"``,
the default, or ``schedule="auto"`` under HSDP), the two tiers are measured (``measure.measure_tiers``: the ring
inside a node; a rank's link to other nodes while its whole node crosses, and one flow alone) unless given, the
GEMM rate likewise, and the planner's plays across machines (``nodes.py``) pick:
- the layout, where ``replicate="auto"``: HSDP (a copy of the model per node, ``replicate`` = nodes) or one flat
  ring over every rank (``replicate=1``), or (``hpz_size="auto"`` too) that flat ring with hpZ under the fsdp2
  schedule (``hpz_size`` = ranks per node);
- the schedule, where ``"auto"``: the peer's (``fsdp2``) unless fused is predicted faster by ``plan.MARGIN``;
- the fused schedule's piece width and the fsdp2 schedule's collectives, as on one node.
Nothing lossy is chosen: a narrow format is played only where the config asks for it. The figures are the median
rank's, so every rank chooses alike; ``describe(model)`` prints the choice, its predictions and what each input
was (given, measured or assumed).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn as nn

from . import nodes, plan
from .choose import Choice, Plan, Resolved, cost_model, model_shape, narrow_formats, tokens_of
from ..config import CommFuseConfig
from .measure import Measured, Tiers, layer_shapes, measure_machine, measure_tiers
from ..wire import bytes_per_element

# Where a tier between nodes could not be measured (its larger hops took no longer than its small ones)
ASSUMED_SHARE = {"cuda": 12.5e9 / 8, "cpu": 1.25e9}  # 8 GPUs on one 100 Gb NIC; 10 Gb Ethernet
ASSUMED_LATENCY_S = 20e-6


def resolve_nodes(model: nn.Module, config: CommFuseConfig, mesh, device: torch.device) -> Resolved:
    """``config`` with its ``"auto"`` layout (``replicate``), schedule, piece width and fsdp2 collectives decided for
    the 2-D ``mesh`` ``(nodes, ranks per node)`` of a multi-node launch, and the choice. Collective over the world
    (it measures): every rank calls it alike."""
    copies, per_node = mesh.size(0), mesh.size(1)
    layouts = ("hsdp", "flat") if config.replicate == "auto" else ("hsdp",)
    fixed = config.schedule if config.schedule != "auto" else None
    if fixed not in (None, "fused", "fsdp2"):  # (slicing: HSDP only, as given)
        return _resolved(config, copies, Choice(fixed, 1, f"schedule={fixed!r} as given; HSDP, a copy per node",
                                                replicate=copies))
    shape = model_shape(model)
    if shape is None or (fixed is not None and layouts == ("hsdp",) and config.piece_shards != "auto"):
        reason = ("the model has no transformers config giving its shapes: not planned; HSDP, a copy of the model "
                  "per node" if shape is None else f"schedule={fixed!r} as given, HSDP as given")
        return _resolved(config, copies, Choice(fixed or "fused", 1 if config.piece_shards == "auto" else
                                                config.piece_shards, reason, replicate=copies))
    dtype = config.param_dtype or next((p.dtype for p in model.parameters() if p.is_floating_point()),
                                       torch.float32)
    tiers = measure_tiers(mesh.get_group(1), mesh.get_group(0), device)
    gemm = None
    if config.tflops is None:
        gemm = measure_machine(mesh.get_group(1), device, dtype, layer_shapes(*shape[:2], *shape[3:5]),
                               tokens_of(model, config)[0], link=False, gemm=True).gemm
    return plan_nodes(model, config, copies, per_node, device, tiers, gemm)


def plan_nodes(model: nn.Module, config: CommFuseConfig, copies: int, per_node: int, device: torch.device,
               tiers: Tiers, gemm=None) -> Resolved:
    """``resolve_nodes``'s decision once the tiers (and, unless given, the GEMM rate) are known: the planner's plays
    across nodes, no communication (``benchmarks/startup.py`` times it)."""
    layouts = ("hsdp", "flat") if config.replicate == "auto" else ("hsdp",)
    fixed = config.schedule if config.schedule != "auto" else None
    shape = model_shape(model)
    units, cl, described = cost_model(model, config, shape, per_node, device, True, Measured(tiers.intra, gemm), None)
    machines, between = _between(copies, per_node, tiers, device)
    described += f"; between nodes {machines.describe()} ({'measured' if between['measured'] else 'assumed'})"
    grad_bytes = None
    if narrow_formats(config):  # (played as asked; the codec's compute is not charged here)
        nbytes = cl.param_bytes
        cl = plan.with_formats(cl, config.gather_format, config.reduce_format, nbytes, {})
        grad_bytes = min(nbytes, bytes_per_element(config.reduce_format, nbytes))
    schedules = (fixed,) if fixed is not None else nodes.SCHEDULES
    hpz = config.hpz_size == "auto" and config.replicate == "auto" and config.tp_size == 1
    chosen, steps = nodes.decide(units, cl, machines, layouts, schedules, grad_bytes, hpz)
    layout, schedule = chosen.split("/")
    replicate = copies if layout == "hsdp" else 1
    played = replace(cl, ranks=per_node) if layout == "hsdp" else nodes.flat_cluster(cl, machines)
    width = config.piece_shards if config.piece_shards != "auto" else 1
    if schedule == "fused" and config.piece_shards == "auto":
        width = plan.decide(units, played, "fused")[1]
    collectives = _collectives(config, device, units, played) if schedule == "fsdp2" else "rings"
    choice = Choice(schedule, width, _reason(chosen, steps, copies, width),
                    {f"{k} (x{copies} nodes)": v for k, v in steps.items()}, described, collectives,
                    Measured(tiers.intra, gemm), Plan(units, cl, described), replicate=replicate, between=between,
                    hpz_size=per_node if layout == "hpz" else 1)
    resolved = config.replace(replicate=replicate, schedule=schedule, piece_shards=width,
                              fsdp2_collectives=collectives if schedule == "fsdp2" else config.fsdp2_collectives,
                              hpz_size=per_node if layout == "hpz" else config.hpz_size)
    return Resolved(resolved, choice)


def _between(copies: int, per_node: int, tiers, device: torch.device) -> tuple[nodes.Machines, dict]:
    """The tier between nodes as measured (assumed where a measurement found no line), and its figures."""
    kind = "cuda" if device.type == "cuda" else "cpu"
    share = tiers.share.bytes_per_s if tiers.share is not None else ASSUMED_SHARE[kind]
    flow = max(tiers.flow.bytes_per_s if tiers.flow is not None else share, share)
    latency = tiers.share.latency_s if tiers.share is not None else ASSUMED_LATENCY_S
    between = {"nodes": copies, "per_node": per_node, "share_gbps": share / 1e9, "flow_gbps": flow / 1e9,
               "latency_us": latency * 1e6, "measured": tiers.share is not None}
    return nodes.Machines(copies, per_node, share, flow, latency), between


def _collectives(config: CommFuseConfig, device: torch.device, units, played) -> str:
    """The fsdp2 schedule's collectives: as given; the rings on CPU and for narrow formats; on CUDA NCCL's unless the
    plays predict the rings faster by ``MARGIN``."""
    if config.fsdp2_collectives != "auto":
        return config.fsdp2_collectives
    if device.type != "cuda" or narrow_formats(config):
        return "rings"
    both: dict[str, float] = {}
    plan.peer_step(units, replace(played, peer_nccl=True), both)
    return "rings" if both["fsdp2 on the rings"] <= (1 - plan.MARGIN) * both["fsdp2 on NCCL"] else "torch"


def _reason(chosen: str, steps: dict[str, float], copies: int, width: int) -> str:
    layout, schedule = chosen.split("/")
    peer = steps.get(nodes.PEER)
    where = {"hsdp": f"HSDP, a copy per node ({copies} copies)", "flat": "one flat ring over every rank",
             "hpz": "one flat ring over every rank, the backward's gathers inside each node (hpZ)"}[layout]
    return (f"{where}, schedule={schedule!r}" + (f", piece_shards={width}" if schedule == "fused" else "")
            + f": predicted {steps[chosen]:.3g} s a step"
            + (f" against FSDP2's HSDP {peer:.3g} s" if peer is not None and chosen != nodes.PEER else "")
            + ("" if len(steps) == 1 else "; the others: " + ", ".join(
                f"{k} {v:.3g} s" for k, v in steps.items() if k != chosen))
            + (f" (the peer's unless another wins by {plan.MARGIN:.0%})" if len(steps) > 1 else ""))


def _resolved(config: CommFuseConfig, copies: int, choice: Choice) -> Resolved:
    return Resolved(config.replace(replicate=copies, schedule=choice.schedule, piece_shards=choice.piece_shards),
                    choice)
