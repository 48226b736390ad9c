"""``commfuse-dp plan``: predict step time, exposed communication and MFU of the schedules on a real cluster.

    commfuse-dp plan --model llama-7b --ranks 8 --link-gbps 50 --tflops 400 --tokens 8192
    commfuse-dp plan --model path/to/config.json --ranks 16 --link-gbps 25 --latency-us 20 --tflops 300
    commfuse-dp plan --calibrate bench.json          # predictions against the emulated cluster's measurements
    commfuse-dp plan --model llama3-8b --sweep      # fused / slicing over ranks, links and tokens per rank

The model is a list of units in execution order: the embedding, per decoder layer the fused groups (q/k/v,
o, gate/up, down; attention itself as compute only), the final norm and the lm_head. Each group has forward
compute ``2·T·out·in / F`` and backward twice that; a ring step costs ``α + bytes / B``. The simulation has two
resources per rank, the compute stream and the link, and plays each schedule on them:
- ``no_overlap``: every collective, then the compute that needs it.
- ``unit_slicing`` (not a schedule of this library; the bound of layer-level overlap, stock FSDP2's shape on one
  link): the link all-gathers unit i+1 (a decoder layer, norms included) while unit i computes, and
  reduce-scatters unit i during unit i-1's backward; the first all-gather and the last reduce-scatter are exposed.
- ``slicing`` (``fused/sliced.py``, as it runs): the same one group ahead, per fused group (``_slicing``).
- ``lockstep`` (``lookahead_mb=0``): inside each fused group N compute pieces run beside N-1 ring steps (forward) or
  N ring steps (backward: weight shards and gradient partial sums together); a piece waits for the ring step
  before it; step 0 of the next ``prefetch_depth`` groups goes during a group's last piece.
- ``fused`` (the default, elastic lookahead): when a group begins, the whole weight rings of the following units
  are chosen while they fit the lookahead budget, a unit's rings sharing their steps (a bundle); gradient partials
  lag and go as one ring per unit (``_elastic``).
  For both, parameters that are not fused (norms) and the ring embedding's exchanges are exposed at the step's
  head and tail.
Calibration fits F (compute alone) and B (communication alone) per rate from a ``commfuse-dp bench`` JSON, and
one figure for the machine where the JSON has the ``concurrent`` bound: the CPU time communication takes from
compute per byte. It compares the prediction for fused and slicing with their measured step times.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, replace

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


@dataclass(frozen=True)
class Unit:
    name: str
    fused_numel: int  # weight elements of fused linears (all ranks together)
    other_numel: int  # parameters through the bucketed rings (embedding, norms)
    flops: float  # forward FLOPs of this rank's tokens
    groups: tuple[int, ...] = ()  # the fused groups' weight elements, in order (sum: fused_numel)
    tokens: int = 0
    table: tuple[int, int] | None = None  # (rows, width) of a ring embedding (``CommFuseConfig.ring_embeddings``)

    def ring_step_numel(self, ranks: int) -> int:
        """A ring embedding's elements per ring step: the looked-up rows of one rank's tokens, or the table shard
        if that is smaller (``fused/embedding.py`` picks the smaller)."""
        rows, width = self.table
        return min(self.tokens, -(-rows // ranks)) * width


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


def units_for(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int,
              tokens: int, seq: int) -> list[Unit]:
    kv = hidden * kv_heads // heads
    groups = [hidden * (hidden + 2 * kv), hidden * hidden, 2 * hidden * intermediate, intermediate * hidden]
    attention = 4 * tokens * seq * hidden  # QK^T and AV, causal halves ignored
    units = [Unit("embedding", 0, vocab * hidden, 0.0, tokens=tokens, table=(vocab, hidden))]
    for i in range(layers):
        numel = sum(groups)
        units.append(Unit(f"layer{i}", numel, 2 * hidden, 2.0 * tokens * numel + attention, tuple(groups), tokens))
    units.append(Unit("lm_head", vocab * hidden, hidden, 2.0 * tokens * vocab * hidden, (vocab * hidden,), tokens))
    return units


def _gemm_items(units: list[Unit], cl: Cluster) -> list[tuple[int, float, int]]:
    """(weight elements, forward seconds, unit index) per fused group, and compute-only gaps (attention; numel 0),
    in forward order."""
    items: list[tuple[int, float, int]] = []
    for at, u in enumerate(units):
        if not u.groups:
            items.append((0, u.flops / cl.flops_per_s, at))
            continue
        gemm = [2.0 * u.tokens * g / cl.flops_per_s for g in u.groups]
        items += [(g, f, at) for g, f in zip(u.groups, gemm)]
        if u.flops / cl.flops_per_s > sum(gemm):
            items.insert(len(items) - len(u.groups) + 1, (0, u.flops / cl.flops_per_s - sum(gemm), at))
    return items


def _edges(units: list[Unit], cl: Cluster, nbytes: int) -> float:
    """The exposed exchanges at a step's head (nbytes: parameter bytes) or tail (gradient bytes): parameters that
    are not fused, through one bucketed ring, and each ring embedding's exchange."""
    n = cl.ranks
    other = sum(u.other_numel for u in units if not u.table)
    tables = sum((n - 1) * (cl.latency_s + u.ring_step_numel(n) * nbytes / cl.bytes_per_s) for u in units if u.table)
    return (n - 1) * (cl.latency_s + other / n * nbytes / cl.bytes_per_s) + tables


def _elastic(units: list[Unit], cl: Cluster) -> float:
    """Step time of the fused schedule with elastic lookahead (``fused/schedule.py``), played on one FIFO link.

    Rings ahead go by unit (a decoder layer, an FSDP2 unit): the groups of one unit chosen together share their
    ring steps (a bundle: step k carries shard k of each), so a layer pays one ring's latency, as slicing's
    per-layer gather does. When a fused group begins, its own weight ring (N-1 steps) is requested unless it was
    chosen ahead (then what is left of its bundle); then the following units are chosen whole, in order (the
    forward's, then after the last forward group the backward's), while the gathered weights held (the running
    group's and those ahead) fit ``lookahead_bytes`` (auto: two of the largest unit's, what slicing per layer
    holds: the layer computed and the next). The step starts with the first group's own ring, then the rest of its
    unit as a bundle (``start_first``, before any piece); the chosen bundles' steps are requested beside the pieces
    left in the running unit, spread over them (``FusedSchedule.pace``). Piece k of a group waits for its ring's
    step k-1. In the backward a unit's gradient partials stay in their buffers and go as one reduce-scatter ring
    (a gradient bundle), step k requested beside piece k of the unit's last group, never waited before the backward
    ends; the last unit of the backward sends its partials beside its own pieces (gradient step k when piece k starts), so the step
    ends with one hop at most. The last forward group (the lm_head) keeps its weight: its backward sends gradient
    partials only. Unfused parameters and ring embeddings as in ``_lockstep``."""
    n = cl.ranks
    items = _gemm_items(units, cl)
    fused = [i for i, (g, _, _) in enumerate(items) if g]
    unit_of = {i: items[i][2] for i in fused}
    full = {i: items[i][0] * cl.param_bytes for i in fused}  # a group's gathered weight
    per_unit: dict[int, float] = {}
    for i in fused:
        per_unit[unit_of[i]] = per_unit.get(unit_of[i], 0.0) + full[i]
    budget = 2 * max(per_unit.values()) if cl.lookahead_bytes is None else cl.lookahead_bytes
    link = [0.0]

    def send(at: float, nbytes: float) -> float:
        link[0] = max(at, link[0]) + cl.latency_s + nbytes / cl.bytes_per_s
        return link[0]

    class Bundle:
        """Ring steps shared by groups of one unit: weight rings (``keys``) or gradient partials (``grad``)."""

        def __init__(self, keys: list, step_bytes: float, left: int) -> None:
            self.keys, self.step_bytes, self.left = keys, step_bytes, left

        def request(self, at: float, count: int) -> int:
            count = min(count, self.left)
            for _ in range(count):
                done = send(at, self.step_bytes)
                for key in self.keys:
                    ahead[key].append(done)
            self.left -= count
            return count

    kept = fused[-1]
    order = [(i, "forward") for i in fused] + [(i, "backward") for i in reversed(fused) if i != kept]
    last_unit = unit_of[fused[0]]  # the backward's last: its partials go beside its own pieces
    ahead: dict[tuple[int, str], list[float]] = {}
    bundle_of: dict[tuple[int, str], Bundle] = {}
    paced: list[Bundle] = []

    def weight_bundle(keys: list) -> Bundle:
        bundle = Bundle(keys, sum(items[i][0] for i, _ in keys) / n * cl.param_bytes, n - 1)
        for key in keys:
            ahead[key], bundle_of[key] = [], bundle
        return bundle

    def choose(at: int, held: float) -> None:
        """Choose the units after order[at] whole while they fit (a unit partly ahead: the rest of it)."""
        j = at + 1
        while j < len(order):
            run = [order[j]]
            while j + len(run) < len(order) and (unit_of[order[j + len(run)][0]], order[j + len(run)][1]) == (
                    unit_of[order[j][0]], order[j][1]):
                run.append(order[j + len(run)])
            j += len(run)
            keys = [key for key in run if key not in ahead]
            if not keys:
                continue
            nbytes = sum(full[i] for i, _ in keys)
            if held + nbytes > budget:
                return
            paced.append(weight_bundle(keys))
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
        left = sum(b.left for b in paced)
        quota = -(-left // pieces_left)
        while quota and paced:
            quota -= paced[0].request(t, quota)
            if not paced[0].left:
                paced.pop(0)

    t = link[0] = _edges(units, cl, cl.param_bytes)
    if units[0].table:  # start_first: the ring embedding's exchange is under way; nothing to pace over
        first = weight_bundle([order[0]])
        first.request(t, n - 1)
        held = full[order[0][0]]
        rest_of_first = [key for key in order[1:1 + rest(*order[0])]]
        if rest_of_first:
            weight_bundle(rest_of_first).request(t, n - 1)
            held += sum(full[i] for i, _ in rest_of_first)
        choose(len(rest_of_first), held)
        for bundle in paced:
            bundle.request(t, n - 1)
        paced.clear()
    for i, (numel, seconds, _) in enumerate(items):  # forward
        if not numel:
            t += seconds
            continue
        steps = begin(i, "forward", t)
        after = rest(i, "forward")
        for k in range(n):
            if k:
                t = max(t, steps[k - 1])
            pace(t, n - k + n * after)
            t += seconds / n
    grads = 0.0  # the running unit's gradient bundle: bytes per step so far
    for i, (numel, seconds, unit) in reversed(list(enumerate(items))):  # backward: twice the forward's compute
        if not numel:
            t += 2 * seconds
            continue
        steps = begin(i, "backward", t)
        after = rest(i, "backward")
        own = unit == last_unit
        grads += 0.0 if own else numel / n * cl.grad_bytes
        for k in range(n):
            if k:
                if steps:
                    t = max(t, steps[k - 1])
                if own:
                    send(t, numel / n * cl.grad_bytes)  # lags: nothing waits for it before the end
                elif not after:  # the unit's last group: a step of the unit's gradient bundle
                    send(t, grads)
            pace(t, n - k + n * after)
            t += 2 * seconds / n
        if not after:
            grads = 0.0
    return max(t, link[0]) + _edges(units, cl, cl.grad_bytes)


def _slicing(units: list[Unit], cl: Cluster) -> float:
    """Step time of the ``"slicing"`` schedule as it runs (``fused/sliced.py``), on one FIFO link: each fused group
    all-gathers its whole weight in one bucketed ring; when a group starts, the next group's gather (in the recorded
    order) is requested, then the group waits for its own. The first group of the forward is not prefetched; the
    last (the lm_head) keeps its weight for its backward. In the backward a group's reduce-scatter is requested when
    its compute ends, all waited when the backward ends. Unfused parameters and ring embeddings as in
    ``_lockstep``."""
    n = cl.ranks
    items = _gemm_items(units, cl)
    ring = lambda numel, nbytes: (n - 1) * (cl.latency_s + numel / n * nbytes / cl.bytes_per_s)  # noqa: E731
    link = [0.0]

    def send(at: float, seconds: float) -> float:
        link[0] = max(at, link[0]) + seconds
        return link[0]

    t = link[0] = _edges(units, cl, cl.param_bytes)
    fused = [i for i, (g, _, _) in enumerate(items) if g]
    for phase, seq, factor in (("forward", fused, 1), ("backward", fused[::-1], 2)):
        gathered: dict[int, float] = {}
        if phase == "backward":
            gathered[seq[0]] = t  # the lm_head kept its forward's weight
        at = 0
        for i, (numel, seconds, _) in (enumerate(items) if phase == "forward" else reversed(list(enumerate(items)))):
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
    return max(t, link[0]) + _edges(units, cl, cl.grad_bytes)


def _lockstep(units: list[Unit], cl: Cluster) -> float:
    """Step time of the fused schedule in lockstep (``lookahead_mb=0``): compute pieces and a FIFO link per rank.

    Each fused group (q/k/v, o, gate/up, down, lm_head) computes N pieces; ring step k is issued when piece k
    starts and waited when it ends, except that a group's step 0 (its own weight shards) is issued during the last
    piece of the group ``prefetch_depth`` before it, and in backward a group's last step (gradient partials only)
    is waited after the next group's first piece. Attention runs as compute with no ring step. Parameters that
    are not fused go through one bucketed all-gather before the forward and one reduce-scatter after the
    backward, both exposed; so do a ring embedding's two exchanges."""
    n, depth = cl.ranks, cl.prefetch_depth
    items = _gemm_items(units, cl)
    link = [0.0]

    def send(issue: float, nbytes: float) -> float:
        link[0] = max(issue, link[0]) + cl.latency_s + nbytes / cl.bytes_per_s
        return link[0]

    def phase(seq: list[tuple[int, float, int]], t: float, backward: bool) -> float:
        groups = [i for i, (g, _, _) in enumerate(seq) if g]
        first_done: dict[int, float] = {}
        deferred = None
        for i, (numel, seconds, _) in enumerate(seq):
            if not numel:
                t += seconds
                continue
            shard = numel / n
            piece = seconds / n
            if i not in first_done:  # not prefetched: step 0 starts with the group
                first_done[i] = send(t, shard * cl.param_bytes)
            done = first_done[i]
            for k in range(n):
                if k > 0:
                    nbytes = shard * ((cl.param_bytes if k < n - 1 else 0) + (cl.grad_bytes if backward else 0))
                    done = send(t, nbytes) if nbytes else t
                if k == n - 1:  # the last piece: prefetch the following groups' step 0
                    at = groups.index(i)
                    for j in groups[at + 1:at + 1 + depth]:
                        if j not in first_done:
                            first_done[j] = send(t, seq[j][0] / n * cl.param_bytes)
                t += piece
                if k == 0 and deferred is not None:
                    t, deferred = max(t, deferred), None
                if k < n - 1:
                    t = max(t, done)
                elif backward:  # the last step lands during the next group's first piece
                    deferred = done
        return max(t, deferred) if deferred is not None else t

    t = link[0] = _edges(units, cl, cl.param_bytes)
    t = phase(items, t, backward=False)
    t = phase([(g, 2 * f, u) for g, f, u in reversed(items)], t, backward=True)
    return max(t, link[0]) + _edges(units, cl, cl.grad_bytes)


def simulate(units: list[Unit], cl: Cluster, schedule: str) -> dict:
    """Step time (s), its compute, and the model FLOPs of one step on one rank."""
    n = cl.ranks
    steps = n - 1

    def coll(numel: int, nbytes: int) -> float:  # one ring all-gather or reduce-scatter of numel elements
        return 0.0 if numel == 0 or n == 1 else steps * (cl.latency_s + numel / n * nbytes / cl.bytes_per_s)

    def moved(u: Unit, nbytes: int) -> float:  # one pass of a unit's parameters (or of a ring embedding's rows)
        if u.table and schedule != "no_overlap":
            return 0.0 if n == 1 else steps * (cl.latency_s + u.ring_step_numel(n) * nbytes / cl.bytes_per_s)
        return coll(u.fused_numel + u.other_numel, nbytes)

    fwd = [u.flops / cl.flops_per_s for u in units]
    bwd = [2 * f for f in fwd]
    compute = sum(fwd) + sum(bwd)
    flops = 3 * sum(u.flops for u in units)
    if schedule == "no_overlap":
        comm = sum(2 * coll(u.fused_numel + u.other_numel, cl.param_bytes) +
                   coll(u.fused_numel + u.other_numel, cl.grad_bytes) for u in units)
        return {"step_s": compute + comm, "compute_s": compute, "flops": flops}
    if cl.cpu_s_per_byte and n > 1:
        # Overlapped communication takes CPU from the compute it runs beside (gloo threads, the kernel's network
        # stack): the compute of an overlapping schedule slows by that much.
        total = sum(steps * u.ring_step_numel(n) * (cl.param_bytes + cl.grad_bytes) if u.table else
                    (u.fused_numel + u.other_numel) * steps / n * (2 * cl.param_bytes + cl.grad_bytes)
                    for u in units)  # bytes one rank sends per step
        slowed = replace(cl, cpu_s_per_byte=0.0,
                         flops_per_s=cl.flops_per_s * compute / (compute + cl.cpu_s_per_byte * total))
        return {**simulate(units, slowed, schedule), "compute_s": compute}
    if schedule == "slicing":
        return {"step_s": _slicing(units, cl) if n > 1 else compute, "compute_s": compute, "flops": flops}
    if schedule == "unit_slicing":
        # Not a schedule of this library: the strongest layer-level overlap, stock FSDP2's shape with its collectives
        # on one link (one gather per unit, norms included, one unit ahead). The link serves requests in issue order:
        # unit i+1's gather is issued when unit i starts computing; in backward, unit i's reduce-scatter is issued
        # when its backward compute ends.
        ag = [moved(u, cl.param_bytes) for u in units]
        rs = [moved(u, cl.grad_bytes) for u in units]
        link = comp = 0.0
        gathered = {0: ag[0]}
        link = ag[0]
        for i in range(len(units)):
            start = max(comp, gathered[i])
            if i + 1 < len(units):
                link = max(link, start) + ag[i + 1]
                gathered[i + 1] = link
            comp = start + fwd[i]
        order = list(reversed(range(len(units))))
        gathered = {order[0]: comp}  # the last unit keeps its forward gather for the backward
        for j, i in enumerate(order):
            start = max(comp, gathered[i])
            if j + 1 < len(order):  # (a ring embedding's backward needs no table: nothing to gather)
                link = max(link, start) + (0.0 if units[order[j + 1]].table else ag[order[j + 1]])
                gathered[order[j + 1]] = link
            comp = start + bwd[i]
            link = max(link, comp) + rs[i]
        return {"step_s": max(comp, link), "compute_s": compute, "flops": flops}
    if schedule in ("fused", "lockstep"):
        lockstep = schedule == "lockstep" or cl.lookahead_bytes == 0
        play = _lockstep if lockstep else _elastic
        t = compute if n == 1 else play(units, cl)
        return {"step_s": t, "compute_s": compute, "flops": flops}
    raise ValueError(f"unknown schedule {schedule!r}")


SCHEDULES = ("no_overlap", "unit_slicing", "slicing", "lockstep", "fused")


def recommend(cl: Cluster) -> dict:
    """Bucket and min_fuse_numel for which the per-step latency stays under 5% / 10% of the transfer."""
    bucket_bytes = 20 * cl.latency_s * cl.bytes_per_s
    fuse_bytes = 10 * cl.latency_s * cl.bytes_per_s
    return {"bucket_mb": max(1.0, round(bucket_bytes / 2**20, 1)),
            "min_fuse_numel": int(2 ** math.ceil(math.log2(max(fuse_bytes / cl.param_bytes, 1))))}


def predict(model: tuple, cl: Cluster, tokens: int, seq: int, peak_flops_per_s: float | None = None
            ) -> dict[str, dict]:
    """Per schedule: step and compute seconds, exposed communication, ``mfu`` (model FLOPs per second against the
    hardware's peak, ``peak_flops_per_s``; the achievable rate when none is given) and ``of_achievable`` (against
    ``cl.flops_per_s``, what compute alone reaches: 1.0 means no exposed communication)."""
    peak = peak_flops_per_s or cl.flops_per_s
    units = units_for(*model, tokens=tokens, seq=seq)
    out = {}
    for schedule in SCHEDULES:
        r = simulate(units, cl, schedule)
        r["exposed_s"] = max(r["step_s"] - r["compute_s"], 0.0)
        r["mfu"] = r["flops"] / (r["step_s"] * peak)
        r["of_achievable"] = r["flops"] / (r["step_s"] * cl.flops_per_s)
        out[schedule] = r
    return out


def load_model(spec: str) -> tuple:
    if spec in KNOWN_MODELS:
        return KNOWN_MODELS[spec]
    try:
        with open(spec) as f:
            c = json.load(f)
    except OSError:
        raise SystemExit(f"plan: --model {spec!r} is neither a known shape ({', '.join(KNOWN_MODELS)}) nor a "
                         f"readable HF config.json") from None
    try:
        hidden = c.get("hidden_size", c.get("n_embd"))
        heads = c.get("num_attention_heads", c.get("n_head"))
        return (hidden, c.get("intermediate_size", c.get("n_inner") or 4 * hidden),
                c.get("num_hidden_layers", c.get("n_layer")), heads, c.get("num_key_value_heads", heads),
                c["vocab_size"])
    except (KeyError, TypeError):
        raise SystemExit(f"plan: {spec} lacks hidden_size / num_hidden_layers / num_attention_heads / "
                         f"vocab_size") from None


def calibrate(path: str, latency_us: float) -> int:
    with open(path) as f:
        bench = json.load(f)
    m = bench["model"]
    model = (m["hidden"], m["intermediate"], m["layers"], m["heads"], m["heads"], m["vocab"])
    tokens, seq, world = m["batch"] * m["seq"], m["seq"], bench["world_size"]
    units = units_for(*model, tokens=tokens, seq=seq)
    flops = 3 * sum(u.flops for u in units)
    # What the bench's comm_only moves per rank: every unit gathered twice and reduce-scattered once, except the ring
    # embedding's two exchanges.
    zero3_bytes = sum(2 * (world - 1) * u.ring_step_numel(world) * 4 if u.table else
                      3 * (u.fused_numel + u.other_numel) * 4 * (world - 1) / world for u in units)
    # no_overlap has no measured twin: stock FSDP2 is unoverlapped on CPU but runs gloo's own collectives, which
    # are slower than the rings the planner models.
    names = {"fused": "fused", "slicing": "slicing", "lockstep": "fused_lockstep"}
    print(f"calibration against {path}: {world} ranks, fp32, {tokens} tokens per rank")
    # ``concurrent`` (compute and communication at once, independent) measures the CPU the communication takes from
    # compute on this machine, per byte; it shows only where compute, not the link, bounds that run (communication
    # alone shorter than compute alone). Without such a rate, none is assumed.
    by_rate: dict[float, dict[str, dict]] = {}
    for r in bench["records"]:
        by_rate.setdefault(r["rate_mbit"], {})[r["schedule"]] = r
    per_byte = [max(rows["concurrent"]["step_s"] - rows["compute_only"]["step_s"], 0.0) / zero3_bytes
                for rows in by_rate.values()
                if {"concurrent", "compute_only", "comm_only"} <= set(rows)
                and rows["comm_only"]["step_s"] < rows["compute_only"]["step_s"]]
    cpu_per_byte = sorted(per_byte)[len(per_byte) // 2] if per_byte else 0.0
    print(f"CPU taken from compute by communication: {cpu_per_byte * 1e9:.2f} s per GB moved"
          f"{'' if per_byte else ' (no concurrent run where compute bounds: none assumed)'}")
    print(f"{'rate Mbit/s':>11} {'F GFLOP/s':>10} {'B MB/s':>8} {'schedule':>9} {'predicted s':>11} {'measured s':>10} "
          f"{'error':>7}")
    worst = 0.0
    for rate, rows in sorted(by_rate.items()):
        if "compute_only" not in rows or "comm_only" not in rows:
            continue
        compute, comm = rows["compute_only"]["step_s"], rows["comm_only"]["step_s"]
        f_rate, b_rate = flops / compute, zero3_bytes / comm
        cl = Cluster(world, b_rate, latency_us * 1e-6, f_rate, param_bytes=4, grad_bytes=4,
                     cpu_s_per_byte=cpu_per_byte)
        for schedule, measured_name in names.items():
            if measured_name not in rows:
                continue
            predicted = simulate(units, cl, schedule)["step_s"]
            measured = rows[measured_name]["step_s"]
            error = predicted / measured - 1
            worst = max(worst, abs(error))
            print(f"{rate:>11g} {f_rate / 1e9:>10.1f} {b_rate / 1e6:>8.1f} {schedule:>9} {predicted:>11.3f} "
                  f"{measured:>10.3f} {error:>+7.1%}")
    print(f"worst error {worst:.1%}")
    return 0


SWEEP_RANKS = (2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
SWEEP_LINKS_GBPS = (6.25, 12.5, 25.0, 50.0, 100.0, 200.0, 450.0)
SWEEP_TOKENS = (2048, 4096, 8192, 16384)


def sweep(model_name: str, latency_us: float, tflops: float, dtype_bytes: int, seq: int,
          against: str = "slicing") -> int:
    """Fused step time over ``against``'s (``slicing`` or ``unit_slicing``) for every (ranks, link, tokens per rank)
    of the sweep grid; prints a table and returns the number of cells where fused is slower. The last lines count
    the cells against both."""
    model = load_model(model_name)
    print(f"{model_name}: fused (elastic lookahead) step time / {against}'s; {latency_us:g} us per ring step, "
          f"{tflops:g} TFLOP/s, {dtype_bytes}-byte elements, seq {seq}; tokens per rank across, ranks x GB/s down")
    print(f"{'ranks':>6} {'GB/s':>6} " + " ".join(f"{t:>7}" for t in SWEEP_TOKENS))
    ratios: dict[str, list[float]] = {"slicing": [], "unit_slicing": []}
    for ranks in SWEEP_RANKS:
        for gbps in SWEEP_LINKS_GBPS:
            cl = Cluster(ranks, gbps * 1e9, latency_us * 1e-6, tflops * 1e12, dtype_bytes, dtype_bytes)
            cells = []
            for tokens in SWEEP_TOKENS:
                r = predict(model, cl, tokens, min(seq, tokens))
                for name, seen in ratios.items():
                    seen.append(r["fused"]["step_s"] / r[name]["step_s"])
                ratio = ratios[against][-1]
                cells.append(f"{ratio:>6.3f}{'*' if ratio > 1.0 + 1e-9 else ' '}")
            print(f"{ranks:>6} {gbps:>6g} " + " ".join(cells))
    for name, seen in ratios.items():
        slower = [x for x in seen if x > 1.0 + 1e-9]
        print(f"{model_name}: fused slower than {name}{' (*)' if name == against else ''} in {len(slower)} of "
              f"{len(seen)} cells" + (f", at most {max(slower):.3f}x" if slower else ""))
    return sum(x > 1.0 + 1e-9 for x in ratios[against])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="commfuse-dp plan", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-7b", help=f"known shape ({', '.join(KNOWN_MODELS)}) or an HF "
                                                            f"config.json path")
    parser.add_argument("--ranks", type=int, default=8, help="data-parallel ranks")
    parser.add_argument("--link-gbps", type=float, default=50.0, help="per-rank link, GB/s (bytes)")
    parser.add_argument("--latency-us", type=float, default=15.0, help="fixed cost of one ring step, microseconds")
    parser.add_argument("--tflops", type=float, default=400.0, help="achievable TFLOP/s per rank")
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="the hardware's peak TFLOP/s per rank, for MFU (default 989: an H100 SXM, dense bf16)")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per rank per step")
    parser.add_argument("--seq", type=int, default=4096, help="sequence length")
    parser.add_argument("--dtype-bytes", type=int, default=2, help="bytes per parameter / gradient element")
    parser.add_argument("--calibrate", metavar="BENCH_JSON", help="compare with a `commfuse-dp bench --json` file")
    parser.add_argument("--sweep", action="store_true",
                        help=f"fused / slicing step time over ranks {SWEEP_RANKS[0]}-{SWEEP_RANKS[-1]}, links "
                             f"{SWEEP_LINKS_GBPS[0]:g}-{SWEEP_LINKS_GBPS[-1]:g} GB/s and {SWEEP_TOKENS[0]}-"
                             f"{SWEEP_TOKENS[-1]} tokens per rank, for --model (--seq caps at the tokens)")
    parser.add_argument("--against", choices=("slicing", "unit_slicing"), default="slicing",
                        help="--sweep: the schedule fused is divided by (slicing: this library's, as it runs; "
                             "unit_slicing: one gather per decoder layer, norms included, stock FSDP2's shape)")
    args = parser.parse_args(argv)
    if args.calibrate:
        return calibrate(args.calibrate, args.latency_us)
    if args.sweep:
        sweep(args.model, args.latency_us, args.tflops, args.dtype_bytes, args.seq, args.against)
        return 0
    for name in ("ranks", "tokens", "seq", "dtype_bytes"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    for name in ("link_gbps", "tflops", "peak_tflops"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    if args.tflops > args.peak_tflops:
        parser.error(f"--tflops {args.tflops:g} (achievable) is above --peak-tflops {args.peak_tflops:g} (the "
                     f"hardware's peak); give the peak of the accelerator you plan for")
    model = load_model(args.model)
    cl = Cluster(args.ranks, args.link_gbps * 1e9, args.latency_us * 1e-6, args.tflops * 1e12,
                 args.dtype_bytes, args.dtype_bytes)
    results = predict(model, cl, args.tokens, args.seq, args.peak_tflops * 1e12)
    print(f"{args.model}: {args.ranks} ranks, {args.link_gbps:g} GB/s links, {args.latency_us:g} us per ring step, "
          f"{args.tflops:g} TFLOP/s achievable of {args.peak_tflops:g} peak, {args.tokens} tokens per rank")
    print(f"{'schedule':>12} {'step s':>8} {'exposed comm s':>14} {'MFU':>6} {'of achievable':>13}")
    for schedule, r in results.items():
        print(f"{schedule:>12} {r['step_s']:>8.3f} {r['exposed_s']:>14.3f} {r['mfu']:>6.1%} "
              f"{r['of_achievable']:>13.1%}")
    print("MFU: model FLOPs per second against --peak-tflops; of achievable: against --tflops (compute alone)")
    print("unit_slicing: not a schedule of this library; one gather per decoder layer, norms included, one layer "
          "ahead (stock FSDP2's shape on one link): the bound of layer-level overlap")
    rec = recommend(cl)
    print(f"recommended: CommFuseConfig(bucket_mb={rec['bucket_mb']:g}, min_fuse_numel={rec['min_fuse_numel']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
