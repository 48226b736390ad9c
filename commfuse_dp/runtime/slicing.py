"""``SlicingScheduler``: the communication of the ``"slicing"`` schedule (``fused/sliced.py`` has its compute and
the Note): each layer's weights all-gathered one layer ahead on the ring thread, its gradients reduce-scattered
behind it and waited for at the end of the backward."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from ..ring.collectives import ring_all_gather, ring_reduce_scatter
from ..ring.transport import RingCommError
from .engine import Engine
from .group import FusedGroupState
from .step import StepState


class Gathered(NamedTuple):
    """A group's all-gather in flight: its work (None: landed already), the ``(N, numel)`` buffer it fills."""

    work: dist.Work | None
    flat: torch.Tensor  # (N, numel): every rank's packed shards


class Reducing(NamedTuple):
    """A group's reduce-scatter in flight, with what its landing needs (the state, dtypes, trained members)."""

    work: dist.Work | None
    shard: torch.Tensor  # (numel,): this rank's summed gradient shards
    state: FusedGroupState
    grad_dtypes: tuple[torch.dtype, ...]
    train: tuple[bool, ...]


class SlicingScheduler:
    """The slicing schedule's communication: each group gathered whole one layer ahead on the ring thread, its
    gradient reduce-scattered behind it and put in place when the backward ends."""

    def __init__(self, engine: Engine, steps: StepState) -> None:
        self.engine, self.steps = engine, steps
        self.dtype_hint: torch.dtype | None = None  # compute dtype under autocast, for the prefetched gathers
        self._order: list[FusedGroupState] = []  # forward order of the previous step
        self._current: list[FusedGroupState] = []
        self._prefetched: dict[tuple[int, str], tuple[Gathered, list[torch.Tensor]]] = {}
        self._reducing: list[Reducing] = []
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
        """(Nothing goes beside a piece: a layer's gather is whole, requested one layer ahead by ``gather``.)"""

    def after_piece(self, state: FusedGroupState, phase: str, k: int) -> None:
        """(Nothing lands between pieces: the reduce-scatters land when the backward ends.)"""

    def reset(self) -> None:
        """Drop everything of an aborted step: in-flight gathers and reduce-scatters are waited for (every rank
        started them alike) and their results dropped; the layer order is forgotten."""
        works = [g.work for g, _ in self._prefetched.values()] + [r.work for r in self._reducing]
        self._prefetched.clear()
        self._reducing = []
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

    def gather(self, state: FusedGroupState, params: list[torch.Tensor], dtype: torch.dtype,
               phase: str, backward_gathers: bool = True) -> torch.Tensor:
        """Every rank's shards of ``state``'s group; prefetched if the previous step's order predicted it, and
        the next group's gather of this phase started before returning. ``backward_gathers`` (forward only):
        whether this group's backward will need its weight again (it does not when its input needs no grad)."""
        recompute = phase == "forward" and torch._C._current_graph_task_id() != -1  # checkpointing, in backward
        if phase == "forward" and not recompute:
            self._current.append(state)
            self._backward_gathers[id(state)] = backward_gathers
        got = self._prefetched.pop((id(state), phase), None)
        self.prefetch_hits += got is not None
        gathered = got[0] if got is not None else self._start_gather(state, params, dtype, phase)
        following = self._following(state, phase) if not recompute else None
        if following is not None and (id(following[0]), phase) not in self._prefetched:
            nxt_state, nxt_params = following
            nxt_dtype = self.dtype_hint or self.engine.compute_dtype(nxt_params[0].dtype)  # as its layer will ask
            self._prefetched[(id(nxt_state), phase)] = (
                self._start_gather(nxt_state, nxt_params, nxt_dtype, phase), nxt_params)
        self._wait(gathered.work)
        if phase == "forward" and backward_gathers and self._order and state is self._order[-1] and not recompute:
            self._prefetched[(id(state), "backward")] = (Gathered(None, gathered.flat), params)
        return gathered.flat

    def _following(self, state: FusedGroupState, phase: str) -> tuple[FusedGroupState, list[torch.Tensor]] | None:
        order = self._order if phase == "forward" else self._order[::-1]
        for i, s in enumerate(order):
            if s is state:
                for nxt in order[i + 1:]:
                    if phase == "forward" or self._backward_gathers.get(id(nxt), True):
                        return nxt, nxt.local_params()
                return None
        return None

    # -- reduce-scatter in the background, waited at the end of backward ------------------------------------

    def reduce_scatter(self, state: FusedGroupState, parts: torch.Tensor, grad_dtypes: tuple[torch.dtype, ...],
                       train: tuple[bool, ...]) -> None:
        ring = self.engine.ring
        shard = parts.new_empty(state.layout.numel)
        op = self.steps.ring_op(state.op, "backward")
        work = ring_reduce_scatter(shard, parts.view(-1), ring.group, dist.ReduceOp.SUM, async_op=True,
                                   tag=op.tag, label=op, stats=self.engine.stats, **self.engine.config.ring_kwargs)
        self._reducing.append(Reducing(work, shard, state, grad_dtypes, train))

    def reduce_scatter_now(self, state: FusedGroupState, parts: torch.Tensor) -> torch.Tensor:
        """The same reduce-scatter, waited for at once (the gradients must be returned through autograd)."""
        shard = parts.new_empty(state.layout.numel)
        op = self.steps.ring_op(state.op, "backward")
        ring_reduce_scatter(shard, parts.view(-1), self.engine.ring.group, dist.ReduceOp.SUM, tag=op.tag, label=op,
                            stats=self.engine.stats, **self.engine.config.ring_kwargs)
        _, post = self.engine.divide_factors()
        shard = shard.div_(post) if post != 1.0 else shard
        if self.engine.replicas is not None:  # HSDP: it goes back through autograd, so it crosses the copies now
            shard = self.engine.replicas.exchange_now(shard, f"the gradient of {state.name}")
        return shard

    def end_backward(self) -> None:
        """At the end of the backward (``StepState``'s callback): wait for the reduce-scatters and put the
        gradients in place."""
        _, post = self.engine.divide_factors()
        pending, self._reducing = self._reducing, []
        for red in pending:
            self._wait(red.work)
            if post != 1.0:
                red.shard.div_(post)
            red.state.accumulate_grads(red.shard, red.grad_dtypes, red.train)
