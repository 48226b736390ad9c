"""``SlicingScheduler``: the ``"slicing"`` schedule, data-slicing overlap on the same rings and the same GEMM pieces
as ``"fused"``, the same autograd Function (``fused/linear.py``) driven by this schedule instead of ``FusedSchedule``.

[Note: the slicing schedule]
This is the strongest layer-level overlap we build on our transport, kept so that every benchmark compares the
CommFuse idea itself against it, in one run:
- forward of layer i: its weight was all-gathered during layer i-1 (prefetch, on the ring thread); layer i+1's
  all-gather starts before layer i computes. The gathered weights are dropped after use (reshard after forward),
  except the last layer's, which the backward needs first.
- backward of layer i: its weight was re-gathered during layer i+1's backward; layer i-1's all-gather starts before
  layer i computes; layer i's gradient reduce-scatter runs on the ring thread during layer i-1's backward, and all
  of them are waited for once, when autograd finishes the backward (the tail: nothing hides the last one).
The order of layers is the one recorded in the previous step (the first step runs without prefetch).
Compute is the fused layer's loop over the same pieces (``layer_call.py``): its weight ring is the whole gathered
``(N, numel)`` buffer with nothing left to travel (``WeightRing.in_shard_order``: runs of ``piece_shards`` shards
in shard order), its gradients an ``(N, numel)`` buffer of partials (``WholeGrads``) that the call reduce-scatters
when it closes (``SlicingCall.finish``), so the two schedules differ only in when communication happens.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from ..ring.collectives import ring_all_gather
from ..ring.transport import RingCommError
from .engine import Engine
from .gradients import Gradients, Lands, WholeGrads
from .group import FusedGroupState
from .layer_call import GradSpec, ScheduledCall
from .layer_rings import WeightRing
from .step import StepState


class Gathered(NamedTuple):
    """A group's all-gather in flight: its work (None: landed already), the ``(N, numel)`` buffer it fills."""

    work: dist.Work | None
    flat: torch.Tensor  # (N, numel): every rank's packed shards


class SlicingScheduler:
    """The slicing schedule's communication: each group gathered whole one layer ahead on the ring thread, its
    gradient reduce-scattered behind it and put in place when the backward ends."""

    def __init__(self, engine: Engine, steps: StepState) -> None:
        self.engine, self.steps = engine, steps
        self.dtype_hint: torch.dtype | None = None  # compute dtype under autocast, for the prefetched gathers
        self._order: list[FusedGroupState] = []  # forward order of the previous step
        self._current: list[FusedGroupState] = []
        self._prefetched: dict[tuple[int, str], tuple[Gathered, list[torch.Tensor]]] = {}
        self.gradients = Gradients(engine)  # the reduce-scatters in flight, landed when the backward ends
        self.prefetch_hits = 0  # gathers that were already in flight when their layer asked for them
        self.gathers = 0  # gathers started
        self._backward_gathers: dict[int, bool] = {}  # per group: does its backward need the weight (dx)?

    @property
    def packs_params(self) -> bool:
        """Never: the gathered buffer of every rank's shards is read whole."""
        return False

    def begin_step(self) -> None:
        if self._current:
            self._order, self._current = self._current, []
        self._prefetched.clear()  # started on every rank alike but not used: the ring thread finishes them

    def start_first(self, phase: str) -> None:
        """(Fused schedule only: here each layer's gather prefetches the next one's.)"""

    def reset(self) -> None:
        """Drop everything of an aborted step: in-flight gathers and reduce-scatters are waited for (every rank
        started them alike) and their results dropped; the layer order is forgotten."""
        works = [g.work for g, _ in self._prefetched.values()]
        self._prefetched.clear()
        self.gradients.reset()
        for work in works:
            if work is not None:
                try:
                    work.wait()
                except RingCommError:  # a broken ring has said so already, where it broke
                    pass
        self._order, self._current = [], []
        self._backward_gathers.clear()

    # -- all-gather with prefetch ----------------------------------------------------------------------

    def _start_gather(self, state: FusedGroupState, params: list[torch.Tensor], dtype: torch.dtype,
                      phase: str) -> Gathered:
        ring = self.engine.ring
        self.gathers += 1
        packed = state.layout.pack(state.pairs(params), dtype)
        flat = packed.new_empty(ring.size, state.layout.numel)
        op = self.steps.ring_op(state.owner, phase)
        work = ring_all_gather(flat.view(-1), packed, ring.group, async_op=True, tag=op.tag, label=op,
                               stats=self.engine.stats, **self.engine.config.ring_kwargs)
        return Gathered(work, flat)

    @staticmethod
    def _wait(work: dist.Work | None) -> None:
        """Wait for a collective: timed and counted in the step statistics where it is waited for
        (``ring/issue.py``)."""
        if work is not None:
            work.wait()

    # -- one layer call ------------------------------------------------------------------------------------

    def forward(self, state: FusedGroupState, params, compute_dtype: torch.dtype, needs_dx: bool,
                recompute: bool = False) -> SlicingCall:
        """The call of ``state``'s forward: its weight gathered whole, its order recorded for the next step's
        prefetch with whether its backward will need the weight again (``needs_dx``; not for a forward
        recomputed in the backward)."""
        if not recompute:
            self._current.append(state)
            self._backward_gathers[id(state)] = needs_dx
        return SlicingCall(self, state, "forward", self._gathered(state, params, compute_dtype, "forward", recompute))

    def backward(self, state: FusedGroupState, params, compute_dtype: torch.dtype, needs_dx: bool,
                 full: WeightRing | None, spec: GradSpec | None) -> SlicingCall:
        """The call of ``state``'s backward: its weight gathered whole where dx is needed (``full`` is always None:
        the last layer's gather is kept by ``_gathered`` itself), its partials in one ``(N, numel)`` buffer
        (``WholeGrads``, always zeroed) reduce-scattered when the call closes; ``spec.accumulates``: in the
        background, put into ``.grad`` when the backward ends (``Lands.LATER``), else at once."""
        weights = self._gathered(state, params, compute_dtype, "backward") if needs_dx else None
        grads = None
        if spec is not None:
            grads = WholeGrads(self.engine, spec.numel, spec.dtype, spec.device,
                               Lands.LATER if spec.accumulates else Lands.NOW)
        return SlicingCall(self, state, "backward", weights, grads, spec)

    def _gathered(self, state: FusedGroupState, params, compute_dtype: torch.dtype, phase: str,
                  recompute: bool = False) -> WeightRing:
        """Every rank's shards of ``state``'s group, landed: prefetched if the previous step's order predicted it,
        and the next group's gather of this phase started before returning. ``recompute``: a forward recomputed
        in the backward (activation checkpointing), which prefetches nothing."""
        params = list(params)
        got = self._prefetched.pop((id(state), phase), None)
        self.prefetch_hits += got is not None
        gathered = got[0] if got is not None else self._start_gather(state, params, compute_dtype, phase)
        following = self._following(state, phase) if not recompute else None
        if following is not None and (id(following[0]), phase) not in self._prefetched:
            nxt_state, nxt_params = following
            nxt_dtype = self.dtype_hint or self.engine.compute_dtype(nxt_params[0].dtype)  # as its layer will ask
            self._prefetched[(id(nxt_state), phase)] = (
                self._start_gather(nxt_state, nxt_params, nxt_dtype, phase), nxt_params)
        self._wait(gathered.work)
        if (phase == "forward" and not recompute and self._backward_gathers.get(id(state), True) and self._order
                and state is self._order[-1]):
            self._prefetched[(id(state), "backward")] = (Gathered(None, gathered.flat), params)
        return WeightRing(self.engine, None, gathered.flat, in_shard_order=True)

    def _following(self, state: FusedGroupState, phase: str) -> tuple[FusedGroupState, list[torch.Tensor]] | None:
        order = self._order if phase == "forward" else self._order[::-1]
        for i, s in enumerate(order):
            if s is state:
                for nxt in order[i + 1:]:
                    if phase == "forward" or self._backward_gathers.get(id(nxt), True):
                        return nxt, nxt.local_params()
                return None
        return None

    # -- reduce-scatters in the background, landed when the backward ends ------------------------------------

    def end_backward(self) -> None:
        """At the end of the backward (``StepState``'s callback): the reduce-scatters land in the grads."""
        self.gradients.finish_backward()


class SlicingCall(ScheduledCall):
    """A fused group's call under the slicing schedule: nothing beside its pieces (its weight landed whole before
    them); closing starts the partials' reduce-scatter, then ``Gradients.finish``."""

    def __init__(self, sched: SlicingScheduler, state: FusedGroupState, phase: str, weights: WeightRing | None,
                 grads: WholeGrads | None = None, spec: GradSpec | None = None) -> None:
        super().__init__(state, phase, weights, grads, spec)
        self.sched = sched

    def finish(self) -> torch.Tensor | None:
        spec, sched = self.spec, self.sched
        self.grads.reduce_scatter(sched.steps.ring_op(self.state.owner, "backward"))
        return sched.gradients.finish(self.state, self.grads, spec.post, spec.dtypes, spec.train)
