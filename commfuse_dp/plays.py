"""The schedules of ``shard()`` played on a model of one rank: a compute stream and a link (``commfuse-dp plan``).

``Unit`` and ``Cluster`` (``costs.py``) describe the model and the machine; ``units_for`` builds a decoder's units;
``elastic``, ``slicing`` and ``lockstep`` play those schedules as ``runtime/schedule.py`` and ``runtime/slicing.py`` run them and
return the step time; ``edges`` is what every fused schedule leaves exposed at a step's head and tail. ``plan.py``
builds predictions, calibration and the sweep on these.
"""

from __future__ import annotations

from .config import forward_bundles_auto
from .costs import Cluster, Unit, edges, gemm_items, own_unit_between, peer_collective_seconds, peer_units


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
    ends; the last unit of the backward sends its partials beside its own pieces (gradient step k when piece k
    starts), so the step ends with one hop at most. The last forward group (the lm_head) keeps its weight: its backward sends gradient
    partials only. Unfused parameters and ring embeddings as in ``lockstep``."""
    n, shards = cl.ranks, cl.piece_shards
    items = gemm_items(units, cl, shards)
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


def fsdp2(units: list[Unit], cl: Cluster, coarse: bool = False) -> float:
    """Step time of the peer, stock FSDP2 as it runs on a GPU over its units (``costs.peer_units``: torchtitan's
    wrapping, or the coarse one), on one FIFO link: nothing fused, whole GEMMs (``use_ring_collectives(overlap=True)``,
    the bench's ``fsdp2_overlap`` and ``fsdp2_coarse``). The first unit of the forward is gathered before anything
    computes, with the next issued behind it; each unit's pre-forward waits for its gather and issues the next
    unit's. The forward's end issues the gather of the last unit resharded after it (the units after it stay
    gathered). Each unit's pre-backward waits for its gather (unless it stayed gathered) and issues that of the unit
    that ended its forward before it; its reduce-scatter is issued when its backward compute ends. The step ends
    when the compute and the link are both done (the backward waits for every reduce-scatter). The collectives are
    the rings', or NCCL's where ``cl.peer_nccl`` (``costs.peer_collective_seconds``)."""
    if cl.ranks == 1:
        return sum(3 * u.flops for u in units) / cl.flops_per_s
    peers = peer_units(units, coarse)
    size = [sum(units[i].fused_numel + units[i].other_numel for i in members) for members, _ in peers]
    of = {i: k for k, (members, _) in enumerate(peers) for i in members}
    first, last = [min(m) for m, _ in peers], [max(m) for m, _ in peers]
    forward_order = sorted(range(len(peers)), key=first.__getitem__)
    ended_order = sorted(range(len(peers)), key=last.__getitem__)  # FSDP2's post-forward order
    held = {k for k, (_, kept) in enumerate(peers) if kept}  # not resharded after the forward
    link = [0.0]
    ready: dict[int, float] = {}  # gathers issued and not yet waited for

    def gather(k: int, at: float) -> None:
        link[0] = max(at, link[0]) + peer_collective_seconds(size[k], cl, cl.param_bytes)
        ready[k] = link[0]

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
        gather(resharded[-1], t)
    for i in reversed(range(len(units))):  # backward: twice the forward's compute
        k = of[i]
        if i == last[k]:
            if k not in held:
                t = max(t, ready.pop(k))
            at = ended_order.index(k)
            before = ended_order[at - 1] if at > 0 else None
            if before is not None and before not in held and before not in ready:
                gather(before, t)
        t += 2 * units[i].flops / cl.flops_per_s
        if i == first[k]:
            link[0] = max(t, link[0]) + peer_collective_seconds(size[k], cl, cl.grad_bytes)
    return max(t, link[0])


def fsdp2_bytes(units: list[Unit], cl: Cluster, coarse: bool = False) -> float:
    """Bytes one rank sends in a step of the peer: each unit gathered in the forward and again in the backward
    unless it stayed gathered, and reduce-scattered once."""
    n = cl.ranks
    return sum(sum(units[i].fused_numel + units[i].other_numel for i in members) * (n - 1) / n
               * ((1 if kept else 2) * cl.param_bytes + cl.grad_bytes) for members, kept in peer_units(units, coarse))


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
    items = gemm_items(units, cl)
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
