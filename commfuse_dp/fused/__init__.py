"""Decomposed ops: the ring-fused linear (autograd Function), its modules and shared-input groups."""

from ..runtime.layout import GroupLayout, Member
from .linear import FusedRingLinearFn
from .modules import FusedGroup, attach_group, convert_linear, ring_class

__all__ = ["FusedGroup", "FusedRingLinearFn", "GroupLayout", "Member", "attach_group", "convert_linear",
           "ring_class"]
