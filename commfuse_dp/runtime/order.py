"""``LayerOrder``: the fused groups in the forward order that the previous step recorded, and what the fused
schedule asks of it (each group's place in a phase's order, the groups after it in its unit, the backward's last
unit). The forward order is recorded as groups enter; the backward's is its reverse."""

from __future__ import annotations

from .group import FusedGroupState

def unit_key(state: FusedGroupState):
    """The unit whose groups share hops: the innermost FSDP2 unit around the group (``shard()`` sets
    ``state.unit``), or the group alone."""
    return state.unit if state.unit is not None else ("group", id(state))


class LayerOrder:
    """The previous step's forward order of fused groups (``groups``; empty on a first step and after
    ``forget``) and, per phase, each group's place in it and how many groups of its unit follow it there."""

    def __init__(self) -> None:
        self.groups: list[FusedGroupState] = []
        self.phases: dict[str, list[FusedGroupState]] = {}  # the order of each phase (the backward's reversed)
        self.last_unit = None  # the backward's last unit (the forward's first)
        self._current: list[FusedGroupState] = []  # this step's, recorded as groups enter
        self._needs_dx: dict[FusedGroupState, bool] = {}  # does its backward need its input's gradient?
        self._place: dict[str, dict[FusedGroupState, int]] = {}
        self._rest: dict[str, dict[FusedGroupState, int]] = {}

    def __bool__(self) -> bool:
        return bool(self.groups)

    @property
    def began(self) -> bool:
        """Whether a group of this step has entered already."""
        return bool(self._current)

    def entered(self, state: FusedGroupState, needs_dx: bool) -> None:
        self._current.append(state)
        self._needs_dx[state] = needs_dx

    def needs_dx(self, state: FusedGroupState) -> bool:
        return self._needs_dx.get(state, False)

    def rotate(self) -> bool:
        """A new step: the order this step recorded becomes the one to follow. False if it recorded none."""
        if not self._current:
            return False
        self.groups, self._current = self._current, []
        self.phases = {"forward": self.groups, "backward": self.groups[::-1]}
        self.last_unit = unit_key(self.groups[0])
        self._place = {phase: {state: at for at, state in enumerate(order)} for phase, order in self.phases.items()}
        self._rest = {}
        for phase, order in self.phases.items():
            rest, after = {}, 0
            for at in range(len(order) - 1, -1, -1):
                same = at + 1 < len(order) and unit_key(order[at + 1]) == unit_key(order[at])
                after = after + 1 if same else 0
                rest[order[at]] = after
            self._rest[phase] = rest
        return True

    def forget(self) -> None:
        """An aborted step: the next step runs as a first step."""
        self.groups, self._current, self.phases, self._place, self._rest = [], [], {}, {}, {}
        self._needs_dx.clear()

    def place(self, state: FusedGroupState, phase: str) -> int | None:
        """``state``'s index in ``phase``'s order (None: not in it)."""
        return self._place.get(phase, {}).get(state)

    def rest(self, state: FusedGroupState, phase: str) -> int:
        """The groups of ``state``'s unit that follow it in ``phase``'s order."""
        return self._rest.get(phase, {}).get(state, 0)

    def is_last(self, state: FusedGroupState) -> bool:
        """Whether ``state`` is the last group of the forward."""
        return bool(self.groups) and self.groups[-1] is state
