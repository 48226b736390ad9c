"""Per-step timing: compute, communication and exposed communication, per rank.

A *step* runs from one forward of the sharded root module to the next (gradient accumulation's micro-batches
count as separate steps). Exposed communication is host time spent blocked on the ring: waiting for a ring step
that the compute piece beside it did not cover, or running a synchronous bucketed collective. Communication is the
time from each ring step's start to the end of its wait (an upper bound of the wire time). Compute is the rest of
the step's wall time. Recording costs two ``perf_counter`` calls per ring step; ``CommFuseConfig(stats=False)``
turns it off.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class StepStats:
    """One step of one rank. Times in seconds."""

    step: int
    wall_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    ring_steps: int

    def as_dict(self) -> dict:
        return asdict(self)


class StatsRecorder:
    __slots__ = ("enabled", "step", "start", "end", "comm", "exposed", "ring_steps", "last")

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.step = -1
        self.start = self.end = 0.0
        self.comm = self.exposed = 0.0
        self.ring_steps = 0
        self.last: StepStats | None = None

    def begin_step(self) -> None:
        if not self.enabled:
            return
        if self.step >= 0:
            self.last = self.current()
        self.step += 1
        self.start = self.end = time.perf_counter()
        self.comm = self.exposed = 0.0
        self.ring_steps = 0

    def ring_step(self, started: float, wait_began: float, ended: float) -> None:
        """A ring step that started at ``started`` and whose wait ran from ``wait_began`` to ``ended``."""
        self.comm += ended - started
        self.exposed += ended - wait_began
        self.ring_steps += 1
        self.end = ended

    def blocking(self, began: float, ended: float) -> None:
        """A synchronous collective: all of it is exposed."""
        self.comm += ended - began
        self.exposed += ended - began
        self.end = ended

    def mark(self) -> None:
        self.end = time.perf_counter()

    def current(self) -> StepStats:
        wall = max(self.end - self.start, 0.0)
        return StepStats(step=self.step, wall_s=wall, compute_s=max(wall - self.exposed, 0.0), comm_s=self.comm,
                         exposed_comm_s=self.exposed, ring_steps=self.ring_steps)
