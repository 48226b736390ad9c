"""The fused schedule's own decisions on a simulated link and clock: how ``commfuse-dp plan`` plays it.

[Note: one policy, two clocks]
The planner does not model the fused schedule a second time. ``traced`` builds the runtime's own objects, a
``FusedSchedule`` (elastic or lockstep) with its ``Gradients``, over stand-in groups whose buffers live on the
``meta`` device (no memory, no arithmetic), and runs their layer calls as a fused layer does ([Note: one layer
call], ``runtime/layer_call.py``, with each piece's compute an event): the same requests, in the same order,
beside the same pieces. What happens is
recorded as a ``Trace`` (``TracedLink``, ``TracedPending``), and only the clocks are simulated (``Trace.time``):

- the link works requests in order, one at a time: a request made at compute time ``t`` ends at
  ``max(t, link free) + latency + bytes / bandwidth``;
- the compute clock advances by each piece's modelled seconds, and a wait on a request moves it to the request's
  end.

Every decision of the schedule depends on the recorded layer order and byte counts, never on timing, so the order
of requests here is the runtime's (``tests/test_replay.py`` compares them on a real model and ring), and one
trace serves every link rate, latency and compute rate (``play`` caches them). Nor does ``piece_shards`` change a
request (it only groups the landed shards a piece computes, ``runtime/layer_call.py``'s ``ShardRuns``): a piece is
recorded as its place k in the ring, and ``Trace.time`` groups them into runs of the width it is given, so one
trace serves every width too. What the planner predicts is then what runs, apart from the cost model: seconds
per piece, per byte, per hop.

[Note: a stand-in ring]
A trace holds O(ranks x groups) events, and building one costs Python work per event (about 2 s at 1024 ranks on
Llama-3-8B's 129 groups; timing it, a fiftieth of that). On a ring larger than ``stand_in`` ranks (``Cluster.
stand_in_ranks``; ``play``) the step is played on a ring of ``stand_in`` ranks instead, each hop standing for
(N-1)/(N'-1) of the real ring's: its latency and its seconds per element scaled so that every ring's total (N-1
hops, (N-1)/N of the group's elements) is the real ring's. The compute is the real ring's: each group's seconds
come from the real ranks and width (``costs.gemm_items``), split into N' pieces of 1/N' each; a run of ``g``
shards of N becomes ``g·N'/N`` shards of N' (at least one). The schedule's decisions that depend on the ranks are
made for the real ring (``forward_bundles="auto"``); its budget is in gathered bytes, which the ranks do not
change (padding apart). What the stand-in cannot show is detail finer than 1/N' of a ring: the first piece of a
group waits for one stand-in hop (N/N' real ones) where the runtime waits for one, and lockstep's prefetch of hop
0 of the next layers carries N/N' hops' bytes. ``tests/test_plan_speed.py`` plays both rings at 128 and 256 ranks
(Llama-3-8B and -70B, 6.25-450 GB/s): with a stand-in of 64 ranks the elastic step came within 0.003 % of the full
ring's and lockstep's within 0.23 %, and the schedule chosen was the same. Where GEMM pieces cost nothing, the
piece widths up to N/N' differ by less than that, and the width chosen may be another whose step on the full ring
is within 2e-5 of the best.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from ..config import CommFuseConfig
from ..runtime.engine import Engine
from ..runtime.group import FusedGroupState
from ..runtime.layer_call import GradSpec
from ..runtime.layout import GroupLayout
from ..runtime.schedule import FusedSchedule
from ..runtime.step import StepState

WEIGHT_DTYPE = torch.float32  # the played weights' dtype: an element of it takes ``param_s_per_elem`` on the link
GRAD_DTYPE = torch.bfloat16  # the played gradients': ``grad_s_per_elem``


# trace events (``Trace.events``): what the compute and the link do, in program order
COMPUTE, PIECE, REQUEST, WAIT, BETWEEN = range(5)


class Trace:
    """One played step on a ring of ``ranks`` as it ran on the compute side, timing apart: the events in program
    order (compute with no hop ``(COMPUTE, group, times)``: ``times`` the group's forward seconds; piece k of a
    fused group ``(PIECE, group, k, backward)``; a request ``(REQUEST, weight elements, gradient elements)``; a
    wait ``(WAIT, request)``; the compute passing between units ``(BETWEEN, left, entered, backward)``), and
    ``order``: ``(layer, phase, k)`` of each request. The schedule decides by the recorded layer order and byte
    counts alone, so one trace serves every link rate, latency, compute rate and piece width."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks
        self.events: list[tuple] = []
        self.order: list[tuple[str, str, int]] = []

    def time(self, seconds: list[float], latency_s: float, param_s_per_elem: float, grad_s_per_elem: float,
             start: float = 0.0, between=None, shards: int = 1) -> tuple[float, float]:
        """``(compute end, link end)`` of the step on a FIFO link (a request ends at ``max(its time, the link
        free) + latency + bytes / bandwidth``) where group ``g``'s forward takes ``seconds[g]``, both starting at
        ``start``; ``between(left, entered, backward, block, t)``: see ``play``. A fused group's pieces compute
        ``shards`` landed shards at a time (``CommFuseConfig.piece_shards``): its forward outputs and its
        backward's dx at the end of each run of ``shards`` pieces and at the last piece; its backward's dW piece
        by piece (it feeds the gradient ring)."""
        now = free = start
        ends: list[float] = []
        block_at = [0.0]
        inv, last = 1.0 / self.ranks, self.ranks - 1

        def block(at: float, took: float) -> float:
            block_at[0] = max(block_at[0], at) + took
            return block_at[0]

        for event in self.events:
            kind = event[0]
            if kind == PIECE:
                piece = seconds[event[1]] * inv
                if event[3]:
                    now += piece  # dW
                k = event[2]
                if (k + 1) % shards == 0 or k == last:
                    now += piece * (k % shards + 1)  # the run's outputs (forward) or dx (backward)
            elif kind == REQUEST:
                free = (free if free > now else now) + latency_s + event[1] * param_s_per_elem + \
                    event[2] * grad_s_per_elem
                ends.append(free)
            elif kind == WAIT:
                end = ends[event[1]]
                if end > now:
                    now = end
            elif kind == COMPUTE:
                now += seconds[event[1]] * event[2]
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
         between: Callable[[object, object, bool, Callable[[float, float], float], float], float] | None = None,
         stand_in: int | None = None) -> tuple[float, float]:
    """``(compute end, link end)`` of one step of the fused schedule of ``config`` (``lookahead_mb``,
    ``forward_bundles``, ``prefetch_depth``, ``piece_shards``) over ``groups`` on ``ranks`` ranks, after a step that
    recorded the same layer order (as every step after the first runs); both clocks start at ``start``.
    ``first``: a ring embedding before the first group (``start_first``). ``between(left, entered, backward,
    block, t)``: what the compute waits for between two units (their own FSDP2 units' collectives:
    ``costs.own_unit_between``), ``block(at, seconds)`` a collective on the link. ``stand_in``: on more ranks than
    this, the step is played on a ring of this many ([Note: a stand-in ring]); None: on the real ring."""
    played = ranks if stand_in is None or ranks <= stand_in else max(stand_in, 2)
    shards = config.piece_shards if config.elastic(ranks) else 1  # (lockstep computes per shard)
    units = {g.unit if g.unit is not None else ("group", at) for at, g in enumerate(groups) if g.numel}
    # decided for the real ring; the requests do not depend on the piece width (the module's Note)
    config = config.replace(forward_bundles=config.bundles_forward(ranks, len(units)), piece_shards=1)
    key = (tuple((g.numel, g.unit) for g in groups), played, first, config.lookahead_mb, config.prefetch_depth,
           config.forward_bundles)
    trace = _traces.get(key)
    if trace is None:
        with _collector_paused():
            trace = _traces[key] = traced(groups, played, config, first)
        if len(_traces) > 64:
            _traces.pop(next(iter(_traces)))
    hops = (ranks - 1) / (played - 1) if played < ranks else 1.0  # real hops per played hop
    per_elem = played * (ranks - 1) / (ranks * (played - 1)) if played < ranks else 1.0  # real elements per played
    if played < ranks:
        shards = min(played, max(1, round(shards * played / ranks)))
    return trace.time([g.seconds for g in groups], latency_s * hops, param_s_per_elem * per_elem,
                      grad_s_per_elem * per_elem, start, between, shards)


_traces: dict[tuple, Trace] = {}  # the traces ``play`` built, by groups, ring and schedule settings (at most 64)


@contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off while a trace is built (back as it was after). A build makes some
    10^5 small objects, which set off the collector's full passes over the whole heap (the model's modules
    included): on Llama-3-70B's 321 groups at 64 ranks those made the first build 0.76 s against 0.49 s without.
    What a build leaves in cycles (the runtime's objects) is collected at the next pass after it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def forget_traces() -> None:
    """Drop the traces ``play`` keeps: the next play builds its trace as a fresh process does (what
    ``benchmarks/startup.py`` times)."""
    _traces.clear()


def traced(groups: list[Group], ranks: int, config: CommFuseConfig, first: bool = False) -> Trace:
    """One step of the fused schedule over ``groups`` on a ring of ``ranks`` as the runtime runs it (the module's
    Note), as a ``Trace``; ``config.piece_shards`` changes no request (``Trace.time`` applies it)."""
    trace = Trace(ranks)
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
    if first:
        sched.start_first("forward")
    kept = {}
    walk = _Walk(trace)
    for at, (g, state) in enumerate(zip(groups, states)):
        walk.enter(g.unit, False)
        if state is None:
            trace.events.append((COMPUTE, at, 1.0))
            continue
        call = sched.forward(state, state.local_params(), WEIGHT_DTYPE, True)
        call.run(_Compute(trace, at, False), ranks)
        kept[id(state)] = call.kept
    walk.enter(None, False)
    spec = GradSpec(0, GRAD_DTYPE, torch.device("meta"), False, True, True, 1.0, (WEIGHT_DTYPE,), (True,))
    for at in range(len(groups) - 1, -1, -1):
        g, state = groups[at], states[at]
        walk.enter(g.unit, True)
        if state is None:
            trace.events.append((COMPUTE, at, 2.0))
            continue
        call = sched.backward(state, state.local_params(), WEIGHT_DTYPE, True, kept[id(state)],
                              spec._replace(numel=state.layout.numel))
        call.run(_Compute(trace, at, True), ranks)
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
    """Piece k's compute as an event (``Trace.time`` groups the pieces into runs of the width it is given)."""

    def __init__(self, trace: Trace, group: int, backward: bool) -> None:
        self.events, self.group, self.backward = trace.events, group, backward

    def __call__(self, k: int) -> None:
        self.events.append((PIECE, self.group, k, self.backward))
