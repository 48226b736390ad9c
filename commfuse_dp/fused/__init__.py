"""Decomposed ops: the ring-fused linear (autograd Function), its modules and shared-input groups."""

from ..runtime.engine import Engine
from ..runtime.layout import GroupLayout, Member
from ..runtime.schedule import FusedSchedule
from ..runtime.slicing import SlicingScheduler
from ..runtime.step import StepState
from .linear import FusedRingLinearFn
from .modules import FusedGroup, attach_group, convert_linear, ring_class

__all__ = ["FusedGroup", "FusedRingLinearFn", "GroupLayout", "Member", "attach_group", "convert_linear",
           "ring_class", "step_state"]


def step_state(engine: Engine) -> StepState:
    """The step state of a sharded model, driving the schedule its config names: ``SlicingScheduler`` for
    ``"slicing"`` (whole layers, gathered one layer ahead), else ``FusedSchedule`` (hops beside the pieces).
    Every fused group computes with ``FusedRingLinearFn`` under either."""
    return StepState(engine, SlicingScheduler if engine.config.schedule == "slicing" else FusedSchedule)
