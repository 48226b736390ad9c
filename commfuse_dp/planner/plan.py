"""``commfuse-dp plan``: predict step time, exposed communication and MFU of the schedules on a real cluster.

The command line is ``planner/cli.py``.

The model is a list of units in execution order: the embedding, per decoder layer the fused groups (q/k/v,
o, gate/up, down; attention itself as compute only), the final norm and the lm_head. Each group has forward
compute ``2·T·out·in / F`` and backward twice that; a hop (one exchange with the ring's neighbours) costs
``α + bytes / B``. The simulation has two resources per rank, the compute stream and the link, and plays each
schedule on them:
- ``no_overlap``: every collective, then the compute that needs it.
- ``fsdp2`` (the peer, also ``unit_slicing``): stock FSDP2 as it runs on a GPU (``plays.fsdp2``, the bench's
  ``fsdp2_overlap``, ``CommFuseConfig(schedule="fsdp2")``) over torchtitan's units: the embedding, each decoder
  layer (the last kept gathered after the forward), the final norm with the lm_head (kept); the next unit's
  gather issued one unit ahead, the backward's first as the forward ends, each reduce-scatter when its unit's
  backward ends, on one link in issue order; the embedding's gather and the first layer's are exposed at the head,
  the first layer's and the embedding's reduce-scatters at the tail. On the rings, or on NCCL's own collectives
  (``Cluster.peer_nccl``, what ``"auto"`` runs on CUDA unless the rings are predicted faster).
- ``fsdp2_coarse``: the same over each layer and a root holding the embedding, the final norm and the lm_head
  (gathered at the step's head, reduce-scattered at its tail); the bench's ``fsdp2_coarse``.
- ``slicing`` (``runtime/slicing.py``, as it runs): the same one group ahead, per fused group (``plays.slicing``).
- ``lockstep`` (``lookahead_mb=0``): inside each fused group N compute pieces run beside N-1 hops (forward) or
  N hops (backward: weight shards and gradient partial sums together); a piece waits for the hop
  before it; hop 0 of the next ``prefetch_depth`` groups goes during a group's last piece.
- ``fused`` (the default, elastic lookahead): when a group begins, the whole weight rings of the following units
  are chosen while they fit the lookahead budget, a unit's rings sharing their hops (a bundle); gradient partials
  lag and go as one ring per unit (``plays.fused``).
  For both, parameters that are not fused (norms) and the ring embedding's exchanges are exposed at the step's
  head and tail.
The last three fuse what ``shard()`` fuses (``costs.placed``, ``--min-fuse-numel``): a group whose weight shard is
below the threshold joins the unfused parameters, except under ``fused``, where it rides with a larger group of its
layer; a layer whose unfused linears reach the threshold keeps an FSDP2 unit of its own, gathered and
reduce-scattered per layer, blocking (``slicing`` and ``lockstep`` play it; ``fused`` prints "not played").
Calibration fits F (compute alone) and B (communication alone) per rate from a ``commfuse-dp bench`` JSON, and
one figure for the machine where the JSON has the ``concurrent`` bound: the CPU time communication takes from
compute per byte. With ``--overhead`` (what each schedule adds to the same model's step on the bench's machine with
nothing moving: its host work and its GEMMs in pieces, ``benchmarks/step_overhead.py --bench-model real --json``) a
real-compute run has that added to its compute (one thread computes and issues), an emulated one is at least that
long (the host runs ahead of the device). It compares the prediction for fused and slicing with their measured
step times.
"""

from __future__ import annotations

import math
from dataclasses import replace

from . import costs, plays
from .costs import Cluster, Unit, units_for

KNOWN_MODELS = {
    # name: hidden, intermediate, layers, heads, kv heads, vocab
    "llama-7b": (4096, 11008, 32, 32, 32, 32000),
    "llama-13b": (5120, 13824, 40, 40, 40, 32000),
    "llama3-8b": (4096, 14336, 32, 32, 8, 128256),
    "llama3-70b": (8192, 28672, 80, 64, 8, 128256),
    "gpt2": (768, 3072, 12, 12, 12, 50257),
    "gpt2-xl": (1600, 6400, 48, 25, 25, 50257),
    "bench": (512, 1408, 4, 8, 8, 4096),  # the default model of ``commfuse-dp bench``
}


def simulate(units: list[Unit], cl: Cluster, schedule: str, floor: bool = False) -> dict:
    """Step time (s), its compute, and the model FLOPs of one step on one rank. ``floor``: for the fused schedule
    (and lockstep), a lower bound of the step that plays nothing (``plays.fused_floor``); the other schedules' steps
    are cheap to play and come as they are."""
    schedule = ALIASES.get(schedule, schedule)
    if schedule in PLACED:  # what shard() fuses for it
        units = costs.placed(units, cl, elastic=schedule == "fused" and cl.lookahead_bytes != 0)
    fwd = [u.flops / cl.flops_per_s for u in units]
    bwd = [2 * f for f in fwd]
    compute = sum(fwd) + sum(bwd)
    flops = 3 * sum(u.flops for u in units)
    if schedule == "no_overlap":
        return {"step_s": compute + _unoverlapped_comm(units, cl), "compute_s": compute, "flops": flops}
    slowed = _slowed_compute(units, cl, schedule, compute, floor)
    if slowed is not None:
        return slowed
    return _played(units, cl, schedule, compute, flops, floor)


def _unoverlapped_comm(units: list[Unit], cl: Cluster) -> float:
    """``no_overlap``'s communication: each unit's parameters gathered twice and reduce-scattered once round the
    ring, nothing hidden."""
    n = cl.ranks

    def coll(numel: int, nbytes: int) -> float:  # one ring all-gather or reduce-scatter of numel elements
        return 0.0 if numel == 0 or n == 1 else (n - 1) * (cl.latency_s + numel / n * nbytes / cl.bytes_per_s)

    return sum(2 * coll(u.fused_numel + u.other_numel, cl.param_bytes) +
               coll(u.fused_numel + u.other_numel, cl.grad_bytes) for u in units)


def _slowed_compute(units: list[Unit], cl: Cluster, schedule: str, compute: float, floor: bool = False
                    ) -> dict | None:
    """Where work of ``cl``'s on the computing thread slows the compute (the codec of narrow formats, the peer's or
    the fused groups' host work, the CPU that overlapped communication takes): the schedule played with the compute
    that much slower, each such cost in turn. None where there is none."""
    n = cl.ranks

    def slowed(extra_s: float, **plain) -> dict:  # the compute takes extra_s more per step; reported against cl's rate
        slow = replace(cl, flops_per_s=cl.flops_per_s * compute / (compute + extra_s), **plain)
        r = simulate(units, slow, schedule, floor)
        return {**r, "compute_s": compute, "pieces_s": r.get("pieces_s", 0.0) * slow.flops_per_s / cl.flops_per_s}

    if cl.codec_s_per_elem and n > 1:
        # narrow formats: encoding and decoding on the compute stream (``costs.codec_seconds``)
        codec = costs.codec_seconds(units, cl, schedule in PEERS)
        return {**slowed(codec, codec_s_per_elem=0.0), "codec_s": codec}
    if cl.host_on_compute and cl.peer_host_s and n > 1 and schedule in PEERS:
        # FSDP2's own host work (its copies in and out of the flat buffers) on the thread that computes
        return {**slowed(cl.peer_host_s, host_on_compute=False, peer_host_s=0.0), "host_s": cl.peer_host_s}
    if cl.host_on_compute and cl.host_fit is not None and n > 1 and schedule in ("slicing", "lockstep", "fused"):
        # The host issues the fused groups' hops and pieces on the thread that computes: it slows the compute.
        host = costs.host_seconds(units, cl)
        return {**slowed(host, host_on_compute=False, host_fit=None), "host_s": host}
    if cl.cpu_s_per_byte and n > 1:
        # Overlapped communication takes CPU from the compute it runs beside (gloo threads, the kernel's network
        # stack): the compute of an overlapping schedule slows by that much.
        total = plays.fsdp2_bytes(units, cl, schedule == "fsdp2_coarse") if schedule in PEERS else sum(
            u.exchange(n, cl.rows_ring)[1] * (cl.param_bytes + cl.grad_bytes) if u.table else
            (u.fused_numel + u.other_numel) * (n - 1) / n * (2 * cl.param_bytes + cl.grad_bytes)
            for u in units)  # bytes one rank sends per step
        return slowed(cl.cpu_s_per_byte * total, cpu_s_per_byte=0.0)
    return None


def _played(units: list[Unit], cl: Cluster, schedule: str, compute: float, flops: float, floor: bool = False
            ) -> dict:
    """The step of an overlapping schedule, its compute as ``cl`` rates it: the schedule's play on the compute
    stream and the link (``plays.py``; ``floor``: the fused schedule's lower bound instead), at least the host's
    time to issue it."""
    n = cl.ranks
    # The fused and slicing schedules compute their GEMMs in N / piece_shards pieces (lockstep: N)
    # ... and the host issues every hop and piece of the fused groups (``costs.host_seconds``)
    host = costs.host_seconds(units, cl)
    if schedule in ("slicing", "lockstep", "fused") and n > 1 and not any(u.groups for u in units):
        # nothing fused (every group below min_fuse_numel): it all moves at the head and the tail
        own = sum(2 * costs.unit_seconds(u, cl, cl.param_bytes) + costs.unit_seconds(u, cl, cl.grad_bytes)
                  for u in units if u.own)  # layers with FSDP2 units of their own: each collective blocking
        t = costs.edges(units, cl, cl.param_bytes) + compute + own + costs.edges(units, cl, cl.grad_bytes)
        return {"step_s": t, "device_s": t, "compute_s": compute, "flops": flops, "host_s": 0.0, "pieces_s": 0.0}
    if schedule == "slicing":
        t = plays.slicing(units, cl) if n > 1 else compute
        return {"step_s": max(t, host), "device_s": t, "compute_s": compute, "flops": flops,
                "pieces_s": costs.piece_extra(units, cl, cl.piece_shards), "host_s": host}
    if schedule in PEERS:  # the peer: stock FSDP2's units and its GPU schedule (plays.fsdp2)
        t = plays.fsdp2(units, cl, coarse=schedule == "fsdp2_coarse")
        return {"step_s": max(t, cl.peer_host_s), "device_s": t, "compute_s": compute, "flops": flops,
                "host_s": cl.peer_host_s}
    if schedule in ("fused", "lockstep"):
        lockstep = schedule == "lockstep" or cl.lookahead_bytes == 0
        t = compute if n == 1 else (plays.fused_floor if floor else plays.fused)(units, cl, lockstep)
        return {"step_s": max(t, host), "device_s": t, "compute_s": compute, "flops": flops, "host_s": host,
                "pieces_s": costs.piece_extra(units, cl, 1 if lockstep else cl.piece_shards)}
    raise ValueError(f"unknown schedule {schedule!r}")


SCHEDULES = ("no_overlap", "fsdp2", "slicing", "lockstep", "fused")
ALIASES = {"unit_slicing": "fsdp2"}  # another name of the peer (stock FSDP2's shape)
PEERS = ("fsdp2", "fsdp2_coarse")  # the peer over torchtitan's units, and over each layer and a root holding the rest
PLACED = ("slicing", "lockstep", "fused")  # this library's schedules: they fuse what shard() fuses


def unplayed(units: list[Unit], cl: Cluster, schedule: str) -> list[str]:
    """Decoder layers whose unfused parameters ``shard()`` keeps in an FSDP2 unit of their own under ``schedule``
    (``costs.own_collectives``): not played, so a prediction with any is not the schedule that runs."""
    if schedule != "fused" or cl.ranks == 1 or cl.lookahead_bytes == 0:  # (slicing and lockstep play them)
        return []
    placed = costs.placed(units, cl, elastic=True)
    return costs.own_collectives(placed, cl) if any(u.groups for u in placed) else []  # (nothing fused: played)


def recommend(cl: Cluster) -> dict:
    """Bucket and min_fuse_numel for which the per-hop latency stays under 5% / 10% of the transfer."""
    bucket_bytes = 20 * cl.latency_s * cl.bytes_per_s
    fuse_bytes = 10 * cl.latency_s * cl.bytes_per_s
    return {"bucket_mb": max(1.0, round(bucket_bytes / 2**20, 1)),
            "min_fuse_numel": int(2 ** math.ceil(math.log2(max(fuse_bytes / cl.param_bytes, 1))))}


def best_piece_shards(model: tuple, cl: Cluster, tokens: int, seq: int) -> int:
    """The ``piece_shards`` (a power of two up to the ranks) with the shortest fused step; the smallest on a tie."""
    return decide(units_for(*model, tokens=tokens, seq=seq), cl, schedule="fused")[1]


MARGIN = 0.02  # the defaults fuse only where predicted at least this much faster than the peer

# The formats the planner plays (``CommFuseConfig.gather_format``, ``reduce_format``): name -> (gather, reduce)
FORMAT_PLAYS = {"exact": ("exact", "exact"), "bf16": ("bf16", "bf16"), "fp8": ("fp8", "bf16"),
                "int8": ("int8", "bf16"), "int8/int8": ("int8", "int8")}


def with_formats(cl: Cluster, gather: str, reduce: str, dtype_bytes: int, codec: dict[str, float]) -> Cluster:
    """``cl`` with weights gathered in ``gather`` and gradients sent in ``reduce``: their bytes per element (from
    ``dtype_bytes``-byte values; a scale per block counted in) and the codec's compute seconds per element and
    pass (``codec``: per format, ``wire.measure_codec``'s mean of encode and decode; the dearer of the two
    formats)."""
    from ..wire import bytes_per_element

    gbytes = min(dtype_bytes, bytes_per_element(gather, dtype_bytes))
    rbytes = min(dtype_bytes, bytes_per_element(reduce, dtype_bytes))
    coded = [reduce] if reduce != "exact" else []  # (narrow gradients are always decoded into float32 sums)
    if gather != "exact" and not (gather == "bf16" and dtype_bytes <= 2):  # (a bf16 gather of bf16: as it is)
        coded.append(gather)
    return replace(cl, param_bytes=gbytes, grad_bytes=rbytes,
                   codec_s_per_elem=max((codec.get(f, 0.0) for f in coded), default=0.0))


def formats_table(units: list, cl: Cluster, dtype_bytes: int, codec: dict[str, float],
                  names: tuple[str, ...] = tuple(FORMAT_PLAYS)) -> dict[str, dict[str, float]]:
    """Per format: the fused step (its best piece width), the peer's on the rings with the same format, and the
    exact defaults' step (``decide`` on ``cl``: fused at its width where chosen, else the peer, NCCL where that
    wins), in seconds."""
    schedule, best, predicted = decide(units, cl)
    exact = predicted[f"fused, piece_shards={best}"] if schedule == "fused" else predicted["fsdp2"]
    out = {}
    for name in names:
        gather, reduce = FORMAT_PLAYS[name]
        narrow = with_formats(cl, gather, reduce, dtype_bytes, codec)
        _, _, steps = decide(units, narrow, "fused")
        fused = min(v for k, v in steps.items() if k.startswith("fused, piece_shards="))
        peer = simulate(units, replace(narrow, peer_nccl=False), "fsdp2")["step_s"]
        if name == "exact":
            peer = predicted["fsdp2"]
        out[name] = {"fused_s": fused, "fsdp2_s": peer, "exact_defaults_s": exact,
                     "best_s": min(fused, peer), "gain": exact / min(fused, peer),
                     "param_bytes": narrow.param_bytes, "grad_bytes": narrow.grad_bytes,
                     "codec_ns_per_elem": narrow.codec_s_per_elem * 1e9}
    return out


def decide(units: list, cl: Cluster, schedule: str = "auto", piece_shards: int | str = "auto"
           ) -> tuple[str, int, dict[str, float]]:
    """The schedule and piece width for ``units`` on ``cl`` (``"auto"`` values chosen, explicit ones kept), and the
    predicted step seconds of the candidates: fused at the piece widths played (powers of two up to the ranks, or
    the one given), and the peer (``fsdp2``). Fused where it is predicted faster than the peer by ``MARGIN``; the
    piece width with the shortest fused step, the smallest on a tie. ``CommFuseConfig()``'s defaults choose with
    this (``choose.py``), and ``commfuse-dp plan`` recommends with it.

    A width is played only where it could change the choice: each width's step is bounded from below without a
    play (``simulate(..., floor=True)``: its compute and GEMM pieces, the host, the link's bytes and hops), the
    widths are played in the order of their bounds, and one whose bound shows that it can be neither the best
    width nor (under ``"auto"``) faster than the peer by ``MARGIN`` is not played. So the choice is the one that
    playing every width makes; ``predicted`` has an entry for each width played and, where any was not,
    ``UNPLAYED``: the least of their bounds."""
    widths = [piece_shards] if piece_shards != "auto" else [g for g in (2 ** i for i in range(11)) if g <= cl.ranks]
    floors = {g: simulate(units, replace(cl, piece_shards=g), "fused", floor=True)["step_s"] * (1 - FLOOR_SLACK)
              for g in widths}
    peer: dict[str, float] = {}
    beat = math.inf  # a fused step above this cannot be chosen
    if schedule == "auto":
        peer["fsdp2"] = peer_step(units, cl, peer)
        beat = (1 - MARGIN) * peer["fsdp2"]
    played = _played_widths(units, cl, floors, beat)
    predicted = {f"fused, piece_shards={g}": played[g] for g in widths if g in played}
    if len(played) < len(widths):
        predicted[UNPLAYED] = min(floors[g] for g in widths if g not in played)
    best = min(played, key=lambda g: (round(played[g], 6), g)) if played else None
    if schedule != "auto":
        return schedule, best, predicted
    predicted.update(peer)  # ("fsdp2 on NCCL", "fsdp2 on the rings", then "fsdp2")
    if best is not None and played[best] <= beat:
        return "fused", best, predicted
    return "fsdp2", 1 if piece_shards == "auto" else piece_shards, predicted


UNPLAYED = "fused, not played, at least"  # decide's entry for the piece widths it bounded out: their least bound
FLOOR_SLACK = 1e-9  # the bounds are taken this much lower: their float sums run in another order than the play's


def _played_widths(units: list, cl: Cluster, floors: dict[int, float], beat: float) -> dict[int, float]:
    """The fused step at each width of ``floors`` (width -> lower bound of its step) that could be chosen, played
    cheapest bound first: a width whose bound is above ``beat``, or whose bound ranks (rounded, then by width)
    after the best step played so far, is not played; every width after it in that order would rank after too.
    Where any width is played, so is width 1 (its trace is the same: a play costs one more timing of it)."""
    def rank(seconds: float, g: int) -> tuple[float, int]:
        return round(seconds, 6), g

    played: dict[int, float] = {}
    best = None
    for g in sorted(floors, key=lambda g: rank(floors[g], g)):
        if floors[g] > beat:
            continue
        if best is not None and rank(floors[g], g) > rank(played[best], best):
            break
        played[g] = simulate(units, replace(cl, piece_shards=g), "fused")["step_s"]
        if best is None or rank(played[g], g) < rank(played[best], best):
            best = g
    if played and 1 in floors and 1 not in played:  # one shard a piece, what the others are compared with: one
        played[1] = simulate(units, replace(cl, piece_shards=1), "fused")["step_s"]  # more timing of the same trace
    return played


def decide_by_playing_all(units: list, cl: Cluster, schedule: str = "auto", piece_shards: int | str = "auto"
                          ) -> tuple[str, int, dict[str, float]]:
    """The naive reference of ``decide``: every width played, nothing bounded, the same rule (with
    ``replace(cl, stand_in_ranks=None)`` every play also runs on the real ring; ``tests/test_plan_speed.py`` and
    ``benchmarks/startup.py`` compare the two)."""
    widths = [piece_shards] if piece_shards != "auto" else [g for g in (2 ** i for i in range(11)) if g <= cl.ranks]
    predicted = {f"fused, piece_shards={g}": simulate(units, replace(cl, piece_shards=g), "fused")["step_s"]
                 for g in widths}
    best = min(widths, key=lambda g: (round(predicted[f"fused, piece_shards={g}"], 6), g))
    if schedule != "auto":
        return schedule, best, predicted
    predicted["fsdp2"] = peer_step(units, cl, predicted)
    if predicted[f"fused, piece_shards={best}"] <= (1 - MARGIN) * predicted["fsdp2"]:
        return "fused", best, predicted
    return "fsdp2", 1 if piece_shards == "auto" else piece_shards, predicted


def peer_step(units: list, cl: Cluster, predicted: dict[str, float] | None = None) -> float:
    """The peer's predicted step on ``cl``: on the rings, or where ``cl.peer_nccl`` on NCCL's own collectives
    unless the rings are predicted faster by ``MARGIN`` (both then go into ``predicted``, as ``fsdp2 on NCCL`` and
    ``fsdp2 on the rings``)."""
    rings = simulate(units, replace(cl, peer_nccl=False), "fsdp2")["step_s"]
    if not cl.peer_nccl:
        return rings
    nccl = simulate(units, cl, "fsdp2")["step_s"]
    if predicted is not None:
        predicted.update({"fsdp2 on NCCL": nccl, "fsdp2 on the rings": rings})
    return rings if rings <= (1 - MARGIN) * nccl else nccl


def predict(model: tuple, cl: Cluster, tokens: int, seq: int, peak_flops_per_s: float | None = None
            ) -> dict[str, dict]:
    """Per schedule: step and compute seconds (whole GEMMs), ``pieces_s`` (what computing the GEMMs in N pieces
    adds: fused and slicing, with ``cl.piece_fit``), exposed communication (the rest of the device's time),
    ``host_s`` (the host's time to issue the fused groups, with ``cl.host_fit``: the step is at least that),
    ``mfu`` (model FLOPs per second against the hardware's peak, ``peak_flops_per_s``; the achievable rate when
    none is given) and ``of_achievable`` (against ``cl.flops_per_s``, what compute alone reaches: 1.0 means no
    exposed communication and no pieces)."""
    peak = peak_flops_per_s or cl.flops_per_s
    units = units_for(*model, tokens=tokens, seq=seq)
    out = {}
    for schedule in SCHEDULES:
        r = simulate(units, cl, schedule)
        r.setdefault("pieces_s", 0.0)
        r.setdefault("host_s", 0.0)
        # (the device's time: where the host is the longer, the step waits for it, not for the link)
        r["exposed_s"] = max(r.get("device_s", r["step_s"]) - r["compute_s"] - r["pieces_s"], 0.0)
        r["mfu"] = r["flops"] / (r["step_s"] * peak)
        r["of_achievable"] = r["flops"] / (r["step_s"] * cl.flops_per_s)
        r["unplayed"] = unplayed(units, cl, schedule)
        out[schedule] = r
    return out
