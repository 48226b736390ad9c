"""What the fused schedule carries across layers within a step: the layer order, the prefetched first ring steps,
the kept lm_head weight and the deferred last gradient hops.

[Note: across layers]  (the per-layer loops are in ``linear.py``)
- The forward order of the fused groups is recorded in each step and used by the next one (the first step, and
  the first after a ``reset()``, run without prefetch).
- ``prefetch_next``: during a layer's last compute piece, step 0 of the next ``prefetch_depth`` layers starts
  (``start_next``; ``start_first`` from a ring embedding for the first layers). After the last layer of the
  forward, the backward's first layers follow, so their weight shards land during the loss.
- The last fused group of the forward (the lm_head) keeps every gathered weight shard for its backward
  (``keeps_weight``), which then sends gradient partials only, like FSDP2's root that is not resharded.
- A layer's last reduce-scatter hop stays in flight when its backward returns (``defer``) and lands during the
  next layer's first backward piece (``finish_deferred``), or at the end of the backward.
All of it lives here and in ``StepState``, so that ``reset()`` can drop it after a step that raised.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from ..engine import Engine, InFlight, RingOp
from ..ring.transport import RingCommError

if TYPE_CHECKING:
    from .modules import FusedGroupState
    from .step import StepState


class Ahead(NamedTuple):
    """A layer's first ring step, started during the previous layer (``prefetch_next``)."""

    step: InFlight
    buf: torch.Tensor  # the layer's packed weight shards being sent
    nbuf: torch.Tensor  # receiving the previous rank's shards
    op: RingOp
    full: torch.Tensor | None = None  # (N, numel) slots that buf and nbuf are part of, for a layer that keeps them


class FusedSchedule:
    def __init__(self, engine: Engine, steps: StepState) -> None:
        self.engine, self.steps = engine, steps
        self.prefetch = engine.config.prefetch_next and engine.ring.size > 1
        self.defer_last_reduce = self.prefetch
        self.keep_last_weight = self.prefetch  # see keeps_weight
        self.dtype_hint: torch.dtype | None = None  # compute dtype under autocast, for the prefetched buffers
        self._order: list[FusedGroupState] = []  # fused groups in the forward order of the previous step
        self._current: list[FusedGroupState] = []
        self._ahead: dict[tuple[int, str], Ahead] = {}
        self._needs_dx: dict[int, bool] = {}  # per group: does its backward send weight shards (input needs grad)?
        self._kept: set[int] = set()  # groups of this step whose forward kept the gathered weight (keeps_weight)
        self._deferred: list = []  # DeferredReduce of this backward

    def begin_step(self) -> None:
        if self._current:
            self._order, self._current = self._current, []
        self._kept.clear()
        for ahead in self._ahead.values():  # started on every rank alike but not used (another path was taken)
            self.engine.wait(ahead.step)
        self._ahead.clear()

    def end_backward(self) -> None:
        self.finish_deferred()

    def reset(self) -> None:
        """Drop everything of an aborted step: in-flight prefetches and deferred hops are waited for (every rank
        started them alike) and their bytes dropped; the layer order is forgotten (the next step runs as a
        first step)."""
        pending = [a.step for a in self._ahead.values()] + [d.step for d in self._deferred]
        self._ahead.clear()
        self._deferred = []
        for step in pending:
            _settle(step)
        self._order, self._current = [], []
        self._needs_dx.clear()
        self._kept.clear()

    # -- a layer's last gradient step, finished during the next layer ---------------------------------------

    def defer(self, deferred) -> None:
        """Keep ``deferred`` (a ``DeferredReduce``) in flight until the next fused backward's first piece ends
        or the backward finishes (``StepState``'s end-of-backward callback), whichever comes first."""
        self._deferred.append(deferred)

    def finish_deferred(self) -> None:
        pending, self._deferred = self._deferred, []
        for deferred in pending:
            self.engine.wait(deferred.step)
            deferred.complete()

    # -- across layers: the next layer's first ring step starts during this layer's last piece -------------

    def entered(self, state: FusedGroupState, needs_dx: bool) -> None:
        """A fused group's forward begins (records the order for the next step's prefetch)."""
        if self.prefetch:
            self._current.append(state)
            self._needs_dx[id(state)] = needs_dx

    def keeps_weight(self, state: FusedGroupState) -> bool:
        """Whether ``state``'s forward keeps every gathered weight shard for its own backward: the last fused group
        of the forward (the lm_head) when a backward follows. Its backward then sends gradient partials only, like
        FSDP2's root that is not resharded after forward; it holds the full weight from its forward to its
        backward (one layer's worth of memory, while the loss is computed)."""
        return (self.keep_last_weight and bool(self._order) and self._order[-1] is state
                and self._needs_dx.get(id(state), False))

    def kept(self, state: FusedGroupState) -> None:
        self._kept.add(id(state))

    def take_ahead(self, state: FusedGroupState, phase: str) -> Ahead | None:
        return self._ahead.pop((id(state), phase), None) if self.prefetch else None

    def start_next(self, state: FusedGroupState, phase: str) -> None:
        """Keep the first ring step of the ``prefetch_depth`` groups that follow ``state`` in ``phase`` in flight
        (if the order is known); a group whose step is already in flight counts without starting anything. After
        the last group of the forward, the backward's first groups follow (their weight shards land during the
        loss) when a backward can follow (the last group's input needed grad: not under ``no_grad``)."""
        if not self.prefetch:
            return
        order = self._order if phase == "forward" else self._order[::-1]
        try:
            at = order.index(state)
        except ValueError:
            return
        self._start_following(order, at, phase)
        if phase == "forward" and at == len(order) - 1 and self._needs_dx.get(id(state), False):
            self._start_following(order[::-1], -1, "backward")

    def start_first(self, phase: str) -> None:
        """Before the first fused group of a forward (from a ring embedding, once its own exchange is under way):
        start that group's first ring step and those of the following ones."""
        if self.prefetch and phase == "forward" and not self._current and self._order:
            self._start_following(self._order, -1, phase)

    def _start_following(self, order: list, at: int, phase: str) -> None:
        wanted = self.engine.config.prefetch_depth
        for following in order[at + 1:]:
            if wanted == 0:
                break
            if phase == "backward" and (not self._needs_dx.get(id(following), False) or id(following) in self._kept):
                continue  # its backward sends no weight shards: nothing to start early
            wanted -= 1
            key = (id(following), phase)
            if key in self._ahead:
                continue
            params = following.local_params()
            cdt = self.dtype_hint or self.engine.compute_dtype(params[0].dtype)
            keep = phase == "forward" and self.keeps_weight(following)
            buf, nbuf, full = self.first_buffers(following, params, cdt, keep)
            op = self.steps.ring_op(following.op, phase)
            self._ahead[key] = Ahead(self.engine.start([buf], [nbuf], op, 0), buf, nbuf, op, full)

    def first_buffers(self, state: FusedGroupState, params, cdt: torch.dtype, keep: bool):
        """(buf, nbuf, full) for a group's weight ring: its packed shards and the buffer that receives the previous
        rank's; with ``keep`` both are slots of ``full`` (N, numel), where every shard stays (``keeps_weight``)."""
        layout, ring = state.layout, self.engine.ring
        if keep:
            full = torch.empty(ring.size, layout.numel, dtype=cdt, device=params[0].device)
            return layout.pack(state.pairs(params), cdt, out=full[ring.rank]), full[ring.shard_held(1)], full
        buf = layout.pack(state.pairs(params), cdt)
        return buf, (torch.empty_like(buf) if ring.size > 1 else None), None


def _settle(step: InFlight) -> None:
    """Wait for a ring step of an aborted step; a broken ring has said so already, where it broke."""
    try:
        step.handle.wait()
    except RingCommError:
        pass
