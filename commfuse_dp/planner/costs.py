"""The planner's model of one rank: ``Unit`` (a model's part: its fused groups, other parameters, compute, ring
embedding), ``Cluster`` (ranks, link, compute rate, host), what ``shard()`` fuses of them (``placed``), and what each
part costs on the link, on the compute stream (GEMMs cut into pieces) and on the host. ``plays.py`` plays the
schedules on these."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import MIN_FUSE_NUMEL


@dataclass(frozen=True)
class Unit:
    name: str
    fused_numel: int  # weight elements of fused linears (all ranks together)
    other_numel: int  # parameters through the bucketed rings (embedding, norms)
    flops: float  # forward FLOPs of this rank's tokens
    groups: tuple[int, ...] = ()  # the fused groups' weight elements, in order (sum: fused_numel)
    tokens: int = 0
    table: tuple[int, int] | None = None  # (rows, width) of a ring embedding (``CommFuseConfig.ring_embeddings``)
    outs: tuple[int, ...] = ()  # the fused groups' output widths (cut into N pieces of out / N rows)
    layer: bool = False  # a decoder layer: an FSDP2 unit in ``shard()`` (its unfused parameters may stay its own)
    unfused_groups: int = 0  # weight elements of groups ``placed`` left unfused (in other_numel)
    own: bool = False  # ``placed``: its unfused parameters keep an FSDP2 unit of their own (gathered per layer)

    def exchange(self, ranks: int, rows_ring: bool = False) -> tuple[int, int]:
        """A ring embedding's exchange, one way: (rounds, elements one rank sends). The rows of its tokens that the
        other shards own (ids spread evenly over the shards), in one direct round, where that is fewer than the
        table ring's ``(N-1)·c`` rows (``fused/embedding.py``'s ``rows_cheaper``); else the table shard, round a ring
        of N-1 hops. ``rows_ring``: as a bench file without ``embedding_rows`` ran it, the rows round a ring of N-1
        hops of every token's row, taken while the tokens were no more than a shard's rows."""
        rows, width = self.table
        chunk = -(-rows // ranks)
        if rows_ring:
            return ranks - 1, (ranks - 1) * (self.tokens if self.tokens <= chunk else chunk) * width
        moved = self.tokens * (ranks - 1) // ranks
        if moved > (ranks - 1) * chunk:
            return ranks - 1, (ranks - 1) * chunk * width
        return 1, moved * width


@dataclass(frozen=True)
class Cluster:
    ranks: int
    bytes_per_s: float
    latency_s: float  # fixed cost of one hop (one exchange with the ring's neighbours)
    flops_per_s: float
    param_bytes: int = 2
    grad_bytes: int = 2
    cpu_s_per_byte: float = 0.0  # compute time the communication's CPU work takes per byte (shared cores)
    prefetch_depth: int = 2  # CommFuseConfig.prefetch_depth (lockstep)
    lookahead_bytes: float | None = None  # CommFuseConfig.lookahead_mb in bytes; None: "auto"; 0: lockstep
    # A GEMM cut into N pieces of w = out / N output rows (as the fused and slicing schedules compute) takes
    # 1 + a * (256 / w) ** p times the whole GEMM's time (``piece_slowdown``); None: as fast as the whole.
    piece_fit: tuple[float, float] | None = None
    piece_shards: int = 1  # CommFuseConfig.piece_shards (the elastic schedule's pieces: N / this)
    # The host's time per fused group per step, a + b * N seconds, for the fused and slicing schedules
    # (``host_seconds``); None: not modelled.
    host_fit: tuple[float, float] | None = None
    # Where that host time goes: False, a GPU's host issuing ahead of its device (the step is at least the host's
    # time); True, compute on the same CPU thread (``commfuse-dp bench --compute real``): it adds to the compute.
    host_on_compute: bool = False
    # CommFuseConfig.forward_bundles: a unit's forward rings share their hops (True), go each alone (False), or
    # None: its "auto" (``CommFuseConfig.bundles_forward``)
    forward_bundles: bool | None = None
    # The peer's (fsdp2's) host work per step, seconds: FSDP2's copies into and out of its flat buffers and its hooks
    # (``benchmarks/step_overhead.py --schedules fsdp2``), on the computing thread or ahead of the device as
    # ``host_on_compute`` says; 0: not modelled
    peer_host_s: float = 0.0
    direct_bytes: float = 1 << 20  # CommFuseConfig.direct_kb in bytes: smaller bucketed collectives take one round
    rows_ring: bool = False  # the ring embedding's rows as a dense ring (``Unit.exchange``)
    # CommFuseConfig.min_fuse_numel: smaller groups (and ring embedding tables) are not fused (``placed``)
    min_fuse_numel: int = MIN_FUSE_NUMEL
    # The peer's FSDP2 units on NCCL's own all-gather and reduce-scatter (one kernel each) instead of the rings
    # (``peer_collective_seconds``), and the fixed cost of one such collective
    peer_nccl: bool = False
    nccl_latency_s: float = 20e-6
    # Narrow formats on the wire (``commfuse_dp/wire.py``): param_bytes / grad_bytes are then their bytes per
    # element, and encoding and decoding take this many compute seconds per element and pass (``codec_seconds``)
    codec_s_per_elem: float = 0.0
    # The fused schedule on more ranks than this is played on a ring of this many, each hop standing for several
    # (replay.py's [Note: a stand-in ring]); None: always on the real ring
    stand_in_ranks: int | None = 64


def placed(units: list[Unit], cl: Cluster, elastic: bool) -> list[Unit]:
    """The units as ``shard()`` splits them under ``cl.min_fuse_numel``: a group whose weight shard is smaller is
    not fused, except under the elastic schedule (``elastic``) in a unit that has a fused group, whose hops
    it shares; a ring embedding's table likewise. What is not fused joins the unfused parameters, which the root
    unit gathers at the step's head and reduce-scatters at its tail (``edges``); its compute stays where it was.
    A decoder layer whose linears left unfused bring its unfused shard to ``min_fuse_numel`` keeps them in an FSDP2
    unit of its own in ``shard()`` instead (``own``): gathered before the layer's forward and backward and
    reduce-scattered after its backward, each blocking (``unit_seconds``), as ``slicing`` and ``lockstep`` play
    it; ``elastic`` does not (``own_collectives``)."""
    n, least, out = cl.ranks, max(cl.min_fuse_numel, 1), []
    for u in units:
        if u.table is not None and u.table[0] * u.table[1] // n < least:
            u = replace(u, table=None)  # (its other_numel is the table)
        small = [g // n < least for g in u.groups]
        if any(small) and not (elastic and not all(small)):
            keep = [j for j, s in enumerate(small) if not s]
            left = sum(g for g, s in zip(u.groups, small) if s)
            u = replace(u, fused_numel=sum(u.groups[j] for j in keep), other_numel=u.other_numel + left,
                        unfused_groups=u.unfused_groups + left, groups=tuple(u.groups[j] for j in keep),
                        outs=tuple(u.outs[j] for j in keep) if u.outs else ())
        if u.layer and u.unfused_groups and u.other_numel // n >= least:
            u = replace(u, own=True)
        out.append(u)
    return out


def bucketed_seconds(numel: float, cl: Cluster, nbytes: int) -> float:
    """One bucketed gather or reduce-scatter of ``numel`` elements (all ranks'), latency included: one round where
    the whole is within ``direct_bytes`` on more than 2 ranks, else N-1 hops."""
    n = cl.ranks
    rounds = 1 if n > 2 and numel * nbytes <= cl.direct_bytes else n - 1
    return rounds * cl.latency_s + (n - 1) * numel / n * nbytes / cl.bytes_per_s


def unit_seconds(u: Unit, cl: Cluster, nbytes: int) -> float:
    """One gather or reduce-scatter of a layer's own FSDP2 unit (``Unit.own``)."""
    return bucketed_seconds(u.other_numel, cl, nbytes)


def own_unit_between(units: list[Unit], cl: Cluster, left: int | None, entered: int | None, backward: bool,
                     block, t: float) -> float:
    """A play walking its items from unit ``left`` into unit ``entered`` (None: the walk's start or end): a layer
    with its own FSDP2 unit is reduce-scattered when the backward leaves it and gathered when either pass enters
    it, the compute waiting for each (``block(t, seconds)``: the link's finish). Returns the compute's time."""
    if backward and left is not None and units[left].own:
        t = block(t, unit_seconds(units[left], cl, cl.grad_bytes))
    if entered is not None and units[entered].own:
        t = block(t, unit_seconds(units[entered], cl, cl.param_bytes))
    return t


def own_collectives(units: list[Unit], cl: Cluster) -> list[str]:
    """The decoder layers of ``placed`` units whose unfused linears ``shard()`` keeps in an FSDP2 unit of their own
    (``Unit.own``): ``slicing`` and ``lockstep`` play them, ``elastic`` does not. (Norms alone in such a unit, as with
    ``min_fuse_numel`` 0, cost each layer two tiny collectives: a latency the plays leave out.)"""
    return [u.name for u in units if u.own]


def table_seconds(u: Unit, cl: Cluster, nbytes: int) -> float:
    """A ring embedding's exchange one way (``nbytes``: bytes per element), latency included."""
    if cl.ranks == 1:
        return 0.0
    rounds, numel = u.exchange(cl.ranks, cl.rows_ring)
    return rounds * cl.latency_s + numel * nbytes / cl.bytes_per_s


# The fit of benchmarks/cuda_check.py's ``gemm`` part on an H200 (bf16, 8192 tokens, Llama-3-8B shapes, forward and
# backward; benchmarks/results/cuda-h200-check-1.json): within 0.1 of every measured slowdown for w >= 512.
H200_PIECE_FIT = (0.645, 0.89)


# The host's time per fused group per step on the lent H200's host with CUDA tensors, a least-squares line through
# ``benchmarks/step_overhead.py --fake-worlds 2,4,8,16 --device cuda`` (extra ms over the unsharded model, 9 fused
# groups; benchmarks/results/host-overhead-cuda-h200.txt): fused 1.62 + 0.302 N ms, slicing 1.76 + 0.301 N ms.
H200_HOST_FIT = (1.7e-3, 0.30e-3)


# The host's time per fused group per step on this project's 2-core CPU machines, on the thread that computes
# (``benchmarks/step_overhead.py``, benchmarks/results/step-overhead-fake-worlds.txt and
# step-overhead-2ranks-real.json): the bench model at 2 ranks, its GEMMs in pieces included, 2.75 ms a group
# (fused's 46.8 ms over 17 groups); a tiny Llama at 2-64 ranks, 0.08 ms more a group per rank.
CPU_HOST_FIT = (2.59e-3, 0.08e-3)
# The peer's own host work on CPU, per byte of parameters, of which it copies three times a step (out of its flat
# buffer after the forward's and the backward's all-gathers, into one before the reduce-scatter): 81 ms a step for
# the bench model's 68 MB at 2 ranks (``step_overhead.py --schedules fsdp2 --bench-model real``, the same file).
# On a GPU these copies are device kernels.
CPU_PEER_COPY_S_PER_BYTE = 0.081 / (3 * 68.2e6)


def peer_host_on_cpu(units: list[Unit], cl: Cluster, coarse: bool = False) -> float:
    """Seconds of the peer's host work per step on CPU: a copy of each unit's parameters per all-gather (two, or one
    for a unit kept gathered after the forward) and per reduce-scatter."""
    return CPU_PEER_COPY_S_PER_BYTE * cl.param_bytes * sum(
        sum(units[i].fused_numel + units[i].other_numel for i in members) * (2 if kept else 3)
        for members, kept in peer_units(units, coarse))


def peer_units(units: list[Unit], coarse: bool = False) -> list[tuple[list[int], bool]]:
    """The peer's FSDP2 units over ``units`` (``fsdp_units.py``), as (indices into ``units``, kept gathered after
    the forward). torchtitan's: what precedes the first decoder layer (the embedding), each layer (the last one
    kept), what follows the last (the final norm and the lm_head, kept), and a root for anything between layers.
    ``coarse``: the root holds every part that is not a layer (kept, as FSDP2 keeps its root), then each layer.
    The planner's models are untied (a tied table would make the embedding and the lm_head one kept unit)."""
    layers = [i for i, u in enumerate(units) if u.layer]
    others = [i for i, u in enumerate(units) if not u.layer]
    if coarse or not layers:
        return ([(others, True)] if others else []) + [([i], False) for i in layers]
    head = [i for i in others if i < layers[0]]
    tail = [i for i in others if i > layers[-1]]
    between = [i for i in others if layers[0] < i < layers[-1]]
    return (([(head, False)] if head else []) + [([i], i == layers[-1]) for i in layers]
            + ([(tail, True)] if tail else []) + ([(between, True)] if between else []))


def peer_collective_seconds(numel: float, cl: Cluster, nbytes: int) -> float:
    """One all-gather or reduce-scatter of a peer's FSDP2 unit: the bucketed rings (``bucketed_seconds``), or with
    ``cl.peer_nccl`` NCCL's own collective, one kernel at the link's rate after ``cl.nccl_latency_s``."""
    if not cl.peer_nccl:
        return bucketed_seconds(numel, cl, nbytes)
    return cl.nccl_latency_s + (cl.ranks - 1) * numel / cl.ranks * nbytes / cl.bytes_per_s


def codec_seconds(units: list[Unit], cl: Cluster, peer: bool) -> float:
    """Compute seconds a step spends encoding and decoding narrow formats (``cl.codec_s_per_elem``): of the
    parameters that travel (all ranks' elements E; the fused schedule's ring embedding tables travel as they are),
    every rank decodes each gathered weight in the forward and the backward (2E), encodes its own rows for both
    (2E/N), and encodes and decodes the gradients it sends and receives (2E(N-1)/N): 4E in all."""
    if not cl.codec_s_per_elem or cl.ranks == 1:
        return 0.0
    moved = sum(u.fused_numel + (u.other_numel if peer or not u.table else 0) for u in units)
    return 4.0 * moved * cl.codec_s_per_elem


def host_seconds(units: list[Unit], cl: Cluster) -> float:
    """What the host spends issuing one step's fused groups (their hops, pieces and schedule bookkeeping:
    about 3 (N-1) hops and 2N pieces per group): the step cannot be shorter. 0 without ``host_fit``."""
    if cl.host_fit is None or cl.ranks == 1:
        return 0.0
    a, b = cl.host_fit
    return sum(len(u.groups) for u in units) * (a + b * cl.ranks)


def piece_slowdown(cl: Cluster, out: int, shards: int = 1) -> float:
    """How much longer a group's GEMMs take in pieces of ``shards`` shards (``cl.ranks / shards`` pieces) than whole
    (1.0 without ``piece_fit``)."""
    if cl.piece_fit is None or cl.ranks <= shards or not out:
        return 1.0
    a, p = cl.piece_fit
    return 1.0 + a * (256.0 / max(out * shards / cl.ranks, 1.0)) ** p


def units_for(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int,
              tokens: int, seq: int) -> list[Unit]:
    kv = hidden * kv_heads // heads
    groups = [hidden * (hidden + 2 * kv), hidden * hidden, 2 * hidden * intermediate, intermediate * hidden]
    outs = (hidden + 2 * kv, hidden, 2 * intermediate, hidden)  # q/k/v, o, gate/up, down
    attention = 4 * tokens * seq * hidden  # QK^T and AV, causal halves ignored
    units = [Unit("embedding", 0, vocab * hidden, 0.0, tokens=tokens, table=(vocab, hidden))]
    for i in range(layers):
        numel = sum(groups)
        units.append(Unit(f"layer{i}", numel, 2 * hidden, 2.0 * tokens * numel + attention, tuple(groups), tokens,
                          outs=outs, layer=True))
    units.append(Unit("lm_head", vocab * hidden, hidden, 2.0 * tokens * vocab * hidden, (vocab * hidden,), tokens,
                      outs=(vocab,)))
    return units


def gemm_items(units: list[Unit], cl: Cluster, shards: int = 1) -> list[tuple[int, float, int]]:
    """(weight elements, forward seconds, unit index) per fused group, and compute-only gaps (attention; numel 0),
    in forward order. A group's seconds are its GEMMs' in pieces of ``shards`` shards (``piece_slowdown``)."""
    items: list[tuple[int, float, int]] = []
    for at, u in enumerate(units):
        if not u.groups:
            items.append((0, u.flops / cl.flops_per_s, at))
            continue
        gemm = [2.0 * u.tokens * g / cl.flops_per_s for g in u.groups]
        slow = [piece_slowdown(cl, o, shards) for o in u.outs] if u.outs else [1.0] * len(gemm)
        items += [(g, f * s, at) for g, f, s in zip(u.groups, gemm, slow)]
        if u.flops / cl.flops_per_s > sum(gemm):
            items.insert(len(items) - len(u.groups) + 1, (0, u.flops / cl.flops_per_s - sum(gemm), at))
    return items


def piece_extra(units: list[Unit], cl: Cluster, shards: int = 1) -> float:
    """Seconds a step's GEMMs take longer in pieces of ``shards`` shards than whole (forward and backward;
    ``piece_slowdown``)."""
    return sum(3.0 * 2.0 * u.tokens * g / cl.flops_per_s * (piece_slowdown(cl, o, shards) - 1.0)
               for u in units for g, o in zip(u.groups, u.outs))


def fused_link_floor(units: list[Unit], cl: Cluster) -> float:
    """Seconds the link needs at least for the rings of one step of the fused schedule over ``units`` (as
    ``placed`` split them), whatever it overlaps with: every fused group's weight gathered in the forward and in
    the backward (the forward's last group, the lm_head, keeps its weight for its backward) and its gradient
    reduce-scattered, each (N-1)/N of its elements, and N-1 hop latencies per unit with fused groups in each
    phase (a request never carries two hops of one ring, nor hops of two units). The exchanges at the step's head
    and tail (``edges``) and the collectives of layers with FSDP2 units of their own come on top."""
    n = cl.ranks
    if n == 1:
        return 0.0
    sizes = [g for u in units for g in u.groups]
    weights = 2 * sum(sizes) - (sizes[-1] if sizes else 0)
    return ((n - 1) / n * (weights * cl.param_bytes + sum(sizes) * cl.grad_bytes) / cl.bytes_per_s
            + 2 * (n - 1) * cl.latency_s * sum(1 for u in units if u.groups))


def edges(units: list[Unit], cl: Cluster, nbytes: int) -> float:
    """The exposed exchanges at a step's head (nbytes: parameter bytes) or tail (gradient bytes): parameters that
    are not fused, through one bucketed collective (one direct round when within ``direct_bytes``), and each ring
    embedding's exchange."""
    other = sum(u.other_numel for u in units if not u.table and not u.own)
    return bucketed_seconds(other, cl, nbytes) + sum(table_seconds(u, cl, nbytes) for u in units if u.table)
