"""When the fused schedule requests its ring steps: the rings of one layer call (``WeightRing``, ``GradRing``), the
steps beside each compute piece (``FusedSchedule.piece_steps``) and what runs across layers.

[Note: across layers]  (the per-layer loops are in ``linear.py``; the link that works the requests: ``link.py``)
The forward order of the fused groups is recorded in each step and used by the next one (the first step, and the
first after a ``reset()``, run without looking ahead). Two ways to use it, one loop:

- *Lockstep* (``lookahead_mb=0``). A layer requests ring step k beside compute piece k and waits for it at the
  piece's end; in backward one step carries the weight shard and the gradient partial. Two weight-shard and two
  gradient-shard buffers are live. During a layer's last piece, step 0 of the next ``prefetch_depth`` layers is
  requested (``start_next``; ``start_first`` from a ring embedding); after the last layer of the forward the
  backward's first layers follow, so their weight shards land during the loss. A layer's last gradient step is
  waited after the next layer's first piece (``Landing``), or at the end of the backward.
- *Elastic* (``lookahead_mb`` > 0, default ``"auto"``). When a layer begins, the whole all-gather rings of the
  layers that follow it are chosen, in order, as long as their gathered weights fit in the budget; their steps
  are requested beside the layer's pieces, spread over them (``pace``), so they queue between its own gradient
  steps; the link runs them while compute works, so it idles less where compute has no ring step beside it. A layer's weight
  ring gathers into an ``(N, numel)`` buffer; piece k still starts as soon as shard k has landed, so the first
  layer's head stays fused. Gradient partials go into an ``(N, numel)`` buffer each and are requested beside the
  next piece, but not waited for: they lag behind the all-gathers queued before them and land during later
  compute (``Landing``, completed on the compute thread at piece boundaries and, at the latest, when the
  backward ends). So the step still ends with one exposed hop at most, as in lockstep.

Both keep every gathered shard of the last layer of the forward (the lm_head) for its backward
(``keeps_weight``), which then sends gradient partials only, like FSDP2's root that is not resharded.
Every decision depends on the recorded order and byte counts only, never on timing, so all ranks request the same
steps in the same order. All of it lives here and in ``StepState``, so that ``reset()`` can drop it after a step
that raised.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..engine import Engine, RingOp
from ..link import Pending

if TYPE_CHECKING:
    from .modules import FusedGroupState
    from .step import StepState


class WeightRing:
    """An all-gather ring over same-shape rows: piece k reads ``held(k)``, rank ``(r - k) mod N``'s row.
    ``slots``: ``(N, numel)`` where every row stays (its own row filled), or None for two alternating buffers
    ``pair`` (lockstep: the full weight never exists)."""

    def __init__(self, engine: Engine, op: RingOp | None, slots: torch.Tensor | None,
                 pair: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> None:
        self.engine, self.op, self.slots, self.pair = engine, op, slots, pair
        self.world = engine.ring.size
        self.pending: dict[int, Pending] = {}
        self.requested = 0  # steps requested so far

    def held(self, k: int) -> torch.Tensor:
        if self.slots is None:
            return self.pair[k % 2]
        return self.slots[self.engine.ring.shard_held(k)]

    def io(self, k: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """What step k sends and receives (the row held at piece k goes out; the next one comes in)."""
        return [self.held(k)], [self.held(k + 1)]

    def request(self, steps: int | None = None) -> int:
        """Request the next ``steps`` steps (default: all that are left); returns how many were requested."""
        left = self.world - 1 - self.requested
        count = left if steps is None else min(steps, left)
        for _ in range(count):
            k = self.requested
            sends, recvs = self.io(k)
            self.pending[k] = self.engine.link.step(sends, recvs, self.op, k, self.world - 1)
            self.requested += 1
        return count

    @property
    def unrequested(self) -> int:
        return self.world - 1 - self.requested

    @property
    def nbytes(self) -> int:
        return self.slots.numel() * self.slots.element_size() if self.slots is not None else 0

    def settle(self) -> None:
        for pending in self.pending.values():
            pending.settle()


class GradRing:
    """A reduce-scatter ring of gradient partials: piece k writes ``part(k)``, this rank's share of rank
    ``t = (r - k - 1) mod N``'s shard; step k (k ≥ 1) sends ``part(k-1)`` plus the partial sum received by step
    k-1 (added on the link, just before the step) and receives the next partial sum into ``racc``. After step
    N-1 lands, ``part(N-1) + racc`` is this rank's complete shard (``final``). ``lag``: one buffer per piece,
    so compute never waits for a step to free one; else two alternating buffers."""

    def __init__(self, engine: Engine, op: RingOp | None, numel: int, dtype: torch.dtype, device: torch.device,
                 zeroed: bool, communicates: bool, lag: bool) -> None:
        world = engine.ring.size
        alloc = torch.zeros if zeroed else torch.empty
        self.world, self.op, self.lag = world, op, lag and communicates
        self.parts = alloc(world if self.lag else min(world, 2), numel, dtype=dtype, device=device)
        self.racc = torch.empty(numel, dtype=dtype, device=device) if communicates and world > 1 else None
        self.last: Pending | None = None

    def part(self, k: int) -> torch.Tensor:
        return self.parts[k if self.lag else k % 2]

    def io(self, k: int) -> tuple[list[torch.Tensor], list[torch.Tensor], Callable[[], None] | None]:
        """What step k sends and receives, and what runs on the link before it (the add of the sum that step k-1
        received)."""
        out = self.part(k - 1)
        before = (lambda: out.add_(self.racc)) if k > 1 else None
        return [out], [self.racc], before

    def final(self) -> torch.Tensor:
        """This rank's complete shard, once step N-1 (``last``) landed and was waited for."""
        out = self.part(self.world - 1)
        if self.racc is not None:
            out.add_(self.racc)
        return out


def piece_steps(engine: Engine, k: int, weights: WeightRing | None, grads: GradRing | None) -> Pending | None:
    """Request what goes beside piece k and return what to wait for at its end (the step that brings the row
    of piece k+1, and in lockstep the gradient partial too). ``weights``/``grads``: None where that ring does
    not travel."""
    world, link = engine.ring.size, engine.link
    gather = weights is not None and weights.op is not None and k < world - 1
    reduce = grads is not None and grads.racc is not None and k > 0
    sends, recvs, before = [], [], None
    new_gather = gather and weights.requested <= k  # else requested ahead (the link may have run it already)
    if new_gather:
        sends, recvs = weights.io(k)
        weights.requested = k + 1
    if reduce:
        g_sends, g_recvs, before = grads.io(k)
        if grads.lag:  # its own step, not waited here: it lands during later compute
            grads.last = link.step(g_sends, g_recvs, grads.op, k, world - 1, before)
            before = None
        else:
            sends, recvs = sends + g_sends, recvs + g_recvs
    step = None
    if sends:
        op = weights.op if weights is not None and weights.op is not None else grads.op
        step = link.step(sends, recvs, op, k, world - 1, before)
        if new_gather:
            weights.pending[k] = step
        if reduce and not grads.lag:
            grads.last = step
    if gather:
        return weights.pending[k]
    return step


class Landing:
    """A fused layer's gradient ring whose last step was still in flight when its backward returned: ``complete()``
    (on the compute thread) adds the received sum, divides and puts the shard into the parameters' grads."""

    __slots__ = ("grads", "state", "post", "dtypes", "train")

    def __init__(self, grads: GradRing, state: FusedGroupState, post: float, dtypes: tuple, train: tuple) -> None:
        self.grads, self.state, self.post, self.dtypes, self.train = grads, state, post, dtypes, train

    def complete(self) -> None:
        self.grads.last.wait()
        final = self.grads.final()
        if self.post != 1.0:
            final.div_(self.post)
        self.state.accumulate_grads(final, self.dtypes, self.train)


class FusedSchedule:
    def __init__(self, engine: Engine, steps: StepState) -> None:
        self.engine, self.steps = engine, steps
        config = engine.config
        self.prefetch = config.prefetch_next and engine.ring.size > 1
        self.budget_auto = config.lookahead_mb == "auto"
        # At 2 ranks a ring has one step, so lockstep's prefetch already runs the coming layers' whole rings ahead
        # (prefetch_depth of them); "auto" keeps lockstep there, whose gradient partial rides its weight step.
        self.elastic = self.prefetch and config.lookahead_mb != 0 and not (self.budget_auto
                                                                           and engine.ring.size == 2)
        self.budget = 0 if self.budget_auto else int(float(config.lookahead_mb) * (1 << 20))
        self.defer_last_reduce = self.prefetch
        self.keep_last_weight = self.prefetch  # see keeps_weight
        self.dtype_hint: torch.dtype | None = None  # compute dtype under autocast, for the prefetched buffers
        self._order: list[FusedGroupState] = []  # fused groups in the forward order of the previous step
        self._current: list[FusedGroupState] = []
        self._ahead: dict[tuple[int, str], WeightRing] = {}
        self._needs_dx: dict[int, bool] = {}  # per group: does its backward send weight shards (input needs grad)?
        self._kept: set[int] = set()  # groups of this step whose forward kept the gathered weight (keeps_weight)
        self._landing: list[Landing] = []
        self._paced: list[WeightRing] = []  # rings chosen ahead whose steps are requested piece by piece (pace)

    def begin_step(self) -> None:
        if self._current:
            self._order, self._current = self._current, []
            if self.budget_auto:  # the largest layer's gathered weight (as the slicing schedule holds one ahead)
                self.budget = max(s.layout.numel * self.engine.ring.size * self._dtype(s).itemsize
                                  for s in self._order)
        self._kept.clear()
        for ring in self._ahead.values():  # requested on every rank alike but not used (another path was taken)
            for pending in ring.pending.values():
                pending.wait()
        self._ahead.clear()
        self._paced = []

    def end_backward(self) -> None:
        self.land(block=True)

    def reset(self) -> None:
        """Drop everything of an aborted step: requested steps are waited for (every rank requested them alike)
        and their bytes dropped; the layer order is forgotten (the next step runs as a first step)."""
        rings, landing = list(self._ahead.values()), self._landing
        self._ahead.clear()
        self._landing = []
        self._paced = []
        for ring in rings:
            ring.settle()
        for land in landing:
            land.grads.last.settle()
        self._order, self._current = [], []
        self._needs_dx.clear()
        self._kept.clear()

    # -- one layer call's rings ------------------------------------------------------------------------------

    def weights(self, state: FusedGroupState, params, cdt: torch.dtype, phase: str, keep: bool = False,
                recompute: bool = False) -> WeightRing:
        """The weight ring of one forward or backward of ``state``: the one requested ahead, or a new one. In
        elastic mode, the coming layers' rings are requested next (``_look_ahead``)."""
        ring = self._ahead.pop((id(state), phase), None) if not recompute else None
        if ring is None:
            ring = self.new_weights(state, params, cdt, phase, keep)
            if self.elastic and not recompute:
                ring.request()
        elif self.elastic and ring.unrequested:  # chosen ahead, not all requested yet: its pieces need them now
            ring.request()
            self._paced.remove(ring)
        if ring.slots is not None and keep:
            self.kept(state)
        if self.elastic and not recompute:
            self._look_ahead(state, phase)
        return ring

    def new_weights(self, state: FusedGroupState, params, cdt: torch.dtype, phase: str, keep: bool) -> WeightRing:
        layout, ring = state.layout, self.engine.ring
        op = self.steps.ring_op(state.op, phase) if ring.size > 1 else None
        if keep or (self.elastic and ring.size > 1):
            slots = torch.empty(ring.size, layout.numel, dtype=cdt, device=params[0].device)
            layout.pack(state.pairs(params), cdt, out=slots[ring.rank])
            return WeightRing(self.engine, op, slots)
        buf = layout.pack(state.pairs(params), cdt)
        return WeightRing(self.engine, op, None, (buf, torch.empty_like(buf) if ring.size > 1 else None))

    def grads(self, state: FusedGroupState, numel: int, rdt: torch.dtype, device: torch.device, zeroed: bool,
              communicates: bool, weights: WeightRing | None) -> GradRing:
        """The gradient ring of one backward of ``state``; it shares the ring op of ``weights`` (the same
        backward's weight ring) when that travels, as one ring operation of the layer."""
        op = None
        if communicates and self.engine.ring.size > 1:
            op = weights.op if weights is not None and weights.op is not None else self.steps.ring_op(state.op,
                                                                                                      "backward")
        return GradRing(self.engine, op, numel, rdt, device, zeroed, communicates, self.elastic)

    def pace(self, pieces_left: int) -> None:
        """Elastic, beside each fused piece: request the next steps of the rings chosen ahead, spread over the
        running group's pieces (``pieces_left`` with this one), so that they queue on the link between its own
        steps (the gradient partials requested beside the pieces) instead of all before them. By counts only."""
        if not self._paced:  # lockstep, or nothing chosen ahead
            return
        left = sum(ring.unrequested for ring in self._paced)
        quota = -(-left // max(pieces_left, 1))
        while quota and self._paced:
            quota -= self._paced[0].request(quota)
            if not self._paced[0].unrequested:
                self._paced.pop(0)

    # -- gradient rings that land later ------------------------------------------------------------------------

    def land_later(self, landing: Landing) -> None:
        self._landing.append(landing)

    def land(self, block: bool) -> None:
        """Complete the landings whose last step arrived (``block``: all of them, waiting), in request order."""
        while self._landing and (block or self._landing[0].grads.last.done()):
            self._landing.pop(0).complete()

    # -- across layers ---------------------------------------------------------------------------------------

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
        if self.prefetch and phase == "forward" and not self._current and self._order:
            self._following(None, phase, self._request_whole if self.elastic else self._request_first)
            for ring in self._paced:  # no pieces run before the first group: the link takes them at once
                ring.request()
            self._paced = []

    def _look_ahead(self, state: FusedGroupState, phase: str) -> None:
        self._following(state, phase, self._request_whole)

    def _following(self, state: FusedGroupState | None, phase: str, request: Callable) -> None:
        order = self._order if phase == "forward" else self._order[::-1]
        if state is None:
            at = -1
        else:
            try:
                at = order.index(state)
            except ValueError:
                return
        if not request(order[at + 1:], phase):
            return
        if phase == "forward" and at == len(order) - 1 and state is not None and self._needs_dx.get(id(state), False):
            request(order[::-1], "backward")

    def _wanted(self, groups, phase: str):
        for following in groups:
            if phase == "backward" and (not self._needs_dx.get(id(following), False) or id(following) in self._kept):
                continue  # its backward sends no weight shards: nothing to request early
            yield following

    def _request_first(self, groups, phase: str) -> bool:
        wanted = self.engine.config.prefetch_depth
        for following in self._wanted(groups, phase):
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

    def _request_whole(self, groups, phase: str) -> bool:
        """Request the whole weight rings of ``groups`` in order while their gathered weights fit the budget;
        False once one does not (nothing after it is requested either: the link works in order)."""
        ahead = sum(ring.nbytes for ring in self._ahead.values())
        for following in self._wanted(groups, phase):
            key = (id(following), phase)
            if key in self._ahead:
                continue
            nbytes = following.layout.numel * self.engine.ring.size * self._dtype(following).itemsize
            if ahead + nbytes > self.budget:
                return False
            ring = self._prepared(following, phase)
            self._paced.append(ring)  # its steps are requested beside the coming pieces (pace)
            ahead += nbytes
            self._ahead[key] = ring
        return True

    def _dtype(self, state: FusedGroupState) -> torch.dtype:
        return self.dtype_hint or self.engine.compute_dtype(state.params()[0].dtype)  # as its layer will ask

    def _prepared(self, state: FusedGroupState, phase: str) -> WeightRing:
        keep = phase == "forward" and self.keeps_weight(state)
        return self.new_weights(state, state.local_params(), self._dtype(state), phase, keep)
