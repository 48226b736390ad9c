"""The planner past one machine: nodes whose ranks share their NICs (``commfuse-dp plan --num-machines``,
``planner/nodes_cli.py``; and what ``CommFuseConfig()``'s defaults choose on a multi-node launch, ``choose_nodes.py``).

A node is ``per_node`` ranks with fast links among them (the intra-node ``Cluster``: NVLink, or a PCIe switch) and
NICs that all of its ranks share for traffic to other nodes (``Machines``). What one rank gets of them depends on
how many of the node's ranks send at once:
- HSDP (one copy of the model per node, ``CommFuseConfig.replicate`` = nodes): every rank exchanges its own gradient
  shard with the ranks holding the same shard in the other nodes, all at once, so each gets ``nics x NIC /
  per_node`` (``Machines.share``: 1.56 GB/s a GPU for 8 GPUs on one 100 Gb NIC; 50 GB/s for one 400 Gb NIC a GPU);
- a flat ring over every rank, in node order: only the last rank of a node sends to the next node, one flow on one
  NIC, at that NIC's whole rate (``Machines.flow_bytes_per_s``), but that hop carries every collective's bytes.

The layouts played (``predict``), each under the peer's schedule (``fsdp2``: stock FSDP2 as torchtitan builds it, on
NCCL's collectives or the rings, whichever the one-node plays predict faster) and the fused one:
- ``hsdp``: sharded over a node's ranks and played on the intra-node links (``plan.simulate``), then each unit's
  gradient shard summed across the nodes (``exchange_tail``): a ring all-reduce over the copies, ``2 (K-1)`` hops
  of ``1/K`` of the shard at the rank's share of the NICs, started when the unit's backward compute ends (FSDP2's
  all-reduce after its reduce-scatter; the fused schedule's exchange when a group's gradient ring lands,
  ``runtime/replicas.py``), one exchange after another on the rank's link. What is still crossing when the
  backward's compute ends is the tail the step waits for.
- ``flat``: sharded over every rank, every hop at the slower of the intra-node link and one NIC (its latency the
  larger of the two).
``hpz_step`` plays ZeRO++'s hpZ besides (``CommFuseConfig.hpz_size``: flat, the backward's gathers inside each
node). ``decide`` picks among the layouts and hpZ as ``CommFuseConfig()`` does, playing a fused layout only where
its lower bound leaves it a chance.
A narrow ``reduce_format`` shrinks the gradients on both tiers (``wire.bytes_per_element``); the weights' format
applies inside the shard group. The exchange's own encoding is not charged to the compute (it runs on the
replicate ring's thread or stream).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from . import costs, plan
from .costs import Cluster, Unit


@dataclass(frozen=True)
class Machines:
    """The tier between nodes: ``nodes`` nodes of ``per_node`` ranks. ``share_bytes_per_s``: one rank's rate to
    other nodes while every rank of its node sends at once (HSDP's exchange); ``flow_bytes_per_s``: one flow's,
    alone on its NIC (a flat ring's hop between nodes); ``latency_s``: the fixed cost of one hop across nodes.
    ``of_nics`` builds it from the NICs; ``shard()`` measures it (``measure.measure_tiers``)."""

    nodes: int
    per_node: int
    share_bytes_per_s: float
    flow_bytes_per_s: float
    latency_s: float = 20e-6
    nics: str = ""  # the NICs in words, where known

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.per_node < 1:
            raise ValueError(f"Machines: nodes={self.nodes} and ranks per node={self.per_node} must be >= 1")
        if not (self.share_bytes_per_s > 0 and self.flow_bytes_per_s > 0):
            raise ValueError(f"Machines: the rates between nodes must be > 0 bytes/s, got {self.share_bytes_per_s!r} "
                             f"a rank and {self.flow_bytes_per_s!r} a flow")
        if not self.latency_s >= 0:
            raise ValueError(f"Machines: the hop latency across nodes must be >= 0 s, got {self.latency_s!r}")

    @classmethod
    def of_nics(cls, nodes: int, per_node: int, nic_bytes_per_s: float, nics: int = 1,
                latency_s: float = 20e-6) -> Machines:
        """``nodes`` nodes of ``per_node`` ranks with ``nics`` NICs of ``nic_bytes_per_s`` each, each NIC serving as
        many of the node's ranks: a rank gets ``nics x NIC / per_node`` (at most one NIC) while all send at once,
        and one flow a whole NIC."""
        if not nic_bytes_per_s > 0:
            raise ValueError(f"Machines: a NIC's rate must be > 0 bytes/s, got {nic_bytes_per_s!r}")
        if nics < 1 or (per_node >= nics and per_node % nics):
            raise ValueError(f"Machines: {nics} NICs per node must be >= 1 and divide the node's {per_node} ranks "
                             f"(each NIC serves as many ranks)")
        words = f"{nics} x {nic_bytes_per_s / 1e9:g} GB/s NIC{'s' if nics > 1 else ''} per node"
        return cls(nodes, per_node, nic_bytes_per_s * min(nics, per_node) / per_node, nic_bytes_per_s, latency_s,
                   words)

    @property
    def ranks(self) -> int:
        return self.nodes * self.per_node

    @property
    def share(self) -> float:
        return self.share_bytes_per_s

    def flat_bytes_per_s(self, intra: Cluster) -> float:
        """A flat ring's rate: its hop between nodes is one flow."""
        return min(intra.bytes_per_s, self.flow_bytes_per_s)

    def describe(self) -> str:
        nics = f", {self.nics}" if self.nics else ""
        return (f"{self.nodes} nodes x {self.per_node} ranks{nics}: {self.share / 1e9:.3g} GB/s a rank when all of "
                f"a node's ranks cross at once (HSDP's exchange), {self.flow_bytes_per_s / 1e9:.3g} GB/s for one "
                f"flow (a flat ring's hop between nodes), {self.latency_s * 1e6:.3g} us a hop between nodes")


def exchange_tail(units: list[Unit], node: Cluster, machines: Machines, grad_bytes: float,
                  at_landing: bool = True) -> float:
    """HSDP: seconds the replica exchange runs past the end of the backward's compute (module docstring). Each unit's
    gradient shard (``grad_bytes`` an element on the wire) crosses in ``2 (K-1)`` hops of ``1/K`` of it at the rank's
    share of its node's NICs; a unit's exchange starts when its backward compute ends (``at_landing``; else all at
    the backward's end, as the slicing schedule lands its reduce-scatters), a ring embedding's at the end (its
    gradient is complete only then). The rank's link serves them in order."""
    k = machines.nodes
    if k == 1:
        return 0.0
    hops, share = 2 * (k - 1), machines.share

    def cost(u: Unit) -> float:
        shard = (u.fused_numel + u.other_numel) / node.ranks * grad_bytes
        return hops * (machines.latency_s + shard / k / share)

    bwd = [2 * u.flops / node.flops_per_s for u in units]
    end = sum(bwd)
    link = t = 0.0
    for u, b in zip(reversed(units), reversed(bwd)):  # the backward's order
        t += b
        if not u.table:
            link = max(link, t if at_landing else end) + cost(u)
    for u in units:
        if u.table:
            link = max(link, end) + cost(u)
    return max(link - end, 0.0)


def flat_cluster(intra: Cluster, machines: Machines) -> Cluster:
    """The cluster a flat ring over every rank plays on."""
    return replace(intra, ranks=machines.ranks, bytes_per_s=machines.flat_bytes_per_s(intra),
                   latency_s=max(intra.latency_s, machines.latency_s))


def _fused_best(units: list[Unit], cl: Cluster) -> float:
    """The fused step at its best piece width (``plan.decide``)."""
    _, width, predicted = plan.decide(units, cl, "fused")
    return predicted[f"fused, piece_shards={width}"]


LAYOUTS = ("hsdp", "flat")
SCHEDULES = ("fsdp2", "fused")


def layouts(units: list[Unit], intra: Cluster, machines: Machines, grad_bytes: float | None = None,
            which: tuple[str, ...] = LAYOUTS, schedules: tuple[str, ...] = SCHEDULES) -> dict[str, float]:
    """Step seconds per ``layout/schedule`` (``hsdp/fsdp2``, ``hsdp/fused``, ``flat/fsdp2``, ``flat/fused``) of
    ``units`` on ``machines`` whose nodes are ``intra`` (its ``ranks`` ignored: a node's ranks are
    ``machines.per_node``); ``grad_bytes``: the gradients' bytes an element on the wire between nodes (default
    ``intra.grad_bytes``). The fused steps are at their best piece width; the peer's on NCCL's collectives or the
    rings, whichever is faster (``plan.peer_step``)."""
    grad_bytes = intra.grad_bytes if grad_bytes is None else grad_bytes
    node = replace(intra, ranks=machines.per_node)
    flat = flat_cluster(intra, machines)
    out = {}
    for name, cl in (("hsdp", node), ("flat", flat)):
        if name not in which:
            continue
        tail = exchange_tail(units, node, machines, grad_bytes) if name == "hsdp" else 0.0
        if "fsdp2" in schedules:
            out[f"{name}/fsdp2"] = plan.peer_step(units, cl) + tail
        if "fused" in schedules and _fused_plays(units, cl):  # (see ``unplayed_fused``)
            out[f"{name}/fused"] = _fused_best(units, cl) + tail
    return out


def _fused_plays(units: list[Unit], cl: Cluster) -> bool:
    """Whether the fused play is what ``shard()`` runs on ``cl``'s ranks: every decoder layer keeps fused groups
    (below ``min_fuse_numel`` a layer's linears join the root's FSDP2 unit, gathered whole for the step, or keep a
    unit of their own, which the play does not play: ``plan.unplayed``)."""
    placed = costs.placed(units, cl, elastic=cl.lookahead_bytes != 0)
    return all(u.groups for u in placed if u.layer) and not plan.unplayed(units, cl, "fused")


def unplayed_fused(units: list[Unit], intra: Cluster, machines: Machines) -> list[str]:
    """The layouts whose fused schedule ``layouts`` leaves out: where decoder layers' groups fall below
    ``min_fuse_numel`` on that many ranks (``_fused_plays``), so that fusing would leave whole layers unfused."""
    node = replace(intra, ranks=machines.per_node)
    return [name for name, cl in (("hsdp", node), ("flat", flat_cluster(intra, machines)))
            if not _fused_plays(units, cl)]


def hpz_step(units: list[Unit], intra: Cluster, machines: Machines) -> float:
    """ZeRO++'s hpZ under the peer's schedule (``CommFuseConfig.hpz_size``): sharded flat over every rank (its
    forward gathers and reduce-scatters on the flat ring), the backward's gathers from a second copy of the weight
    shards that each node keeps over its own ranks, on the links inside it (``plays.fsdp2``'s ``backward``)."""
    from .plays import fsdp2

    flat = flat_cluster(intra, machines)
    node = replace(intra, ranks=machines.per_node)
    if machines.nodes == 1:
        return plan.peer_step(units, node)
    return fsdp2(units, replace(flat, peer_nccl=False), backward=replace(node, peer_nccl=False))


def predict(units: list[Unit], intra: Cluster, machines: Machines) -> dict[str, dict]:
    """``layouts`` with each layout's memory, and hpZ (``hpz_step``): per
    ``layout/schedule``, ``step_s`` and ``shard_of`` (the ranks one copy of the parameters and optimizer state is
    sharded over; hpZ's ``second_copy_of``: the ranks its second copy of the weights is split over)."""
    steps = layouts(units, intra, machines)
    out = {key: {"step_s": s, "shard_of": machines.per_node if key.startswith("hsdp") else machines.ranks}
           for key, s in steps.items()}
    out["hpz/fsdp2"] = {"step_s": hpz_step(units, intra, machines), "shard_of": machines.ranks,
                        "second_copy_of": machines.per_node}
    return out


PEER = "hsdp/fsdp2"  # FSDP2's HSDP as torchtitan builds it: what the defaults' choice is measured against


NOT_PLAYED = " (not played, at least)"  # ``decide``'s key suffix of a candidate bounded out: its lower bound


def decide(units: list[Unit], intra: Cluster, machines: Machines, which: tuple[str, ...] = LAYOUTS,
           schedules: tuple[str, ...] = SCHEDULES, grad_bytes: float | None = None, hpz: bool = True
           ) -> tuple[str, dict[str, float]]:
    """The layout and schedule ``CommFuseConfig()``'s defaults run on ``machines`` (``layout/schedule``, among
    ``which`` and ``schedules``), and the predicted steps: the peer's (``PEER``, or the first candidate where the
    peer is not one) unless another is predicted faster by ``plan.MARGIN``, then the fastest. The peer's schedule is
    cheap to play and goes first; a fused candidate is played only where its lower bound (``plan.simulate``'s
    ``floor`` at each piece width, plus HSDP's tail) leaves it a chance to be chosen; else its bound is reported
    under ``layout/fused`` + ``NOT_PLAYED``. The choice is the one playing every candidate makes (``layouts``).
    ``hpz``: hpZ (``hpz/fsdp2``, ``hpz_step``) is a candidate too, where the fsdp2 schedule is and a node has more
    than one rank."""
    grad_bytes = intra.grad_bytes if grad_bytes is None else grad_bytes
    node = replace(intra, ranks=machines.per_node)
    clusters = {"hsdp": node, "flat": flat_cluster(intra, machines)}
    tail = {"hsdp": exchange_tail(units, node, machines, grad_bytes) if "hsdp" in which else 0.0, "flat": 0.0}
    steps: dict[str, float] = {}
    if "fsdp2" in schedules:
        for name in which:
            steps[f"{name}/fsdp2"] = plan.peer_step(units, clusters[name]) + tail[name]
        if hpz and machines.nodes > 1 and machines.per_node > 1:
            steps["hpz/fsdp2"] = hpz_step(units, intra, machines)
    for name in which:
        cl = clusters[name]
        if "fused" not in schedules or not _fused_plays(units, cl):
            continue
        widths = [g for g in (2 ** i for i in range(11)) if g <= cl.ranks]
        floor = min(plan.simulate(units, replace(cl, piece_shards=g), "fused", floor=True)["step_s"]
                    for g in widths) * (1 - plan.FLOOR_SLACK) + tail[name]
        limits = [min(steps.values())] if steps else []
        if PEER in steps:
            limits.append((1 - plan.MARGIN) * steps[PEER])
        if limits and floor > min(limits):
            steps[f"{name}/fused{NOT_PLAYED}"] = floor
            continue
        steps[f"{name}/fused"] = _fused_best(units, cl) + tail[name]
    played = {k: v for k, v in steps.items() if not k.endswith(NOT_PLAYED)}
    base = PEER if PEER in played else next(iter(played))
    best = min(played, key=played.get)
    if best != base and played[best] <= (1 - plan.MARGIN) * played[base]:
        return best, steps
    return base, steps


def formats(units: list[Unit], intra: Cluster, machines: Machines, dtype_bytes: int, codec: dict[str, float],
            names: tuple[str, ...] = tuple(plan.FORMAT_PLAYS)) -> dict[str, dict]:
    """Per narrow format (``plan.FORMAT_PLAYS``): the best layout and schedule with it, its step and its gain over
    the exact defaults (``decide``); the format applies inside a node as ``plan.with_formats`` says and to the
    gradients between nodes."""
    from ..wire import bytes_per_element

    chosen, _ = decide(units, intra, machines)
    exact = layouts(units, intra, machines)
    if chosen not in exact:  # (hpZ, exact only: the second copy's gathers travel as they are)
        exact[chosen] = hpz_step(units, intra, machines)
    out = {}
    for name in names:
        gather, reduce = plan.FORMAT_PLAYS[name]
        narrow = plan.with_formats(intra, gather, reduce, dtype_bytes, codec)
        steps = layouts(units, narrow, machines, min(dtype_bytes, bytes_per_element(reduce, dtype_bytes)))
        if name == "exact":
            steps = exact
        best = min(steps, key=steps.get)
        out[name] = {"best": best, "step_s": steps[best], "peer_s": steps[PEER], "gain": exact[chosen] / steps[best],
                     "over_peer": exact[PEER] / steps[best], "steps": steps}
    return out
