"""The schedules of ``shard()`` played on a model of one rank: a compute stream and a link (``commfuse-dp plan``).

``Unit`` and ``Cluster`` (``costs.py``) describe the model and the machine; ``units_for`` builds a decoder's units;
``fused`` plays the fused schedule (elastic or lockstep) with the runtime's own ``FusedSchedule`` on a simulated
clock (``replay.py``); ``slicing`` and ``fsdp2`` play those schedules as ``runtime/slicing.py`` and FSDP2 run them;
each returns the step time; ``fused_floor`` bounds the fused step from below without playing it; ``edges`` is
what every fused schedule leaves exposed at a step's head and tail.
``plan.py`` builds predictions, calibration and the sweep on these.
"""

from __future__ import annotations

from ..config import CommFuseConfig
from .costs import (Cluster, Unit, edges, fused_link_floor, gemm_items, own_unit_between, peer_collective_seconds,
                    peer_units)
from .replay import Group, play


def slicing(units: list[Unit], cl: Cluster) -> float:
    """Step time of the ``"slicing"`` schedule as it runs (``runtime/slicing.py``), on one FIFO link: each fused group
    all-gathers its whole weight in one bucketed ring; when a group starts, the next group's gather (in the recorded
    order) is requested, then the group waits for its own. The first group of the forward is not prefetched; the
    last (the lm_head) keeps its weight for its backward. In the backward a group's reduce-scatter is requested when
    its compute ends, all waited when the backward ends. Unfused parameters, ring embeddings and layers with their
    own FSDP2 unit as in ``lockstep``."""
    n = cl.ranks
    items = gemm_items(units, cl, cl.piece_shards)  # its GEMMs in runs of piece_shards gathered shards
    ring = lambda numel, nbytes: (n - 1) * (cl.latency_s + numel / n * nbytes / cl.bytes_per_s)  # noqa: E731
    link = [0.0]

    def send(at: float, seconds: float) -> float:
        link[0] = max(at, link[0]) + seconds
        return link[0]

    t = link[0] = edges(units, cl, cl.param_bytes)
    fused = [i for i, (g, _, _) in enumerate(items) if g]
    for phase, seq, factor in (("forward", fused, 1), ("backward", fused[::-1], 2)):
        gathered: dict[int, float] = {}
        if phase == "backward":
            gathered[seq[0]] = t  # the lm_head kept its forward's weight
        at, current = 0, None
        for i, (numel, seconds, unit) in (enumerate(items) if phase == "forward" else reversed(list(enumerate(items)))):
            if unit != current:
                t = own_unit_between(units, cl, current, unit, phase == "backward", send, t)
                current = unit
            if numel:
                if i not in gathered:
                    gathered[i] = send(t, ring(numel, cl.param_bytes))
                if at + 1 < len(seq) and seq[at + 1] not in gathered:
                    gathered[seq[at + 1]] = send(t, ring(items[seq[at + 1]][0], cl.param_bytes))
                at += 1
                t = max(t, gathered[i])
            t += factor * seconds
            if numel and phase == "backward":
                send(t, ring(numel, cl.grad_bytes))
        t = own_unit_between(units, cl, current, None, phase == "backward", send, t)
    return max(t, link[0]) + edges(units, cl, cl.grad_bytes)


def fsdp2(units: list[Unit], cl: Cluster, coarse: bool = False, backward: Cluster | None = None) -> float:
    """Step time of the peer, stock FSDP2 as it runs on a GPU over its units (``costs.peer_units``: torchtitan's
    wrapping, or the coarse one), on one FIFO link: nothing fused, whole GEMMs (``use_ring_collectives(overlap=True)``,
    the bench's ``fsdp2_overlap`` and ``fsdp2_coarse``). The first unit of the forward is gathered before anything
    computes, with the next issued behind it; each unit's pre-forward waits for its gather and issues the next
    unit's. The forward's end issues the gather of the last unit resharded after it (the units after it stay
    gathered). Each unit's pre-backward waits for its gather (unless it stayed gathered) and issues that of the unit
    that ended its forward before it; its reduce-scatter is issued when its backward compute ends. The step ends
    when the compute and the link are both done (the backward waits for every reduce-scatter). The collectives are
    the rings', or NCCL's where ``cl.peer_nccl`` (``costs.peer_collective_seconds``). ``backward``: the backward's
    gathers instead from a second copy of the weight shards inside each node (ZeRO++'s hpZ), on that cluster's own
    link (a node's ranks on the links inside it), beside ``cl``'s."""
    if cl.ranks == 1:
        return sum(3 * u.flops for u in units) / cl.flops_per_s
    peers = peer_units(units, coarse)
    size = [sum(units[i].fused_numel + units[i].other_numel for i in members) for members, _ in peers]
    of = {i: k for k, (members, _) in enumerate(peers) for i in members}
    first, last = [min(m) for m, _ in peers], [max(m) for m, _ in peers]
    forward_order = sorted(range(len(peers)), key=first.__getitem__)
    ended_order = sorted(range(len(peers)), key=last.__getitem__)  # FSDP2's post-forward order
    held = {k for k, (_, kept) in enumerate(peers) if kept}  # not resharded after the forward
    link = [0.0, 0.0]  # the link, and (hpZ) the one inside a node the backward gathers on
    ready: dict[int, float] = {}  # gathers issued and not yet waited for

    def gather(k: int, at: float, back: bool = False) -> None:
        on, where = (1, backward) if back and backward is not None else (0, cl)
        link[on] = max(at, link[on]) + peer_collective_seconds(size[k], where, where.param_bytes)
        ready[k] = link[on]

    t = 0.0
    gather(forward_order[0], t)
    for i, u in enumerate(units):  # forward
        k = of[i]
        if i == first[k]:
            t = max(t, ready.pop(k))
            at = forward_order.index(k)
            if at + 1 < len(forward_order):
                gather(forward_order[at + 1], t)
        t += u.flops / cl.flops_per_s
    resharded = [k for k in ended_order if k not in held]
    if resharded:  # the backward's first gather, issued as the forward ends
        gather(resharded[-1], t, True)
    for i in reversed(range(len(units))):  # backward: twice the forward's compute
        k = of[i]
        if i == last[k]:
            if k not in held:
                t = max(t, ready.pop(k))
            at = ended_order.index(k)
            before = ended_order[at - 1] if at > 0 else None
            if before is not None and before not in held and before not in ready:
                gather(before, t, True)
        t += 2 * units[i].flops / cl.flops_per_s
        if i == first[k]:
            link[0] = max(t, link[0]) + peer_collective_seconds(size[k], cl, cl.grad_bytes)
    return max(t, *link)


def fsdp2_bytes(units: list[Unit], cl: Cluster, coarse: bool = False) -> float:
    """Bytes one rank sends in a step of the peer: each unit gathered in the forward and again in the backward
    unless it stayed gathered, and reduce-scattered once."""
    n = cl.ranks
    return sum(sum(units[i].fused_numel + units[i].other_numel for i in members) * (n - 1) / n
               * ((1 if kept else 2) * cl.param_bytes + cl.grad_bytes) for members, kept in peer_units(units, coarse))


def fused(units: list[Unit], cl: Cluster, lockstep: bool = False) -> float:
    """Step time of the fused schedule, elastic or in lockstep (``lookahead_mb=0``): the runtime's own
    ``FusedSchedule`` played on a simulated link and clock ([Note: one policy, two clocks], ``replay.py``), over
    the fused groups and compute gaps of ``gemm_items``. Parameters that are not fused and ring embeddings move at
    the step's head and tail (``edges``); in lockstep a layer with its own FSDP2 unit gathers it before its forward
    and backward and reduce-scatters it after its backward, the compute waiting (``own_unit_between``; the
    elastic play leaves those to ``plan.unplayed``)."""
    items = gemm_items(units, cl, 1 if lockstep else cl.piece_shards)
    groups = [Group(f"{units[u].name}/{i}", numel, seconds, u) for i, (numel, seconds, u) in enumerate(items)]
    if lockstep:
        lookahead, shards = 0, 1
    else:
        # the play's weights are 4 bytes an element: the budget in its bytes
        lookahead = "auto" if cl.lookahead_bytes is None else cl.lookahead_bytes * 4 / cl.param_bytes / (1 << 20)
        shards = cl.piece_shards
    config = CommFuseConfig(lookahead_mb=lookahead, piece_shards=shards, prefetch_depth=cl.prefetch_depth,
                            forward_bundles="auto" if cl.forward_bundles is None else cl.forward_bundles)

    def between(left, entered, backward: bool, block, t: float) -> float:
        return own_unit_between(units, cl, left, entered, backward, block, t)

    compute_end, link_end = play(groups, cl.ranks, cl.latency_s, cl.param_bytes / cl.bytes_per_s,
                                 cl.grad_bytes / cl.bytes_per_s, config, start=edges(units, cl, cl.param_bytes),
                                 first=bool(units[0].table), between=between if lockstep else None,
                                 stand_in=cl.stand_in_ranks)
    return max(compute_end, link_end) + edges(units, cl, cl.grad_bytes)


def fused_floor(units: list[Unit], cl: Cluster, lockstep: bool = False) -> float:
    """A lower bound of ``fused(units, cl, lockstep)`` that plays nothing: the head's exchanges, then the longer of
    the compute (every item of ``gemm_items`` once in the forward and twice in the backward: the whole GEMMs plus
    what their pieces add, ``costs.piece_extra``) and the link's work for the rings (``costs.fused_link_floor``),
    then the tail's exchanges. The play can only add waits to either clock."""
    items = gemm_items(units, cl, 1 if lockstep else cl.piece_shards)
    compute = 3.0 * sum(seconds for _, seconds, _ in items)
    return (edges(units, cl, cl.param_bytes) + max(compute, fused_link_floor(units, cl))
            + edges(units, cl, cl.grad_bytes))
