"""When the fused schedule requests its hops across layers, and its layer calls (``FusedCall``; the loop they run:
``layer_call.py``; their weight rings: ``layer_rings.py``).

[Note: across layers]  (the per-layer math is in ``fused/linear.py``; the link that works the requests: ``link.py``)
The forward order of the fused groups is recorded in each step and used by the next one (the first step, and the
first after a ``reset()``, run without looking ahead). Two ways to use it, one loop:

- *Lockstep* (``lookahead_mb=0``). A layer requests hop k beside compute piece k and waits for it at the
  piece's end; in backward one hop carries the weight shard and the gradient partial. Two weight-shard and two
  gradient-shard buffers are live. During a layer's last piece, hop 0 of the next ``prefetch_depth`` layers is
  requested (``Lookahead.start_next``; ``start_first`` from a ring embedding); after the last layer of the forward the
  backward's first layers follow, so their weight shards land during the loss. A layer's last gradient hop is
  waited after the next layer's first piece (``Gradients.land``), or at the end of the backward.
- *Elastic* (``lookahead_mb`` > 0, default ``"auto"``). When a layer begins, the whole all-gather rings of the
  layers that follow it are chosen, in order, as long as their gathered weights fit in the budget; their hops
  are requested beside the layer's pieces, spread over them (``Lookahead.pace``), so they queue between its own gradient
  hops; the link runs them while compute works, so it idles less where compute has no hop beside it. A
  layer's weight ring gathers into an ``(N, numel)`` buffer; piece k still starts as soon as shard k has landed, so
  the first layer's head stays fused. Gradient partials go into an ``(N, numel)`` buffer each and are requested
  beside the next piece, but not waited for: they lag behind the all-gathers queued before them and land during later
  compute (``Gradients.land``, completed on the compute thread at piece boundaries and, at the latest, when the
  backward ends). So the step still ends with one exposed hop at most, as in lockstep. A unit's weight rings
  share their hops (``Bundle``: one ring's latency per unit) in the backward, and in the forward where
  ``CommFuseConfig.forward_bundles`` says so: there hop k carries shard k of every group, so the unit's first
  group waits for all of its unit's bytes, a lag that lasts the forward where the link runs as fast as compute.

Both keep every gathered shard of the last layer of the forward (the lm_head) for its backward
(``keeps_weight``), which then sends gradient partials only, like FSDP2's root that is not resharded.
Every decision depends on the recorded order and byte counts only, never on timing, so all ranks request the same
steps in the same order. All of it lives here and in ``StepState``, so that ``reset()`` can drop it after a step
that raised.
"""

from __future__ import annotations

import torch

from .engine import Engine
from .gradients import Gradients, GradRing, Lands, Travel
from .group import FusedGroupState
from .layer_call import GradSpec, ScheduledCall
from .layer_rings import WeightRing, WeightRings
from .lookahead import Lookahead
from .order import LayerOrder, unit_key
from .step import StepState


class FusedSchedule:
    """The fused schedule, elastic or lockstep (the Note above): which hops are requested beside each piece,
    which layers' rings are requested ahead, and when the lagging gradient rings land."""

    def __init__(self, engine: Engine, steps: StepState) -> None:
        self.engine, self.steps = engine, steps
        config = engine.config
        self.prefetch = config.prefetch_next and engine.ring.size > 1
        self.elastic = config.elastic(engine.ring.size)
        self.defer_last_reduce = self.prefetch
        self.keep_last_weight = self.prefetch  # see keeps_weight
        self.dtype_hint: torch.dtype | None = None  # compute dtype under autocast, for the prefetched buffers
        self.order = LayerOrder()  # the fused groups in the forward order of the previous step
        self.gradients = Gradients(engine)  # when each layer's gradient lands, and how
        self.rings = WeightRings(engine, self.elastic)  # each ring's buffers (CPU: reused)
        self.lookahead = Lookahead(self)  # the rings requested ahead of their layers, the hops paced over pieces

    @property
    def packs_params(self) -> bool:
        """Elastic: no gathered buffer is ever read as a whole with this rank's own rows in it."""
        return self.elastic

    def begin_step(self) -> None:
        if self.order.rotate():
            self.lookahead.plan()
        self.lookahead.begin_step()
        self.gradients.close_unit(None)

    def end_backward(self) -> None:
        """The backward is done: the gradient rings still waiting to go are requested now, in order (the weight
        rings chosen ahead and not requested are dropped: no layer follows), and every landing completed."""
        self.lookahead.pace_later(self.gradients.close_unit(None))
        self.lookahead.end_backward()
        self.gradients.finish_backward()

    def reset(self) -> None:
        """Drop everything of an aborted step: requested hops are waited for (every rank requested them alike)
        and their bytes dropped; the layer order is forgotten (the next step runs as a first step)."""
        self.lookahead.reset()
        self.gradients.reset()
        self.order.forget()

    # -- one layer call ----------------------------------------------------------------------------------------

    def forward(self, state: FusedGroupState, params, compute_dtype: torch.dtype, needs_dx: bool,
                recompute: bool = False) -> FusedCall:
        """The call of ``state``'s forward ([Note: one layer call]): the order recorded (``needs_dx``: a backward
        will need its weight), its weight ring (kept for the backward where ``keeps_weight``). ``recompute``: a
        forward recomputed during the backward, no part of the layer order, with nothing beside its pieces."""
        if not recompute:
            self.entered(state, needs_dx)
        keep = self.engine.ring.size > 1 and not recompute and self.keeps_weight(state)
        call = FusedCall(self, state, "forward", None, keep=keep, beside=not recompute)
        call.weights = self.weight_ring(state, params, compute_dtype, "forward", keep, recompute)
        return call

    def backward(self, state: FusedGroupState, params, compute_dtype: torch.dtype, needs_dx: bool,
                 full: WeightRing | None, spec: GradSpec | None) -> FusedCall:
        """The call of ``state``'s backward: its weight ring where dx is needed (``full``: the forward's kept ring,
        then no weight shard travels), its gradient ring where ``spec`` says what the partials are."""
        self.lookahead.pace_later(self.gradients.close_unit(unit_key(state)))  # another unit's bundle is complete
        weights = None
        if needs_dx:
            weights = full.landed() if full is not None else self.weight_ring(state, params, compute_dtype,
                                                                               "backward")
        grads = self.grad_ring(state, spec, weights) if spec is not None else None
        return FusedCall(self, state, "backward", weights, grads, spec)

    def weight_ring(self, state: FusedGroupState, params, compute_dtype: torch.dtype, phase: str, keep: bool = False,
                    recompute: bool = False) -> WeightRing:
        """The weight ring of one forward or backward of ``state``: the one requested ahead, or a new one. In
        elastic mode, the coming layers' rings are requested next (``Lookahead.entering``)."""
        ring = self.lookahead.take(state, phase) if not recompute else None
        if ring is None:
            ring = self.new_weights(state, params, compute_dtype, phase, keep)
            if self.elastic and not recompute:
                ring.request()
        elif self.elastic and ring.unrequested:  # chosen ahead, not all requested yet: its pieces need them now
            ring.request()
        if ring.slots is not None and keep:
            self.lookahead.keeps(state)
        if self.elastic and not recompute:
            self.lookahead.entering(state, phase, ring)
        return ring

    def new_weights(self, state: FusedGroupState, params, compute_dtype: torch.dtype, phase: str,
                    keep: bool) -> WeightRing:
        op = self.steps.ring_op(state.owner, phase) if self.engine.ring.size > 1 else None
        return self.rings.new(state, params, compute_dtype, op, keep)

    def release(self, weights: WeightRing) -> None:
        """``weights`` is done (every hop it is part of was waited for): ``WeightRings.release``."""
        self.rings.release(weights)

    def grad_ring(self, state: FusedGroupState, spec: GradSpec, weights: WeightRing | None) -> GradRing:
        """The gradient ring of one backward of ``state`` ([Note: the gradient path]); it shares the ring op of
        ``weights`` (the same backward's weight ring) when that travels, as one ring operation of the layer. Its
        hops lag in elastic mode, else join the pieces' weight hops. ``spec.accumulates``: the gradients may be
        put into ``.grad`` by us; then its last hop lands after the backward returns (``Lands.LATER``), with its
        unit's other rings where they share hops (``bundles_grads``)."""
        op, travel, lands = None, Travel.LOCAL, Lands.NOW
        if spec.communicates and self.engine.ring.size > 1:
            op = weights.op if weights is not None and weights.op is not None else self.steps.ring_op(state.owner,
                                                                                                      "backward")
            travel = Travel.LAGGING if self.elastic else Travel.WITH_PIECES
            if self.defer_last_reduce and spec.accumulates:
                lands = Lands.LATER
                if self.bundles_grads(state):  # its hops go with its unit's other rings, beside the last group
                    travel = Travel.BUNDLED
        ring = self.gradients.ring(state, op, spec.numel, spec.dtype, spec.device, spec.zeroed, travel, lands)
        if travel is Travel.BUNDLED:
            self.gradients.join_unit(unit_key(state), ring)
        return ring

    # -- gradient rings by unit ---------------------------------------------------------------------------------

    def bundles_grads(self, state: FusedGroupState) -> bool:
        """Whether ``state``'s gradient partials wait for its unit's gradient bundle (elastic, the order known,
        not the backward's last unit, whose partials go beside its own pieces so that the step ends with one hop
        at most)."""
        return self.elastic and bool(self.order) and unit_key(state) != self.order.last_unit

    def unit_grads_hop(self, state: FusedGroupState, k: int) -> None:
        """Beside piece k (k ≥ 1) of the unit's last group in the backward (by the recorded order): request hop k
        of the unit's gradient bundle; every group's partial k-1 is written by then. So a unit's gradients travel
        during its own last group, one ring for the unit, as early as their bytes exist."""
        if k and not self.order.rest(state, "backward"):
            self.gradients.unit_hop()

    # -- across layers ---------------------------------------------------------------------------------------

    def entered(self, state: FusedGroupState, needs_dx: bool) -> None:
        """A fused group's forward begins (records the order for the next step's prefetch)."""
        if self.prefetch:
            self.order.entered(state, needs_dx)

    def start_first(self, phase: str) -> None:
        """Before the first fused group of a forward (from a ring embedding): ``Lookahead.start_first``."""
        self.lookahead.start_first(phase)

    def keeps_weight(self, state: FusedGroupState) -> bool:
        """Whether ``state``'s forward keeps every gathered weight shard for its own backward: the last fused group
        of the forward (the lm_head) when a backward follows. Its backward then sends gradient partials only, like
        FSDP2's root that is not resharded after forward; it holds the full weight from its forward to its
        backward (one layer's worth of memory, while the loss is computed)."""
        return self.keep_last_weight and self.order.is_last(state) and self.order.needs_dx(state)


class FusedCall(ScheduledCall):
    """A fused group's call under ``FusedSchedule`` ([Note: one layer call]): beside each piece the schedule's
    other hops, after it the gradient rings that landed; closing hands the weight buffer back (``SlotPool``) and
    the gradients to ``Gradients.finish``."""

    def __init__(self, sched: FusedSchedule, state: FusedGroupState, phase: str, weights: WeightRing | None,
                 grads: GradRing | None = None, spec: GradSpec | None = None, keep: bool = False,
                 beside: bool = True) -> None:
        super().__init__(state, phase, weights, grads, spec, keep)
        self.sched, self.beside = sched, beside

    def before_piece(self, k: int) -> None:
        """Beside piece k (its own hops requested already, ``piece_hops``): a unit's gradient hop
        (``unit_grads_hop``), the hops of the rings chosen ahead (``pace``), and at the last piece the next
        layers' first hops (lockstep, ``start_next``). Nothing beside a recomputed forward's pieces."""
        if not self.beside:
            return
        sched, state, phase = self.sched, self.state, self.phase
        if self.grads is not None and self.grads.travel is Travel.BUNDLED:
            sched.unit_grads_hop(state, k)
        if sched.lookahead.paced:
            sched.lookahead.pace(state, phase, self.engine.ring.size - k)
        if k == self.engine.ring.size - 1:
            sched.lookahead.start_next(state, phase)

    def after_piece(self, k: int) -> None:
        """After piece k's compute, before its wait: in the backward, the gradient rings of earlier layers that
        have landed (lockstep: the previous layer's last hop, which had this first piece to land, waited for at
        k = 0)."""
        if self.phase == "backward":
            self.sched.gradients.land(block=k == 0 and not self.sched.elastic)

    def release(self) -> None:
        self.sched.release(self.weights)  # (a kept weight is never pooled)

    def finish(self) -> torch.Tensor | None:
        spec = self.spec
        return self.sched.gradients.finish(self.state, self.grads, spec.post, spec.dtypes, spec.train)
