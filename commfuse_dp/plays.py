"""The schedules of ``shard()`` played on a model of one rank: a compute stream and a link (``commfuse-dp plan``).

``Unit`` and ``Cluster`` describe the model and the machine; ``units_for`` builds a decoder's units; ``elastic``,
``slicing`` and ``lockstep`` play those schedules as ``runtime/schedule.py`` and ``runtime/slicing.py`` run them and
return the step time; ``edges`` is what every fused schedule leaves exposed at a step's head and tail. ``plan.py``
builds predictions, calibration and the sweep on these.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .config import MIN_FUSE_NUMEL, forward_bundles_auto


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
        table ring's ``(N-1)·c`` rows (``fused/embedding.py``'s ``rows_cheaper``); else the table shard, round an
        N-1-step ring. ``rows_ring``: as a bench file without ``embedding_rows`` ran it, the rows round an N-1-step
        ring of every token's row, taken while the tokens were no more than a shard's rows."""
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
    latency_s: float
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
    # CommFuseConfig.forward_bundles: a unit's forward rings share their steps (True), go each alone (False), or
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


def placed(units: list[Unit], cl: Cluster, elastic: bool) -> list[Unit]:
    """The units as ``shard()`` splits them under ``cl.min_fuse_numel``: a group whose weight shard is smaller is
    not fused, except under the elastic schedule (``elastic``) in a unit that has a fused group, whose ring steps
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
    the whole is within ``direct_bytes`` on more than 2 ranks, else N-1 ring steps."""
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


def host_seconds(units: list[Unit], cl: Cluster) -> float:
    """What the host spends issuing one step's fused groups (their ring steps, pieces and schedule bookkeeping:
    about 3 (N-1) ring steps and 2N pieces per group): the step cannot be shorter. 0 without ``host_fit``."""
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


def _gemm_items(units: list[Unit], cl: Cluster, shards: int = 1) -> list[tuple[int, float, int]]:
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


def edges(units: list[Unit], cl: Cluster, nbytes: int) -> float:
    """The exposed exchanges at a step's head (nbytes: parameter bytes) or tail (gradient bytes): parameters that
    are not fused, through one bucketed collective (one direct round when within ``direct_bytes``), and each ring
    embedding's exchange."""
    other = sum(u.other_numel for u in units if not u.table and not u.own)
    return bucketed_seconds(other, cl, nbytes) + sum(table_seconds(u, cl, nbytes) for u in units if u.table)


def elastic(units: list[Unit], cl: Cluster) -> float:
    """Step time of the fused schedule with elastic lookahead (``runtime/schedule.py``), played on one FIFO link.

    Rings ahead go by unit (a decoder layer, an FSDP2 unit) in the backward, and in the forward with
    ``forward_bundles`` (else one per group): the groups of one unit chosen together share their ring steps (a
    bundle: step k carries shard k of each), so a layer pays one ring's latency. When a fused group begins, its
    own weight ring (N-1 steps) is requested unless it was chosen ahead (then what is left of its bundle); then the
    following units (or groups) are chosen whole, in order (the forward's, then after the last forward group the
    backward's), while the gathered weights held (the running group's and those ahead) fit ``lookahead_bytes``
    (auto: two of the largest unit's, what slicing per layer holds: the layer computed and the next). The step
    starts with the rings chosen so, all requested before any piece, the first group's alone (``start_first``);
    later the chosen rings' steps are requested beside the pieces left in the running unit, spread over them
    (``FusedSchedule.pace``). Piece k of a group waits for its ring's
    step k-1. In the backward a unit's gradient partials stay in their buffers and go as one reduce-scatter ring
    (a gradient bundle), step k requested beside piece k of the unit's last group, never waited before the backward
    ends; the last unit of the backward sends its partials beside its own pieces (gradient step k when piece k starts), so the step
    ends with one hop at most. The last forward group (the lm_head) keeps its weight: its backward sends gradient
    partials only. Unfused parameters and ring embeddings as in ``lockstep``."""
    n, shards = cl.ranks, cl.piece_shards
    items = _gemm_items(units, cl, shards)
    fused = [i for i, (g, _, _) in enumerate(items) if g]
    unit_of = {i: items[i][2] for i in fused}
    full = {i: items[i][0] * cl.param_bytes for i in fused}  # a group's gathered weight
    per_unit: dict[int, float] = {}
    for i in fused:
        per_unit[unit_of[i]] = per_unit.get(unit_of[i], 0.0) + full[i]
    budget = 2 * max(per_unit.values()) if cl.lookahead_bytes is None else cl.lookahead_bytes
    together = cl.forward_bundles if cl.forward_bundles is not None else forward_bundles_auto(n, len(per_unit))
    link = [0.0]

    def send(at: float, nbytes: float) -> float:
        link[0] = max(at, link[0]) + cl.latency_s + nbytes / cl.bytes_per_s
        return link[0]

    class Bundle:
        """Ring steps shared by groups of one unit: weight rings (``keys``) or gradient partials (``grad``)."""

        def __init__(self, keys: list, step_bytes: float, left: int) -> None:
            self.keys, self.step_bytes, self.left = keys, step_bytes, left
            self.paced = False  # in ``paced``: its steps left count in ``paced_left``

        def request(self, at: float, count: int) -> int:
            count = min(count, self.left)
            for _ in range(count):
                done = send(at, self.step_bytes)
                for key in self.keys:
                    ahead[key].append(done)
            self.left -= count
            if self.paced:
                paced_left[0] -= count
            return count

    kept = fused[-1]
    order = [(i, "forward") for i in fused] + [(i, "backward") for i in reversed(fused) if i != kept]
    last_unit = unit_of[fused[0]]  # the backward's last: its partials go beside its own pieces
    ahead: dict[tuple[int, str], list[float]] = {}
    bundle_of: dict[tuple[int, str], Bundle] = {}
    paced: list[Bundle] = []
    paced_left = [0]  # the steps left of the bundles in ``paced``

    def pace_later(bundle: Bundle) -> None:
        bundle.paced = True
        paced.append(bundle)
        paced_left[0] += bundle.left

    def weight_bundle(keys: list) -> Bundle:
        bundle = Bundle(keys, sum(items[i][0] for i, _ in keys) / n * cl.param_bytes, n - 1)
        for key in keys:
            ahead[key], bundle_of[key] = [], bundle
        return bundle

    def choose(at: int, held: float, split_first: bool = False) -> None:
        """Choose the units (or forward groups) after order[at] whole while they fit (a unit partly ahead: the rest
        of it). ``split_first``: the first group's ring alone."""
        j = at + 1
        while j < len(order):
            run = [order[j]]
            while (together or order[j][1] == "backward") and not split_first and j + len(run) < len(order) and (
                    unit_of[order[j + len(run)][0]], order[j + len(run)][1]) == (unit_of[order[j][0]], order[j][1]):
                run.append(order[j + len(run)])
            j, split_first = j + len(run), False
            keys = [key for key in run if key not in ahead]
            if not keys:
                continue
            nbytes = sum(full[i] for i, _ in keys)
            if held + nbytes > budget:
                return
            pace_later(weight_bundle(keys))
            held += nbytes

    def begin(i: int, phase: str, t: float) -> list[float]:
        key = (i, phase)
        if key in ahead:
            steps, bundle = ahead.pop(key), bundle_of.pop(key)
            if bundle in paced:  # its pieces need the rest now
                bundle.request(t, n - 1)
                paced.remove(bundle)
        elif key == (kept, "backward"):
            steps = []
        else:
            weight_bundle([key]).request(t, n - 1)
            steps = ahead.pop(key)
        held = full[i] + sum(full[j] for j, _ in ahead)
        if key in order:
            choose(order.index(key), held)
        return steps

    def rest(i: int, phase: str) -> int:
        """Groups after group i in its unit's run of ``order`` (its pieces and theirs are what pace spreads over)."""
        if (i, phase) not in order:
            return 0
        at = count = order.index((i, phase)) + 1
        while count < len(order) and order[count][1] == phase and unit_of[order[count][0]] == unit_of[i]:
            count += 1
        return count - at

    def pace(t: float, pieces_left: int) -> None:
        if not paced:
            return
        quota = -(-paced_left[0] // pieces_left)
        while quota and paced:
            quota -= paced[0].request(t, quota)
            if not paced[0].left:
                paced.pop(0)

    t = link[0] = edges(units, cl, cl.param_bytes)
    if units[0].table:  # start_first: the ring embedding's exchange is under way; nothing to pace over
        choose(-1, 0.0, split_first=True)
        for bundle in paced:
            bundle.request(t, n - 1)
        paced.clear()
    for i, (numel, seconds, _) in enumerate(items):  # forward
        if not numel:
            t += seconds
            continue
        steps = begin(i, "forward", t)
        after = rest(i, "forward")
        owed = 0.0  # compute of the landed shards not yet run (piece_shards: a run of them at once)
        for k in range(n):
            if k:
                t = max(t, steps[k - 1])
            pace(t, n - k + n * after)
            owed += seconds / n
            if (k + 1) % shards == 0 or k == n - 1:
                t, owed = t + owed, 0.0
    grads = 0.0  # the running unit's gradient bundle: bytes per step so far
    for i, (numel, seconds, unit) in reversed(list(enumerate(items))):  # backward: twice the forward's compute
        if not numel:
            t += 2 * seconds
            continue
        steps = begin(i, "backward", t)
        after = rest(i, "backward")
        own = unit == last_unit
        grads += 0.0 if own else numel / n * cl.grad_bytes
        owed = 0.0  # dx of the landed shards not yet run (dW runs per piece: it feeds the gradient ring)
        for k in range(n):
            if k:
                if steps:
                    t = max(t, steps[k - 1])
                if own:
                    send(t, numel / n * cl.grad_bytes)  # lags: nothing waits for it before the end
                elif not after:  # the unit's last group: a step of the unit's gradient bundle
                    send(t, grads)
            pace(t, n - k + n * after)
            t += seconds / n
            owed += seconds / n
            if (k + 1) % shards == 0 or k == n - 1:
                t, owed = t + owed, 0.0
        if not after:
            grads = 0.0
    return max(t, link[0]) + edges(units, cl, cl.grad_bytes)


def slicing(units: list[Unit], cl: Cluster) -> float:
    """Step time of the ``"slicing"`` schedule as it runs (``fused/sliced.py``), on one FIFO link: each fused group
    all-gathers its whole weight in one bucketed ring; when a group starts, the next group's gather (in the recorded
    order) is requested, then the group waits for its own. The first group of the forward is not prefetched; the
    last (the lm_head) keeps its weight for its backward. In the backward a group's reduce-scatter is requested when
    its compute ends, all waited when the backward ends. Unfused parameters, ring embeddings and layers with their
    own FSDP2 unit as in ``lockstep``."""
    n = cl.ranks
    items = _gemm_items(units, cl, cl.piece_shards)  # its GEMMs in runs of piece_shards gathered shards
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


def fsdp2_units(units: list[Unit]) -> tuple[float, list[int]]:
    """Stock FSDP2's units over ``units``: the root (everything that is not a decoder layer: the embedding table,
    the final norm, the lm_head), gathered whole; and each decoder layer with all of its parameters."""
    root = sum(u.fused_numel + u.other_numel for u in units if not u.layer)
    return root, [i for i, u in enumerate(units) if u.layer]


def fsdp2(units: list[Unit], cl: Cluster) -> float:
    """Step time of the peer, stock FSDP2 as it runs on a GPU (``use_ring_collectives(overlap=True)``, the bench's
    ``fsdp2_overlap``), on one FIFO link: nothing fused, whole GEMMs. The root unit (``fsdp2_units``) is gathered
    before anything computes and layer 0's gather is issued with it; each layer's pre-forward waits for its gather
    and issues the next layer's. The root keeps its parameters for the backward, whose pre-backward issues the last
    layer's gather; each layer's pre-backward waits for its own and issues the one before, and its reduce-scatter
    is issued when its backward compute ends; the root's goes last. The step ends when the compute and the link
    are both done (the backward waits for every reduce-scatter)."""
    if cl.ranks == 1:
        return sum(3 * u.flops for u in units) / cl.flops_per_s
    root, layers = fsdp2_units(units)
    size = {i: units[i].fused_numel + units[i].other_numel for i in layers}
    link = [0.0]

    def send(at: float, seconds: float) -> float:
        link[0] = max(at, link[0]) + seconds
        return link[0]

    def gather(i: int, at: float) -> float:
        return send(at, bucketed_seconds(size[i], cl, cl.param_bytes))

    t = send(0.0, bucketed_seconds(root, cl, cl.param_bytes))
    ready = {layers[0]: gather(layers[0], t)} if layers else {}
    for i, u in enumerate(units):  # forward
        if u.layer:
            t = max(t, ready.pop(i))
            at = layers.index(i)
            if at + 1 < len(layers):
                ready[layers[at + 1]] = gather(layers[at + 1], t)
        t += u.flops / cl.flops_per_s
    if layers:  # the root's pre-backward
        ready[layers[-1]] = gather(layers[-1], t)
    for i in reversed(range(len(units))):  # backward: twice the forward's compute
        u = units[i]
        if u.layer:
            t = max(t, ready.pop(i))
            at = layers.index(i)
            if at > 0:
                ready[layers[at - 1]] = gather(layers[at - 1], t)
        t += 2 * u.flops / cl.flops_per_s
        if u.layer:
            send(t, bucketed_seconds(size[i], cl, cl.grad_bytes))
    send(t, bucketed_seconds(root, cl, cl.grad_bytes))
    return max(t, link[0])


def fsdp2_bytes(units: list[Unit], cl: Cluster) -> float:
    """Bytes one rank sends in a step of the peer: every unit gathered twice (the root once) and reduce-scattered
    once."""
    root, layers = fsdp2_units(units)
    n = cl.ranks
    per = lambda numel, times: numel * (n - 1) / n * times  # noqa: E731
    return (per(root, 1) * cl.param_bytes + per(root, 1) * cl.grad_bytes
            + sum(per(units[i].fused_numel + units[i].other_numel, 1) * (2 * cl.param_bytes + cl.grad_bytes)
                  for i in layers))


def lockstep(units: list[Unit], cl: Cluster) -> float:
    """Step time of the fused schedule in lockstep (``lookahead_mb=0``): compute pieces and a FIFO link per rank.

    Each fused group (q/k/v, o, gate/up, down, lm_head) computes N pieces; ring step k is issued when piece k
    starts and waited when it ends, except that a group's step 0 (its own weight shards) is issued during the last
    piece of the group ``prefetch_depth`` before it, and in backward a group's last step (gradient partials only)
    is waited after the next group's first piece. Attention runs as compute with no ring step. Parameters that
    are not fused go through one bucketed all-gather before the forward and one reduce-scatter after the
    backward, both exposed; so do a ring embedding's two exchanges. A layer with its own FSDP2 unit (``Unit.own``)
    gathers it before its forward and its backward and reduce-scatters it after its backward, the compute waiting
    for each."""
    n, depth = cl.ranks, cl.prefetch_depth
    items = _gemm_items(units, cl)
    link = [0.0]

    def send(issue: float, nbytes: float) -> float:
        link[0] = max(issue, link[0]) + cl.latency_s + nbytes / cl.bytes_per_s
        return link[0]

    def block(issue: float, seconds: float) -> float:  # a collective the compute waits for (behind the link's queue)
        link[0] = max(issue, link[0]) + seconds
        return link[0]

    def phase(seq: list[tuple[int, float, int]], t: float, backward: bool) -> float:
        groups = [i for i, (g, _, _) in enumerate(seq) if g]
        first_done: dict[int, float] = {}
        deferred, current = None, None
        latency, rate = cl.latency_s, cl.bytes_per_s
        for i, (numel, seconds, unit) in enumerate(seq):
            if unit != current:
                t = own_unit_between(units, cl, current, unit, backward, block, t)
                current = unit
            if not numel:
                t += seconds
                continue
            shard = numel / n
            piece = seconds / n
            if i not in first_done:  # not prefetched: step 0 starts with the group
                first_done[i] = send(t, shard * cl.param_bytes)
            done = first_done[i]
            # steps 1 .. n-2 carry a weight shard (and in backward a gradient partial); the link's clock is
            # kept local here (the same arithmetic as ``send``: this loop is the sweep's hot path)
            middle = shard * (cl.param_bytes + (cl.grad_bytes if backward else 0))
            link_t = link[0]
            for k in range(n - 1):
                if k > 0:
                    link_t = done = (t if t > link_t else link_t) + latency + middle / rate
                t += piece
                if k == 0 and deferred is not None:
                    t, deferred = max(t, deferred), None
                if done > t:
                    t = done
            link[0] = link_t
            # the last piece: its step carries gradient partials only (backward); the following groups' step 0
            if n > 1 and backward and cl.grad_bytes:
                done = send(t, shard * cl.grad_bytes)
            elif n > 1:
                done = t
            at = groups.index(i)
            for j in groups[at + 1:at + 1 + depth]:
                if j not in first_done:
                    first_done[j] = send(t, seq[j][0] / n * cl.param_bytes)
            t += piece
            if n == 1 and deferred is not None:  # the loop above ran no piece
                t, deferred = max(t, deferred), None
            if backward:  # the last step lands during the next group's first piece
                deferred = done
        t = own_unit_between(units, cl, current, None, backward, block, t)
        return max(t, deferred) if deferred is not None else t

    t = link[0] = edges(units, cl, cl.param_bytes)
    t = phase(items, t, backward=False)
    t = phase([(g, 2 * f, u) for g, f, u in reversed(items)], t, backward=True)
    return max(t, link[0]) + edges(units, cl, cl.grad_bytes)
