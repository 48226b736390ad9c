"""``Lookahead``: which weight rings the fused schedule requests before their layers, and when their hops go.

- *Elastic*: when a group begins, the whole rings of the groups that follow it in the recorded order are chosen,
  unit by unit, while the gathered weights held fit the budget (``lookahead_mb``; "auto": two of the largest
  unit's); their hops are paced over the running unit's pieces (``pace``), in one queue with the gradient bundles
  of units whose backward ended (``GradBundle``), whose order is the order of the requests.
- *Lockstep*: beside a layer's last piece, hop 0 of the next ``prefetch_depth`` groups (``start_next``).
- Before the first group of a forward (from a ring embedding), the first groups' rings (``start_first``).
Decided by the recorded order and byte counts only ([Note: across layers], ``schedule.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch

from .gradients import GradBundle
from .group import FusedGroupState
from .layer_rings import Bundle, WeightRing
from .order import unit_key


class Paced(Protocol):
    """Rings whose hops are requested piece by piece (``PacedQueue``): a unit's weight rings chosen ahead
    (``layer_rings.Bundle``) or its gradient rings (``gradients.GradBundle``)."""

    completes: bool  # its hops left are requested when the backward ends (gradients), else dropped (weights)

    @property
    def unrequested(self) -> int: ...

    def request(self, hops: int | None = None) -> int: ...

    def settle(self) -> None: ...


class PacedQueue:
    """The link's queue of hops still to request beside the coming pieces, in the order they were chosen (the
    order every rank requests them in): weight bundles chosen ahead and the gradient bundles of units whose
    backward ended, in one FIFO because the link works one request after the other."""

    def __init__(self) -> None:
        self._items: list[Paced] = []

    def __bool__(self) -> bool:
        return bool(self._items)

    def add(self, item: Paced) -> None:
        self._items.append(item)

    def remove(self, item: Paced) -> None:
        """``item``'s layer began before all of its hops were paced: the layer requests the rest itself."""
        self._items.remove(item)

    def unrequested(self) -> int:
        return sum(item.unrequested for item in self._items)

    def request(self, quota: int) -> None:
        """Request up to ``quota`` hops from the head of the queue on."""
        while quota and self._items:
            quota -= self._items[0].request(quota)
            if not self._items[0].unrequested:
                self._items.pop(0)

    def request_all(self) -> None:
        for item in self._items:
            item.request()
        self._items = []

    def end_backward(self) -> None:
        """No piece follows: what completes (gradient bundles) is requested now, in order; the rest is dropped."""
        for item in self._items:
            if item.completes:
                item.request()
        self._items = []

    def drop(self) -> list[Paced]:
        """Empty the queue, returning what was in it."""
        items, self._items = self._items, []
        return items


class Reach(NamedTuple):
    """How far one look at the coming groups reaches (``Lookahead._whole``/``_first``), before anything is requested."""

    runs: list[list[FusedGroupState]]  # in order: a unit's groups together (bundled rings), or one group each
    whole: bool  # every hop of their rings (elastic), or hop 0 only (lockstep)
    resume_at: int | None  # elastic: the next look in this phase goes on from this place (None: where it was)
    complete: bool  # the phase's groups were looked at to its end (the next phase's may follow)


class Lookahead:
    """The rings requested ahead of their layers for the fused schedule ``sched`` (its order, its ring buffers,
    its config), and the queue of hops paced over the pieces."""

    def __init__(self, sched) -> None:
        self.sched, self.engine, self.order = sched, sched.engine, sched.order
        config = self.engine.config
        self.prefetch, self.elastic = sched.prefetch, sched.elastic
        self.budget_auto = config.lookahead_mb == "auto"
        self.budget = 0 if self.budget_auto else int(float(config.lookahead_mb) * (1 << 20))
        self.bundle_forward = False  # whether a unit's forward rings share hops (from the order: ``plan``)
        self.ahead: dict[tuple[FusedGroupState, str], WeightRing] = {}
        self.paced = PacedQueue()  # chosen ahead, their hops requested piece by piece (pace)
        self.held = 0  # gathered weight bytes held: the running group's and those chosen ahead (elastic)
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
        self.paced.drop()

    def end_backward(self) -> None:
        """The gradient bundles still waiting are requested now, in order; weight rings chosen ahead and not
        requested are dropped (no layer follows)."""
        self.paced.end_backward()

    def reset(self) -> None:
        """An aborted step: requested hops are waited for (every rank requested them alike) and dropped."""
        rings = list(self.ahead.values())
        self.ahead.clear()
        for item in [*rings, *self.paced.drop()]:
            item.settle()
        self.chosen = {}
        self.kept.clear()

    # -- a layer's ring --------------------------------------------------------------------------------------

    def take(self, state: FusedGroupState, phase: str) -> WeightRing | None:
        """The ring of ``state`` in ``phase`` requested ahead, if any (no longer ahead once taken); one whose
        hops were not all paced yet leaves the queue: its layer requests them now."""
        ring = self.ahead.pop((state, phase), None)
        if ring is not None and ring.unrequested and ring.bundle is not None:
            self.paced.remove(ring.bundle)
        return ring

    def keeps(self, state: FusedGroupState) -> None:
        """``state``'s forward keeps its gathered weight: its backward sends no weight shards (``_wants``)."""
        self.kept.add(state)

    def entering(self, state: FusedGroupState, phase: str, ring: WeightRing) -> None:
        """Elastic: ``state``'s ring is in use; the rings of the groups after it are chosen while they fit."""
        self.held = ring.nbytes + sum(ahead.nbytes for ahead in self.ahead.values())
        self._following(state, phase, self._whole)

    def pace_later(self, bundle: GradBundle | None) -> None:
        """A unit's gradient bundle whose hops left are paced over the next pieces, after what is queued."""
        if bundle is not None:
            self.paced.add(bundle)

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
        """Elastic, beside each fused piece: request the next hops of the rings chosen ahead (weight bundles, and
        in the backward the previous unit's gradient bundle), spread over the pieces left in the running unit
        (``pieces_left`` of this group, with this one, and all of the unit's groups after it), so that they queue
        on the link between the pieces' own hops instead of all before them. By counts only."""
        if not self.paced:  # lockstep, or nothing chosen ahead
            return
        pieces_left += self.engine.ring.size * self.order.rest(state, phase)
        self.paced.request(-(-self.paced.unrequested() // max(pieces_left, 1)))

    def start_next(self, state: FusedGroupState, phase: str) -> None:
        """Lockstep, beside a layer's last piece: request hop 0 of the ``prefetch_depth`` groups that follow
        ``state`` in ``phase`` (if the order is known); a group already requested counts without requesting
        anything. After the last group of the forward, the backward's first groups follow when a backward can
        follow (the last group's input needed grad: not under ``no_grad``)."""
        if not self.prefetch or self.elastic:
            return
        self._following(state, phase, self._first)

    def start_first(self, phase: str) -> None:
        """Before the first fused group of a forward (from a ring embedding, once its own exchange is under way):
        request that group's first hop and those of the following ones (elastic: their whole rings)."""
        if self.prefetch and phase == "forward" and not self.order.began and self.order:
            self.held = 0
            whole = lambda order, start, phase: self._whole(order, start, phase, split_first=True)  # noqa: E731
            self._following(None, phase, whole if self.elastic else self._first)
            self.paced.request_all()  # no pieces run before the first group: the link takes them at once

    # -- choosing, then requesting ---------------------------------------------------------------------------

    def _following(self, state: FusedGroupState | None, phase: str, choose: Callable[..., Reach]) -> None:
        """Take ``choose(order, start, phase)`` for the groups after ``state`` (None: from the first) in the phase's
        order, and at the forward's last group, when that look went to the end, the backward's from its first;
        nothing for a group not in the order."""
        order = self.order.phases.get(phase)
        if not order:
            return
        at = -1 if state is None else self.order.place(state, phase)
        if at is None:
            return
        reach = choose(order, at + 1, phase)
        self._take(reach, phase)
        if reach.complete and phase == "forward" and at == len(order) - 1 and state is not None \
                and self.order.needs_dx(state):
            self._take(choose(self.order.phases["backward"], 0, "backward"), "backward")

    def _take(self, reach: Reach, phase: str) -> None:
        """Request what ``reach`` holds: whole rings go to the paced queue (a unit's together as one ``Bundle``,
        their hops beside the coming pieces); lockstep's hop 0 is requested now."""
        for run in reach.runs:
            rings = [self._prepared(state, phase) for state in run]
            for state, ring in zip(run, rings):
                self.ahead[(state, phase)] = ring
            if reach.whole:
                self.held += sum(self._gathered_bytes(state) for state in run)
                self.paced.add(Bundle(rings))
            else:
                for ring in rings:
                    sends, recvs = ring.io(0)
                    ring.pending[0] = self.engine.link.hop(sends, recvs, ring.op, 0, ring.world - 1)
                    ring.requested = 1
        if reach.resume_at is not None:
            self.chosen[phase] = reach.resume_at

    def _wants(self, state: FusedGroupState, phase: str) -> bool:
        # a backward that sends no weight shards (no input gradient, or the forward kept them): nothing to request
        return phase == "forward" or (self.order.needs_dx(state) and state not in self.kept)

    def _first(self, order, start: int, phase: str) -> Reach:
        """Lockstep: the next ``prefetch_depth`` wanted groups from ``order[start]`` on, those not requested yet
        (a group requested already counts); complete if the order ended first."""
        wanted, runs = self.engine.config.prefetch_depth, []
        for at in range(start, len(order)):
            following = order[at]
            if not self._wants(following, phase):
                continue
            if wanted == 0:
                return Reach(runs, False, None, False)
            wanted -= 1
            if (following, phase) not in self.ahead:
                runs.append([following])
        return Reach(runs, False, None, True)

    def _whole(self, order, start: int, phase: str, split_first: bool = False) -> Reach:
        """Elastic: the whole weight rings of the groups from ``order[start]`` on, in order, while the gathered
        weights held (``held``: the running group's and those ahead) fit the budget, a unit's rings together (in
        the forward only with ``bundle_forward``, else each ring alone; before the first group, ``split_first``,
        that group's ring alone). Stops at the first run that does not fit (nothing after it either: the link
        works in order). The groups before ``chosen[phase]`` were chosen by an earlier look, which this one goes
        on from, so a step chooses in time linear in its groups."""
        together = phase == "backward" or self.bundle_forward
        runs, held, fitted = [], self.held, 0
        for at, run in self._runs(order, max(start, self.chosen.get(phase, 0)), phase, together, split_first):
            run = [state for state in run if (state, phase) not in self.ahead]  # (all of it ahead: fits, adds none)
            held += sum(self._gathered_bytes(state) for state in run)
            if held > self.budget:
                return Reach(runs, True, at if fitted else None, False)
            fitted += 1
            if run:
                runs.append(run)
        return Reach(runs, True, len(order), True)

    def _runs(self, order, begin: int, phase: str, together: bool, split_first: bool):
        """The wanted groups from ``order[begin]`` on as (place of the first, groups): a unit's together when
        ``together`` (but the very first group alone when ``split_first``), else one group each."""
        run: list[FusedGroupState] = []
        run_at = begin
        for at in range(begin, len(order)):
            state = order[at]
            if not self._wants(state, phase):
                continue
            if run and together and not split_first and unit_key(run[-1]) == unit_key(state):
                run.append(state)
                continue
            if run:
                yield run_at, run
                split_first = False
            run, run_at = [state], at
        if run:
            yield run_at, run

    def _gathered_bytes(self, state: FusedGroupState) -> int:
        wire = state.wire_format("gather", self._dtype(state))
        row = wire.nbytes if wire is not None else state.layout.numel * self._dtype(state).itemsize
        return row * self.engine.ring.size

    def _dtype(self, state: FusedGroupState) -> torch.dtype:
        return self.sched.dtype_hint or self.engine.compute_dtype(state.params()[0].dtype)  # as its layer will ask

    def _prepared(self, state: FusedGroupState, phase: str) -> WeightRing:
        keep = phase == "forward" and self.sched.keeps_weight(state)
        return self.sched.new_weights(state, state.local_params(), self._dtype(state), phase, keep)
