"""Per-step timing: compute, communication and exposed communication, per rank.

A *step* runs from one forward of the sharded root module to the next (gradient accumulation's micro-batches
count as separate steps). Exposed communication is the time compute spent waiting on the rings: for a hop (one
exchange with the ring's neighbours) that the compute piece beside it did not cover, for an asynchronous bucketed
collective (FSDP2 units, the slicing schedule), or running a synchronous one; on CPU the host's, on CUDA the
compute stream's, measured by CUDA events. Communication is the time from each hop's request to the end of its
wait (an upper bound of the wire time). Compute is the rest of the step's wall time. Every wait is recorded in one
place, ``Pending.wait`` (``ring/issue.py``), the fused layers' and the collectives' alike (HSDP's replica sums,
waited for on the replicate ring's thread or stream, are not). Recording costs two ``perf_counter`` calls per wait;
``CommFuseConfig(stats=False)`` turns it off.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True, slots=True)
class StepStats:
    """One step of one rank. Times in seconds."""

    step: int
    wall_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    hops: int
    """Hops waited for in the step (a bucketed collective counts all of its hops)."""
    skipped_steps: int = 0
    """Steps whose non-finite gradients were dropped (``CommFuseConfig.nonfinite_grads="skip"``) since
    ``shard()``, up to and including this one."""
    sent_bytes: int = 0
    """Bytes this rank put on the wire in the step's hops (in the formats they travelled in: narrow
    formats count their encoded bytes, scales included)."""

    @property
    def ring_steps(self) -> int:
        """Deprecated alias of ``hops``."""
        warnings.warn("StepStats.ring_steps is now StepStats.hops", DeprecationWarning, stacklevel=2)
        return self.hops

    def as_dict(self) -> dict:
        return asdict(self)


class StatsRecorder:
    __slots__ = ("enabled", "step", "start", "end", "comm", "exposed", "hops", "_last", "skipped", "cuda_waits",
                 "sent_bytes")

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.step = -1
        self.start = self.end = 0.0
        self.comm = self.exposed = 0.0
        self.hops = 0
        self.sent_bytes = 0
        self.skipped = 0  # steps whose gradients were dropped as non-finite (counted even with stats off)
        # the last finished step: StepStats, or (StepStats without its CUDA waits, those waits) until read
        self._last: StepStats | tuple[StepStats, list] | None = None
        self.cuda_waits: list = []  # (event, event) pairs around the compute stream's waits on hops

    @property
    def last(self) -> StepStats | None:
        """The last finished step. On CUDA its waits are timed by events that the device may not have reached
        when the next step began (the host runs ahead): they are read here, when asked for, waiting for them
        (a host synchronisation at the caller's request, never inside a step)."""
        if isinstance(self._last, tuple):
            stats, waits = self._last
            self._last = _with_waits(stats, waits)
        return self._last

    def begin_step(self) -> None:
        if not self.enabled:
            return
        if self.step >= 0:
            waits, self.cuda_waits = self.cuda_waits, []
            self._last = (self.current(), waits) if waits else self.current()
        self.step += 1
        self.start = self.end = time.perf_counter()
        self.comm = self.exposed = 0.0
        self.hops = 0
        self.sent_bytes = 0
        self.cuda_waits = []

    def cuda_wait(self, before, after) -> None:
        """CUDA: the compute stream waited on a hop between these two timing events (read at the step's end:
        on CUDA the host time of a wait is about zero, the stream's is what is exposed)."""
        self.cuda_waits.append((before, after))

    def hop(self, started: float, wait_began: float, ended: float, hops: int = 1) -> None:
        """A hop (``hops``: a collective's hops, waited for at once) requested at ``started`` and whose
        wait ran from ``wait_began`` to ``ended``; called by ``Pending.wait`` (``ring/issue.py``) alone."""
        self.comm += ended - started
        self.exposed += ended - wait_began
        self.hops += hops
        self.end = ended

    def sent(self, nbytes: int) -> None:
        """Bytes one hop (or a collective's hops) sends, counted when it is requested (``ring/issue.py``)."""
        self.sent_bytes += nbytes

    def mark(self) -> None:
        self.end = time.perf_counter()

    def current(self) -> StepStats:
        """The running step so far (its CUDA waits read now, waiting for their events: called when asked for)."""
        if self.cuda_waits:
            waits, self.cuda_waits = self.cuda_waits, []
            self.exposed += _waited(waits)
        wall = max(self.end - self.start, 0.0)
        return StepStats(step=self.step, wall_s=wall, compute_s=max(wall - self.exposed, 0.0), comm_s=self.comm,
                         exposed_comm_s=self.exposed, hops=self.hops,
                         skipped_steps=self.skipped, sent_bytes=self.sent_bytes)


def _waited(waits: list) -> float:
    """Seconds the compute stream waited between each pair of CUDA events (each waited for first: an event the
    device has not reached has no time yet)."""
    for _, after in waits:
        after.synchronize()
    return sum(before.elapsed_time(after) for before, after in waits) / 1e3


def _with_waits(stats: StepStats, waits: list) -> StepStats:
    exposed = stats.exposed_comm_s + _waited(waits)
    return replace(stats, exposed_comm_s=exposed, compute_s=max(stats.wall_s - exposed, 0.0))
