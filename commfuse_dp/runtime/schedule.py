"""When the fused schedule requests its ring steps across layers (the rings of one layer call and the steps beside
each compute piece: ``layer_rings.py``).

[Note: across layers]  (the per-layer loops are in ``fused/linear.py``; the link that works the requests: ``link.py``)
The forward order of the fused groups is recorded in each step and used by the next one (the first step, and the
first after a ``reset()``, run without looking ahead). Two ways to use it, one loop:

- *Lockstep* (``lookahead_mb=0``). A layer requests ring step k beside compute piece k and waits for it at the
  piece's end; in backward one step carries the weight shard and the gradient partial. Two weight-shard and two
  gradient-shard buffers are live. During a layer's last piece, step 0 of the next ``prefetch_depth`` layers is
  requested (``start_next``; ``start_first`` from a ring embedding); after the last layer of the forward the
  backward's first layers follow, so their weight shards land during the loss. A layer's last gradient step is
  waited after the next layer's first piece (``Gradients.land``), or at the end of the backward.
- *Elastic* (``lookahead_mb`` > 0, default ``"auto"``). When a layer begins, the whole all-gather rings of the
  layers that follow it are chosen, in order, as long as their gathered weights fit in the budget; their steps
  are requested beside the layer's pieces, spread over them (``pace``), so they queue between its own gradient
  steps; the link runs them while compute works, so it idles less where compute has no ring step beside it. A
  layer's weight ring gathers into an ``(N, numel)`` buffer; piece k still starts as soon as shard k has landed, so
  the first layer's head stays fused. Gradient partials go into an ``(N, numel)`` buffer each and are requested
  beside the next piece, but not waited for: they lag behind the all-gathers queued before them and land during later
  compute (``Gradients.land``, completed on the compute thread at piece boundaries and, at the latest, when the
  backward ends). So the step still ends with one exposed hop at most, as in lockstep. A unit's weight rings
  share their steps (``Bundle``: one ring's latency per unit) in the backward, and in the forward where
  ``CommFuseConfig.forward_bundles`` says so: there step k carries shard k of every group, so the unit's first
  group waits for all of its unit's bytes, a lag that lasts the forward where the link runs as fast as compute.

Both keep every gathered shard of the last layer of the forward (the lm_head) for its backward
(``keeps_weight``), which then sends gradient partials only, like FSDP2's root that is not resharded.
Every decision depends on the recorded order and byte counts only, never on timing, so all ranks request the same
steps in the same order. All of it lives here and in ``StepState``, so that ``reset()`` can drop it after a step
that raised.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .engine import Engine
from .gradients import GradBundle, Gradients, GradRing, Lands, Travel
from .group import FusedGroupState
from .layer_rings import Bundle, WeightRing, WeightRings
from .order import LayerOrder, unit_key
from .step import StepState


class FusedSchedule:
    """The fused schedule, elastic or lockstep (the Note above): which ring steps are requested beside each piece,
    which layers' rings are requested ahead, and when the lagging gradient rings land."""

    def __init__(self, engine: Engine, steps: StepState) -> None:
        self.engine, self.steps = engine, steps
        config = engine.config
        self.prefetch = config.prefetch_next and engine.ring.size > 1
        self.budget_auto = config.lookahead_mb == "auto"
        self.elastic = config.elastic(engine.ring.size)
        self.budget = 0 if self.budget_auto else int(float(config.lookahead_mb) * (1 << 20))
        self.defer_last_reduce = self.prefetch
        self.keep_last_weight = self.prefetch  # see keeps_weight
        self.dtype_hint: torch.dtype | None = None  # compute dtype under autocast, for the prefetched buffers
        self.order = LayerOrder()  # the fused groups in the forward order of the previous step
        self._ahead: dict[tuple[int, str], WeightRing] = {}
        self._kept: set[int] = set()  # groups of this step whose forward kept the gathered weight (keeps_weight)
        self.gradients = Gradients(engine)  # when each layer's gradient lands, and how
        self._paced: list[Bundle | GradBundle] = []  # chosen ahead, their steps requested piece by piece (pace)
        self._held = 0  # gathered weight bytes held while choosing ahead (_request_whole)
        self._chosen: dict[str, int] = {}  # per phase: the groups before this place were chosen ahead (or unwanted)
        self.rings = WeightRings(engine, self.elastic)  # each ring's buffers (CPU: reused)
        self._bundle_forward = False  # whether a unit's forward rings share steps (from the order: _units_of_order)

    @property
    def packs_params(self) -> bool:
        """Elastic: no gathered buffer is ever read as a whole with this rank's own rows in it."""
        return self.elastic

    def begin_step(self) -> None:
        if self.order.rotate():
            self._units_of_order()
        self._kept.clear()
        for ring in self._ahead.values():  # requested on every rank alike but not used (another path was taken)
            for pending in ring.pending.values():
                pending.wait()
            self.release(ring)
        self._ahead.clear()
        self._chosen = {}
        self._paced = []
        self.gradients.close_unit(None)

    def _units_of_order(self) -> None:
        """From the recorded order: whether the forward bundles a unit's rings, and the "auto" budget: two of the
        largest unit's gathered weights, what slicing per layer holds (the unit computed and the next one)."""
        unit_bytes: dict = {}
        for state in self.order.groups:
            unit_bytes[unit_key(state)] = unit_bytes.get(unit_key(state), 0) + self._gathered_bytes(state)
        if self.budget_auto:
            self.budget = 2 * max(unit_bytes.values())
        self._bundle_forward = self.engine.config.bundles_forward(self.engine.ring.size, len(unit_bytes))

    def end_backward(self) -> None:
        """The backward is done: the gradient rings still waiting to go are requested now, in order (the weight
        rings chosen ahead and not requested are dropped: no layer follows), and every landing completed."""
        self._pace_later(self.gradients.close_unit(None))
        for item in self._paced:
            if isinstance(item, GradBundle):
                item.request()
        self._paced = []
        self.gradients.finish_backward()

    def reset(self) -> None:
        """Drop everything of an aborted step: requested steps are waited for (every rank requested them alike)
        and their bytes dropped; the layer order is forgotten (the next step runs as a first step)."""
        rings = list(self._ahead.values())
        bundles = [b for b in self._paced if isinstance(b, GradBundle)]
        self._ahead.clear()
        self._paced = []
        for ring in rings:
            ring.settle()
        for bundle in bundles:
            bundle.settle()
        self.gradients.reset()
        self.order.forget()
        self._chosen = {}
        self._kept.clear()

    # -- one layer call's rings ------------------------------------------------------------------------------

    def weights(self, state: FusedGroupState, params, compute_dtype: torch.dtype, phase: str, keep: bool = False,
                recompute: bool = False) -> WeightRing:
        """The weight ring of one forward or backward of ``state``: the one requested ahead, or a new one. In
        elastic mode, the coming layers' rings are requested next (``_look_ahead``)."""
        ring = self._ahead.pop((id(state), phase), None) if not recompute else None
        if ring is None:
            ring = self.new_weights(state, params, compute_dtype, phase, keep)
            if self.elastic and not recompute:
                ring.request()
        elif self.elastic and ring.unrequested:  # chosen ahead, not all requested yet: its pieces need them now
            ring.request()
            self._paced.remove(ring.bundle)
        if ring.slots is not None and keep:
            self._kept.add(id(state))
        if self.elastic and not recompute:
            self._held = ring.nbytes + sum(ahead.nbytes for ahead in self._ahead.values())
            self._following(state, phase, self._request_whole)
        return ring

    def new_weights(self, state: FusedGroupState, params, compute_dtype: torch.dtype, phase: str,
                    keep: bool) -> WeightRing:
        op = self.steps.ring_op(state.op, phase) if self.engine.ring.size > 1 else None
        return self.rings.new(state, params, compute_dtype, op, keep)

    def release(self, weights: WeightRing) -> None:
        """``weights`` is done (every step it is part of was waited for): ``WeightRings.release``."""
        self.rings.release(weights)

    def grads(self, state: FusedGroupState, numel: int, reduce_dtype: torch.dtype, device: torch.device, zeroed: bool,
              communicates: bool, weights: WeightRing | None, accumulates: bool) -> GradRing:
        """The gradient ring of one backward of ``state`` ([Note: the gradient path]); it shares the ring op of
        ``weights`` (the same backward's weight ring) when that travels, as one ring operation of the layer. Its
        hops lag in elastic mode, else join the pieces' weight steps. ``accumulates``: the gradients may be put
        into ``.grad`` by us; then its last hop lands after the backward returns (``Lands.LATER``), with its
        unit's other rings where they share hops (``bundles_grads``)."""
        op, travel, lands = None, Travel.LOCAL, Lands.NOW
        if communicates and self.engine.ring.size > 1:
            op = weights.op if weights is not None and weights.op is not None else self.steps.ring_op(state.op,
                                                                                                      "backward")
            travel = Travel.LAGGING if self.elastic else Travel.WITH_PIECES
            if self.defer_last_reduce and accumulates:
                lands = Lands.LATER
                if self.bundles_grads(state):  # its hops go with its unit's other rings, beside the last group
                    travel = Travel.BUNDLED
        ring = self.gradients.ring(state, op, numel, reduce_dtype, device, zeroed, travel, lands)
        if travel is Travel.BUNDLED:
            self.gradients.join_unit(unit_key(state), ring)
        return ring

    def finish_grads(self, state: FusedGroupState, grads: GradRing, post: float, dtypes: tuple,
                     train: tuple) -> torch.Tensor | None:
        """At the end of a synced backward of ``state``, after its pieces: ``Gradients.finish``."""
        return self.gradients.finish(state, grads, post, dtypes, train)

    def pace(self, state: FusedGroupState, phase: str, pieces_left: int) -> None:
        """Elastic, beside each fused piece: request the next steps of the rings chosen ahead (weight bundles, and
        in the backward the previous unit's gradient bundle), spread over the pieces left in the running unit
        (``pieces_left`` of this group, with this one, and all of the unit's groups after it), so that they queue
        on the link between the pieces' own steps instead of all before them. By counts only."""
        if not self._paced:  # lockstep, or nothing chosen ahead
            return
        pieces_left += self.engine.ring.size * self.order.rest(state, phase)
        left = sum(item.unrequested for item in self._paced)
        quota = -(-left // max(pieces_left, 1))
        while quota and self._paced:
            quota -= self._paced[0].request(quota)
            if not self._paced[0].unrequested:
                self._paced.pop(0)

    # -- beside each compute piece -------------------------------------------------------------------------------

    def before_piece(self, state: FusedGroupState, phase: str, k: int, grads: GradRing | None = None) -> None:
        """Beside compute piece k of ``state`` (its own steps requested already, ``piece_steps``): a unit's gradient
        step (``unit_grads_step``), the steps of the rings chosen ahead (``pace``), and at the last piece the next
        layers' first steps (lockstep, ``start_next``)."""
        if grads is not None and grads.travel is Travel.BUNDLED:
            self.unit_grads_step(state, k)
        if self._paced:
            self.pace(state, phase, self.engine.ring.size - k)
        if k == self.engine.ring.size - 1:
            self.start_next(state, phase)

    def after_piece(self, state: FusedGroupState, phase: str, k: int) -> None:
        """After piece k's compute, before its wait: in the backward, the gradient rings of earlier layers that
        have landed (lockstep: the previous layer's last step, which had this first piece to land, waited for at
        k = 0)."""
        if phase == "backward":
            self.gradients.land(block=k == 0 and not self.elastic)

    # -- gradient rings by unit ---------------------------------------------------------------------------------

    def backward_begins(self, state: FusedGroupState) -> None:
        """A fused group's backward begins: a gradient bundle of another unit is complete, its steps paced from
        here on."""
        self._pace_later(self.gradients.close_unit(unit_key(state)))

    def _pace_later(self, bundle: GradBundle | None) -> None:
        if bundle is not None:
            self._paced.append(bundle)

    def bundles_grads(self, state: FusedGroupState) -> bool:
        """Whether ``state``'s gradient partials wait for its unit's gradient bundle (elastic, the order known,
        not the backward's last unit, whose partials go beside its own pieces so that the step ends with one hop
        at most)."""
        return self.elastic and bool(self.order) and unit_key(state) != self.order.last_unit

    def unit_grads_step(self, state: FusedGroupState, k: int) -> None:
        """Beside piece k (k ≥ 1) of the unit's last group in the backward (by the recorded order): request step k
        of the unit's gradient bundle; every group's partial k-1 is written by then. So a unit's gradients travel
        during its own last group, one ring for the unit, as early as their bytes exist."""
        if k and not self.order.rest(state, "backward"):
            self.gradients.unit_hop()

    # -- across layers ---------------------------------------------------------------------------------------

    def entered(self, state: FusedGroupState, needs_dx: bool) -> None:
        """A fused group's forward begins (records the order for the next step's prefetch)."""
        if self.prefetch:
            self.order.entered(state, needs_dx)

    def keeps_weight(self, state: FusedGroupState) -> bool:
        """Whether ``state``'s forward keeps every gathered weight shard for its own backward: the last fused group
        of the forward (the lm_head) when a backward follows. Its backward then sends gradient partials only, like
        FSDP2's root that is not resharded after forward; it holds the full weight from its forward to its
        backward (one layer's worth of memory, while the loss is computed)."""
        return self.keep_last_weight and self.order.is_last(state) and self.order.needs_dx(state)

    def start_next(self, state: FusedGroupState, phase: str) -> None:
        """Lockstep, beside a layer's last piece: request step 0 of the ``prefetch_depth`` groups that follow
        ``state`` in ``phase`` (if the order is known); a group already requested counts without requesting
        anything. After the last group of the forward, the backward's first groups follow when a backward can
        follow (the last group's input needed grad: not under ``no_grad``)."""
        if not self.prefetch or self.elastic:
            return
        self._following(state, phase, self._request_first)

    def start_first(self, phase: str) -> None:
        """Before the first fused group of a forward (from a ring embedding, once its own exchange is under way):
        request that group's first ring step and those of the following ones (elastic: their whole rings)."""
        if self.prefetch and phase == "forward" and not self.order.began and self.order:
            self._held = 0
            whole = lambda order, start, phase: self._request_whole(order, start, phase, split_first=True)  # noqa: E731
            self._following(None, phase, whole if self.elastic else self._request_first)
            for item in self._paced:  # no pieces run before the first group: the link takes them at once
                item.request()
            self._paced = []

    def _following(self, state: FusedGroupState | None, phase: str, request: Callable) -> None:
        """``request(order, start, phase)`` the groups after ``state`` (None: from the first) in the phase's order,
        and at the forward's last group the backward's from its first; nothing for a group not in the order."""
        order = self.order.phases.get(phase)
        if not order:
            return
        at = -1 if state is None else self.order.place(state, phase)
        if at is None:
            return
        if not request(order, at + 1, phase):
            return
        if phase == "forward" and at == len(order) - 1 and state is not None and self.order.needs_dx(state):
            request(self.order.phases["backward"], 0, "backward")

    def _wants(self, state: FusedGroupState, phase: str) -> bool:
        # a backward that sends no weight shards (no input gradient, or the forward kept them): nothing to request
        return phase == "forward" or (self.order.needs_dx(state) and id(state) not in self._kept)

    def _request_first(self, order, start: int, phase: str) -> bool:
        wanted = self.engine.config.prefetch_depth
        for at in range(start, len(order)):
            following = order[at]
            if not self._wants(following, phase):
                continue
            if wanted == 0:
                return False
            wanted -= 1
            key = (id(following), phase)
            if key not in self._ahead:
                ring = self._prepared(following, phase)
                sends, recvs = ring.io(0)
                ring.pending[0] = self.engine.link.step(sends, recvs, ring.op, 0, ring.world - 1)
                ring.requested = 1
                self._ahead[key] = ring
        return True

    def _request_whole(self, order, start: int, phase: str, split_first: bool = False) -> bool:
        """Choose the whole weight rings of the groups from ``order[start]`` on, in order, while the gathered
        weights held (``_held``: the running group's and those ahead) fit the budget, a unit's rings together
        (``Bundle``; in the forward only with ``_bundle_forward``, else each ring alone; before the first group,
        ``split_first``, that group's ring alone). False once one does not fit (nothing after it is chosen either:
        the link works in order). The groups before ``_chosen[phase]`` were chosen by an earlier call: each call
        goes on from there, so a step chooses in time linear in its groups."""
        together = phase == "backward" or self._bundle_forward
        run: list[FusedGroupState] = []
        for at in range(max(start, self._chosen.get(phase, 0)), len(order)):
            state = order[at]
            if not self._wants(state, phase):
                continue
            if run and together and not split_first and unit_key(run[-1]) == unit_key(state):
                run.append(state)
                continue
            if run:
                if not self._choose(run, phase):
                    return False
                self._chosen[phase], split_first = at, False
            run = [state]
        if run and not self._choose(run, phase):
            return False
        self._chosen[phase] = len(order)
        return True

    def _choose(self, run: list[FusedGroupState], phase: str) -> bool:
        """Choose the rings of ``run`` (one unit's groups, or one group) not chosen yet, if they fit the budget."""
        run = [state for state in run if (id(state), phase) not in self._ahead]
        nbytes = sum(self._gathered_bytes(state) for state in run)
        if self._held + nbytes > self.budget:
            return False
        rings = [self._prepared(state, phase) for state in run]
        for state, ring in zip(run, rings):
            self._ahead[(id(state), phase)] = ring
        if rings:
            self._paced.append(Bundle(rings))  # its steps are requested beside the coming pieces (pace)
        self._held += nbytes
        return True

    def _gathered_bytes(self, state: FusedGroupState) -> int:
        wire = state.wire_format("gather", self._dtype(state))
        row = wire.nbytes if wire is not None else state.layout.numel * self._dtype(state).itemsize
        return row * self.engine.ring.size

    def _dtype(self, state: FusedGroupState) -> torch.dtype:
        return self.dtype_hint or self.engine.compute_dtype(state.params()[0].dtype)  # as its layer will ask

    def _prepared(self, state: FusedGroupState, phase: str) -> WeightRing:
        keep = phase == "forward" and self.keeps_weight(state)
        return self.new_weights(state, state.local_params(), self._dtype(state), phase, keep)

