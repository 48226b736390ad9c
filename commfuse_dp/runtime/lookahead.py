"""``Lookahead``: which weight rings the fused schedule requests before their layers, and when their steps go.

- *Elastic*: when a group begins, the whole rings of the groups that follow it in the recorded order are chosen,
  unit by unit, while the gathered weights held fit the budget (``lookahead_mb``; "auto": two of the largest
  unit's); their steps are paced over the running unit's pieces (``pace``), in one queue with the gradient bundles
  of units whose backward ended (``GradBundle``), whose order is the order of the requests.
- *Lockstep*: beside a layer's last piece, step 0 of the next ``prefetch_depth`` groups (``start_next``).
- Before the first group of a forward (from a ring embedding), the first groups' rings (``start_first``).
Decided by the recorded order and byte counts only ([Note: across layers], ``schedule.py``)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .gradients import GradBundle
from .group import FusedGroupState
from .layer_rings import Bundle, WeightRing
from .order import unit_key


class Lookahead:
    """The rings requested ahead of their layers for the fused schedule ``sched`` (its order, its ring buffers,
    its config), and the queue of ring steps paced over the pieces."""

    def __init__(self, sched) -> None:
        self.sched, self.engine, self.order = sched, sched.engine, sched.order
        config = self.engine.config
        self.prefetch, self.elastic = sched.prefetch, sched.elastic
        self.budget_auto = config.lookahead_mb == "auto"
        self.budget = 0 if self.budget_auto else int(float(config.lookahead_mb) * (1 << 20))
        self.bundle_forward = False  # whether a unit's forward rings share steps (from the order: ``plan``)
        self.ahead: dict[tuple[FusedGroupState, str], WeightRing] = {}
        self.paced: list[Bundle | GradBundle] = []  # chosen ahead, their steps requested piece by piece (pace)
        self.held = 0  # gathered weight bytes held while choosing ahead (_request_whole)
        self.chosen: dict[str, int] = {}  # per phase: the groups before this place were chosen ahead (or unwanted)
        self.kept: set[FusedGroupState] = set()  # groups of this step whose forward kept the gathered weight

    # -- the step's edges ----------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """Rings requested on every rank alike but not used (another path was taken) are waited for and dropped."""
        self.kept.clear()
        for ring in self.ahead.values():
            for pending in ring.pending.values():
                pending.wait()
            self.sched.release(ring)
        self.ahead.clear()
        self.chosen = {}
        self.paced = []

    def end_backward(self) -> None:
        """The gradient bundles still waiting are requested now, in order; weight rings chosen ahead and not
        requested are dropped (no layer follows)."""
        for item in self.paced:
            if isinstance(item, GradBundle):
                item.request()
        self.paced = []

    def reset(self) -> None:
        """An aborted step: requested steps are waited for (every rank requested them alike) and dropped."""
        rings = list(self.ahead.values())
        bundles = [b for b in self.paced if isinstance(b, GradBundle)]
        self.ahead.clear()
        self.paced = []
        for ring in rings:
            ring.settle()
        for bundle in bundles:
            bundle.settle()
        self.chosen = {}
        self.kept.clear()

    # -- a layer's ring --------------------------------------------------------------------------------------

    def take(self, state: FusedGroupState, phase: str) -> WeightRing | None:
        """The ring of ``state`` in ``phase`` requested ahead, if any (no longer ahead once taken)."""
        return self.ahead.pop((state, phase), None)

    def entering(self, state: FusedGroupState, phase: str, ring: WeightRing) -> None:
        """Elastic: ``state``'s ring is in use; the rings of the groups after it are chosen while they fit."""
        self.held = ring.nbytes + sum(ahead.nbytes for ahead in self.ahead.values())
        self._following(state, phase, self._request_whole)

    def pace_later(self, bundle: GradBundle | None) -> None:
        """A unit's gradient bundle whose hops left are paced over the next pieces, after what is queued."""
        if bundle is not None:
            self.paced.append(bundle)

    def plan(self) -> None:
        """From the recorded order: whether the forward bundles a unit's rings, and the "auto" budget: two of the
        largest unit's gathered weights, what slicing per layer holds (the unit computed and the next one)."""
        unit_bytes: dict = {}
        for state in self.order.groups:
            unit_bytes[unit_key(state)] = unit_bytes.get(unit_key(state), 0) + self._gathered_bytes(state)
        if self.budget_auto:
            self.budget = 2 * max(unit_bytes.values())
        self.bundle_forward = self.engine.config.bundles_forward(self.engine.ring.size, len(unit_bytes))

    def pace(self, state: FusedGroupState, phase: str, pieces_left: int) -> None:
        """Elastic, beside each fused piece: request the next steps of the rings chosen ahead (weight bundles, and
        in the backward the previous unit's gradient bundle), spread over the pieces left in the running unit
        (``pieces_left`` of this group, with this one, and all of the unit's groups after it), so that they queue
        on the link between the pieces' own steps instead of all before them. By counts only."""
        if not self.paced:  # lockstep, or nothing chosen ahead
            return
        pieces_left += self.engine.ring.size * self.order.rest(state, phase)
        left = sum(item.unrequested for item in self.paced)
        quota = -(-left // max(pieces_left, 1))
        while quota and self.paced:
            quota -= self.paced[0].request(quota)
            if not self.paced[0].unrequested:
                self.paced.pop(0)

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
            self.held = 0
            whole = lambda order, start, phase: self._request_whole(order, start, phase, split_first=True)  # noqa: E731
            self._following(None, phase, whole if self.elastic else self._request_first)
            for item in self.paced:  # no pieces run before the first group: the link takes them at once
                item.request()
            self.paced = []

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
        return phase == "forward" or (self.order.needs_dx(state) and state not in self.kept)

    def _request_first(self, order, start: int, phase: str) -> bool:
        wanted = self.engine.config.prefetch_depth
        for at in range(start, len(order)):
            following = order[at]
            if not self._wants(following, phase):
                continue
            if wanted == 0:
                return False
            wanted -= 1
            key = (following, phase)
            if key not in self.ahead:
                ring = self._prepared(following, phase)
                sends, recvs = ring.io(0)
                ring.pending[0] = self.engine.link.step(sends, recvs, ring.op, 0, ring.world - 1)
                ring.requested = 1
                self.ahead[key] = ring
        return True

    def _request_whole(self, order, start: int, phase: str, split_first: bool = False) -> bool:
        """Choose the whole weight rings of the groups from ``order[start]`` on, in order, while the gathered
        weights held (``_held``: the running group's and those ahead) fit the budget, a unit's rings together
        (``Bundle``; in the forward only with ``_bundle_forward``, else each ring alone; before the first group,
        ``split_first``, that group's ring alone). False once one does not fit (nothing after it is chosen either:
        the link works in order). The groups before ``_chosen[phase]`` were chosen by an earlier call: each call
        goes on from there, so a step chooses in time linear in its groups."""
        together = phase == "backward" or self.bundle_forward
        run: list[FusedGroupState] = []
        for at in range(max(start, self.chosen.get(phase, 0)), len(order)):
            state = order[at]
            if not self._wants(state, phase):
                continue
            if run and together and not split_first and unit_key(run[-1]) == unit_key(state):
                run.append(state)
                continue
            if run:
                if not self._choose(run, phase):
                    return False
                self.chosen[phase], split_first = at, False
            run = [state]
        if run and not self._choose(run, phase):
            return False
        self.chosen[phase] = len(order)
        return True

    def _choose(self, run: list[FusedGroupState], phase: str) -> bool:
        """Choose the rings of ``run`` (one unit's groups, or one group) not chosen yet, if they fit the budget."""
        run = [state for state in run if (state, phase) not in self.ahead]
        nbytes = sum(self._gathered_bytes(state) for state in run)
        if self.held + nbytes > self.budget:
            return False
        rings = [self._prepared(state, phase) for state in run]
        for state, ring in zip(run, rings):
            self.ahead[(state, phase)] = ring
        if rings:
            self.paced.append(Bundle(rings))  # its steps are requested beside the coming pieces (pace)
        self.held += nbytes
        return True

    def _gathered_bytes(self, state: FusedGroupState) -> int:
        wire = state.wire_format("gather", self._dtype(state))
        row = wire.nbytes if wire is not None else state.layout.numel * self._dtype(state).itemsize
        return row * self.engine.ring.size

    def _dtype(self, state: FusedGroupState) -> torch.dtype:
        return self.sched.dtype_hint or self.engine.compute_dtype(state.params()[0].dtype)  # as its layer will ask

    def _prepared(self, state: FusedGroupState, phase: str) -> WeightRing:
        keep = phase == "forward" and self.sched.keeps_weight(state)
        return self.sched.new_weights(state, state.local_params(), self._dtype(state), phase, keep)
