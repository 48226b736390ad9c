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
Compute is the fused layer's loop over the same pieces: ``weights`` hands it the whole gathered ``(N, numel)``
buffer with nothing left to travel (``WeightRing.in_shard_order``: runs of ``piece_shards`` shards in shard
order), ``grads`` an ``(N, numel)`` buffer of partials (``WholeGrads``) that ``finish_grads`` reduce-scatters, so
the two schedules differ only in when communication happens.
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

    def before_piece(self, state: FusedGroupState, phase: str, k: int, grads=None) -> None:
        """(Nothing goes beside a piece: a layer's gather is whole, requested one layer ahead by ``weights``.)"""

    def after_piece(self, state: FusedGroupState, phase: str, k: int) -> None:
        """(Nothing lands between pieces: the reduce-scatters land when the backward ends.)"""

    def backward_begins(self, state: FusedGroupState) -> None:
        """(Nothing to start: the gradients of a layer travel whole, after its pieces.)"""

    def keeps_weight(self, state: FusedGroupState) -> bool:
        """(The last layer's gather is kept for its backward by ``weights`` itself.)"""
        return False

    def release(self, weights: WeightRing) -> None:
        """(A gathered buffer is dropped with its layer.)"""

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
        op = self.steps.ring_op(state.op, phase)
        work = ring_all_gather(flat.view(-1), packed, ring.group, async_op=True, tag=op.tag, label=op,
                               stats=self.engine.stats, **self.engine.config.ring_kwargs)
        return Gathered(work, flat)

    @staticmethod
    def _wait(work: dist.Work | None) -> None:
        """Wait for a collective: timed and counted in the step statistics where it is waited for
        (``ring/issue.py``)."""
        if work is not None:
            work.wait()

    def entered(self, state: FusedGroupState, needs_dx: bool) -> None:
        """A fused group's forward begins (not one recomputed in the backward): record the order for the next
        step's prefetch, and whether its backward will need its weight again (not when its input needs no
        grad)."""
        self._current.append(state)
        self._backward_gathers[id(state)] = needs_dx

    def weights(self, state: FusedGroupState, params, compute_dtype: torch.dtype, phase: str, keep: bool = False,
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

    # -- reduce-scatter in the background, landed when the backward ends ------------------------------------

    def grads(self, state: FusedGroupState, numel: int, reduce_dtype: torch.dtype, device: torch.device, zeroed: bool,
              communicates: bool, weights: WeightRing | None, accumulates: bool) -> WholeGrads:
        """The partials of one backward of ``state`` (always zeroed); ``accumulates``: reduce-scattered in the
        background and put into ``.grad`` when the backward ends (``Lands.LATER``), else at once."""
        return WholeGrads(self.engine, numel, reduce_dtype, device, Lands.LATER if accumulates else Lands.NOW)

    def finish_grads(self, state: FusedGroupState, grads: WholeGrads, post: float, dtypes: tuple,
                     train: tuple) -> torch.Tensor | None:
        """After a synced backward's pieces: the partials' reduce-scatter starts, then ``Gradients.finish``."""
        grads.reduce_scatter(self.steps.ring_op(state.op, "backward"))
        return self.gradients.finish(state, grads, post, dtypes, train)

    def end_backward(self) -> None:
        """At the end of the backward (``StepState``'s callback): the reduce-scatters land in the grads."""
        self.gradients.finish_backward()
