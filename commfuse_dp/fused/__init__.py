"""Decomposed ops: the ring-fused linear (autograd Function), its modules and shared-input groups."""

from ..runtime.engine import Engine
from ..runtime.layout import GroupLayout, Member
from ..runtime.schedule import FusedSchedule
from ..runtime.slicing import SlicingScheduler
from ..runtime.step import StepState
from .linear import FusedRingLinearFn
from .modules import FusedGroup, attach_group, convert_linear, ring_class
from .sliced import SlicedLinearFn

__all__ = ["FusedGroup", "FusedRingLinearFn", "GroupLayout", "Member", "attach_group", "compute_for",
           "convert_linear", "ring_class"]


def compute_for(engine: Engine) -> tuple[StepState, type]:
    """The step state of a sharded model, driving the schedule its config names, and the autograd Function its
    fused groups compute with under that schedule: ``SlicingScheduler`` with ``SlicedLinearFn`` (whole layers,
    gathered one layer ahead) for ``"slicing"``, else ``FusedSchedule`` with ``FusedRingLinearFn`` (pieces beside
    ring steps)."""
    if engine.config.schedule == "slicing":
        return StepState(engine, SlicingScheduler), SlicedLinearFn
    return StepState(engine, FusedSchedule), FusedRingLinearFn
