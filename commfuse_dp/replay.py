"""The fused schedule's own decisions on a simulated link and clock: how ``commfuse-dp plan`` plays it.

[Note: one policy, two clocks]
The planner does not model the fused schedule a second time. ``traced`` builds the runtime's own objects, a
``FusedSchedule`` (elastic or lockstep) with its ``Gradients``, over stand-in groups whose buffers live on the
``meta`` device (no memory, no arithmetic), and drives them as the fused layer loop does (``run_pieces``, the
loop of ``fused/linear.py``): the same requests, in the same order, beside the same pieces. What happens is
recorded as a ``Trace`` (``TracedLink``, ``TracedPending``), and only the clocks are simulated (``Trace.time``):

- the link works requests in order, one at a time: a request made at compute time ``t`` ends at
  ``max(t, link free) + latency + bytes / bandwidth``;
- the compute clock advances by each piece's modelled seconds, and a wait on a request moves it to the request's
  end.

Every decision of the schedule depends on the recorded layer order and byte counts, never on timing, so the order
of requests here is the runtime's (``tests/test_replay.py`` compares them on a real model and ring), and one
trace serves every link rate, latency and compute rate (``play`` caches them). What the planner predicts is then
what runs, apart from the cost model: seconds per piece, per byte, per hop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .config import CommFuseConfig
from .runtime.engine import Engine
from .runtime.group import FusedGroupState
from .runtime.layer_rings import WeightRing, run_pieces
from .runtime.layout import GroupLayout
from .runtime.schedule import FusedSchedule
from .runtime.step import StepState

WEIGHT_DTYPE = torch.float32  # the played weights' dtype: an element of it takes ``param_s_per_elem`` on the link
GRAD_DTYPE = torch.bfloat16  # the played gradients': ``grad_s_per_elem``


# trace events (``Trace.events``): what the compute and the link do, in program order
COMPUTE, REQUEST, WAIT, BETWEEN = range(4)


class Trace:
    """One played step as it ran on the compute side, timing apart: the events in program order (compute
    ``(COMPUTE, group, times)``: ``times`` the group's forward seconds; a request ``(REQUEST, weight elements,
    gradient elements)``; a wait ``(WAIT, request)``; the compute passing between units ``(BETWEEN, left,
    entered, backward)``), and ``order``: ``(layer, phase, k)`` of each request. The schedule decides by the
    recorded layer order and byte counts alone, so one trace serves every link rate, latency and compute rate."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.order: list[tuple[str, str, int]] = []

    def time(self, seconds: list[float], latency_s: float, param_s_per_elem: float, grad_s_per_elem: float,
             start: float = 0.0, between=None) -> tuple[float, float]:
        """``(compute end, link end)`` of the step on a FIFO link (a request ends at ``max(its time, the link
        free) + latency + bytes / bandwidth``) where group ``g``'s forward takes ``seconds[g]``, both starting at
        ``start``; ``between(left, entered, backward, block, t)``: see ``play``."""
        now = free = start
        ends: list[float] = []
        block_at = [0.0]

        def block(at: float, took: float) -> float:
            block_at[0] = max(block_at[0], at) + took
            return block_at[0]

        for event in self.events:
            kind = event[0]
            if kind == COMPUTE:
                now += seconds[event[1]] * event[2]
            elif kind == REQUEST:
                free = (free if free > now else now) + latency_s + event[1] * param_s_per_elem + \
                    event[2] * grad_s_per_elem
                ends.append(free)
            elif kind == WAIT:
                end = ends[event[1]]
                if end > now:
                    now = end
            elif between is not None:
                block_at[0] = free
                now = between(event[1], event[2], event[3], block, now)
                free = block_at[0]
        return now, free


class TracedPending:
    """A request of the traced step: a wait on it is an event; it never counts as landed before one (so
    ``Gradients.land`` completes nothing early: completing landed work costs no time, so that changes nothing)."""

    __slots__ = ("index", "trace")
    future = None  # (no worker thread, no CUDA event: ``Gradients.land`` completes it on the compute side)
    event = None

    def __init__(self, trace: Trace, index: int) -> None:
        self.trace, self.index = trace, index

    def done(self) -> bool:
        return False

    def wait(self) -> None:
        self.trace.events.append((WAIT, self.index))

    def settle(self) -> None:
        pass


class SimRing:
    """Rank 0 of a ring of ``size`` (the link, the shard indices): what the schedule asks of ``Ring``."""

    def __init__(self, size: int) -> None:
        self.size, self.rank, self.owners = size, 0, 0
        self.next, self.prev = 1 % size, (size - 1) % size

    def shard_held(self, k: int) -> int:
        return (self.rank - k) % self.size

    def shard_reduced(self, k: int) -> int:
        return (self.rank - k - 1) % self.size


class TracedLink:
    """The link of a traced step: each request (``Link.hop``'s arguments) becomes an event, with the weight and
    gradient elements it sends."""

    def __init__(self, ring: SimRing, trace: Trace) -> None:
        self.ring, self.trace = ring, trace
        self.requests = 0

    def hop(self, sends, recvs, op, k: int, hops: int, before=None, direct: bool = False, send_to=None,
            recv_from=None) -> TracedPending:
        self.trace.order.append((op.name, op.phase, k))
        weights = sum(t.numel() for t in sends if t.dtype == WEIGHT_DTYPE)
        grads = sum(t.numel() for t in sends if t.dtype != WEIGHT_DTYPE)
        self.trace.events.append((REQUEST, weights, grads))
        self.requests += 1
        return TracedPending(self.trace, self.requests - 1)


class PlayedGroup(FusedGroupState):
    """A fused group of ``numel`` weight elements (all ranks together) in unit ``unit``, with ``meta`` shards."""

    def __init__(self, steps: StepState, numel: int, name: str, unit) -> None:
        world = steps.engine.ring.size
        layout = GroupLayout.build([(numel, 1, False, False)], world)
        module = nn.Linear(1, numel, bias=False, device="meta", dtype=WEIGHT_DTYPE)
        super().__init__(steps, layout, [module], name, in_place=False)
        self.unit = unit
        self._local = [torch.empty(layout.members[0].chunk, 1, device="meta", dtype=WEIGHT_DTYPE)]

    def local_params(self) -> list[torch.Tensor]:
        return self._local

    def accumulate_grads(self, flat, grad_dtypes, train) -> None:
        """(Nothing to put anywhere: only when it happens counts.)"""


@dataclass
class Group:
    """One item of the played step: a fused group (``numel`` > 0) or compute with no hop, its forward
    seconds, its unit."""

    name: str
    numel: int
    seconds: float
    unit: object


def play(groups: list[Group], ranks: int, latency_s: float, param_s_per_elem: float, grad_s_per_elem: float,
         config: CommFuseConfig, start: float = 0.0, first: bool = False,
         between: Callable[[object, object, bool, Callable[[float, float], float], float], float] | None = None
         ) -> tuple[float, float]:
    """``(compute end, link end)`` of one step of the fused schedule of ``config`` (``lookahead_mb``,
    ``forward_bundles``, ``prefetch_depth``, ``piece_shards``) over ``groups`` on ``ranks`` ranks, after a step that
    recorded the same layer order (as every step after the first runs); both clocks start at ``start``.
    ``first``: a ring embedding before the first group (``start_first``). ``between(left, entered, backward,
    block, t)``: what the compute waits for between two units (their own FSDP2 units' collectives:
    ``costs.own_unit_between``), ``block(at, seconds)`` a collective on the link."""
    key = (tuple((g.numel, g.unit) for g in groups), ranks, first, config.lookahead_mb, config.piece_shards,
           config.prefetch_depth, config.forward_bundles)
    trace = _traces.get(key)
    if trace is None:
        trace = _traces[key] = traced(groups, ranks, config, first)
        if len(_traces) > 64:
            _traces.pop(next(iter(_traces)))
    return trace.time([g.seconds for g in groups], latency_s, param_s_per_elem, grad_s_per_elem, start, between)


_traces: dict[tuple, Trace] = {}


def traced(groups: list[Group], ranks: int, config: CommFuseConfig, first: bool = False) -> Trace:
    """One step of the fused schedule over ``groups`` as the runtime runs it (the module's Note), as a ``Trace``."""
    trace = Trace()
    ring = SimRing(ranks)
    engine = Engine(ring, None, config.replace(schedule="fused"))
    engine.link = TracedLink(ring, trace)
    steps = StepState(engine, FusedSchedule)
    sched: FusedSchedule = steps.schedule
    states = [PlayedGroup(steps, g.numel, g.name, g.unit) if g.numel else None for g in groups]
    for state in states:  # the previous step: it recorded the layer order
        if state is not None:
            sched.entered(state, True)
    sched.begin_step()
    shards = engine.config.piece_shards if sched.elastic else 1
    if first:
        sched.start_first("forward")
    kept = {}
    walk = _Walk(trace)
    for at, (g, state) in enumerate(zip(groups, states)):
        walk.enter(g.unit, False)
        if state is None:
            trace.events.append((COMPUTE, at, 1.0))
            continue
        sched.entered(state, True)
        keep = ranks > 1 and sched.keeps_weight(state)
        weights = sched.weights(state, state.local_params(), WEIGHT_DTYPE, "forward", keep)
        run_pieces(state, "forward", ranks, weights, None, _Compute(trace, at, ranks, shards, False))
        sched.release(weights)
        kept[id(state)] = weights if keep and weights.slots is not None else None
    walk.enter(None, False)
    for at in range(len(groups) - 1, -1, -1):
        g, state = groups[at], states[at]
        walk.enter(g.unit, True)
        if state is None:
            trace.events.append((COMPUTE, at, 2.0))
            continue
        sched.backward_begins(state)
        full = kept[id(state)]  # (as ``BackwardCall``: a kept weight sends nothing in the backward)
        weights = sched.weights(state, state.local_params(), WEIGHT_DTYPE, "backward") if full is None else \
            WeightRing(engine, None, full.slots, own=full.own, wire=full.wire)
        grads = sched.grads(state, state.layout.numel, GRAD_DTYPE, torch.device("meta"), False, True, weights,
                            True)
        run_pieces(state, "backward", ranks, weights, grads, _Compute(trace, at, ranks, shards, True))
        sched.release(weights)
        sched.finish_grads(state, grads, 1.0, (WEIGHT_DTYPE,), (True,))
    walk.enter(None, True)
    sched.end_backward()
    return trace


class _Walk:
    """An event where the compute passes from one unit into another (None: the phase's start or end)."""

    def __init__(self, trace: Trace) -> None:
        self.trace, self.unit = trace, None

    def enter(self, unit, backward: bool) -> None:
        if unit != self.unit or unit is None:
            self.trace.events.append((BETWEEN, self.unit, unit, backward))
            self.unit = unit


class _Compute:
    """Piece k's compute as events: the forward's GEMM, a run of ``shards`` landed shards at once (the forward's
    outputs, the backward's dx), and in the backward dW piece by piece (it feeds the gradient ring)."""

    def __init__(self, trace: Trace, group: int, ranks: int, shards: int, backward: bool) -> None:
        self.events, self.group, self.ranks, self.shards, self.backward = trace.events, group, ranks, shards, backward
        self.piece = 1.0 / ranks
        self.owed = 0.0

    def __call__(self, k: int) -> None:
        if self.backward:
            self.events.append((COMPUTE, self.group, self.piece))
        self.owed += self.piece
        if (k + 1) % self.shards == 0 or k == self.ranks - 1:
            self.events.append((COMPUTE, self.group, self.owed))
            self.owed = 0.0
