"""``StepState``: everything a step of a sharded model leaves between its phases, with one ``reset()``.

A *step* runs from one forward of the sharded root module to the next. Within it the fused layers and ring
embeddings carry state from one call to another:
- the schedule's (``FusedSchedule``: layer order, prefetched first hops, the kept lm_head weight, deferred
  last gradient hops; ``SlicingScheduler``: prefetched gathers, background reduce-scatters);
- each shared-input group's outputs waiting for their module's call (q/k/v);
- each fused group's gradient partials kept while gradient sync is off (accumulation micro-batches);
- the identity of every ring operation: which module, which phase, which call of it in this step (``ring_op``),
  carried in the message tag so that ranks calling different layers never pair up their bytes.

A step that raises (in the forward, in the backward, or in a ring) leaves some of this behind. ``reset()`` drops
all of it: in-flight hops are waited for (every rank started them alike) and their bytes discarded, the no-sync
partials too (the accumulation window is lost, as with FSDP2's ``reset_iter_state``, to which ``shard()`` chains
it). ``begin_step`` calls it by itself when the previous step did not finish its forward or its backward.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable
from typing import Protocol

import torch

from .engine import Engine, RingOp
from .accumulate import accumulate_grad

logger = logging.getLogger("commfuse_dp")

PHASES = ("forward", "backward", "embedding counts", "embedding ids", "embedding forward", "embedding backward",
          "weight read", "weight read grad")
_PHASE = {name: i for i, name in enumerate(PHASES)}

# A ring op's tag: bit 29 set (the ring collectives' counter tags stay below it), then the step (10 bits), the
# call of this module in this phase in this step (6 bits), the phase (3 bits) and the module's index (10 bits).
# Fields wrap; two ops get the same tag only if they agree in all of them modulo these sizes.
_IDENTIFIED = 1 << 29


class Schedule(Protocol):
    """When the hops of a step's fused layers run: ``FusedSchedule`` (elastic or lockstep, ``schedule.py``) and
    ``SlicingScheduler`` (``slicing.py``). ``fused.step_state`` picks one from the config; the step state drives it
    at the step's edges, and each fused layer's forward and backward asks it for its call ([Note: one layer call],
    ``layer_call.py``), which owns the call's rings, what goes beside each of its pieces and its close. Nothing
    downstream asks which schedule it is."""

    dtype_hint: torch.dtype | None  # the compute dtype under autocast, for buffers requested ahead of a layer

    @property
    def packs_params(self) -> bool:
        """Whether a group's local shards may be views of one packed buffer (``FusedGroupState.adopt_packed``)."""

    # -- the step's edges --------------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """The root's forward begins: forget the previous step's rings, keep its layer order."""

    def start_first(self, phase: str) -> None:
        """Request the first fused layer's hops of ``phase`` ahead of it (from the ring embedding's forward)."""

    def end_backward(self) -> None:
        """Autograd finished the backward: the last deferred gradient hops land."""

    def reset(self) -> None:
        """A step raised: wait for what is in flight, drop it and everything the schedule kept."""

    # -- one layer call ----------------------------------------------------------------------------------------

    def forward(self, state, params, compute_dtype: torch.dtype, needs_dx: bool, recompute: bool = False):
        """The call (``layer_call.ScheduledCall``) of ``state``'s forward with its local shards ``params``;
        ``needs_dx``: its backward will need the weight; ``recompute``: a forward recomputed in the backward (no
        part of the layer order). Its ``kept`` is handed back to ``backward`` as ``full``."""

    def backward(self, state, params, compute_dtype: torch.dtype, needs_dx: bool, full, spec):
        """The call of ``state``'s backward: a weight ring where ``needs_dx``, gradient partials where ``spec``
        (``layer_call.GradSpec``) says what they are."""


class StepPhase(enum.Enum):
    """Where a step of a sharded model stands (as FSDP2's ``TrainingState`` for its modules)."""

    IDLE = "idle"  # no step open: before the first, after a backward, or after a forward without grad
    FORWARD = "forward"  # the root's forward began and has not returned
    AWAITING_BACKWARD = "awaiting backward"  # a forward with grad returned; its backward has not reached us
    BACKWARD = "backward"  # a backward reached a fused layer and has not finished


class StepState:
    """The state a step of one sharded model carries between its phases (module docstring), and the identity of
    each ring operation in it. ``make_schedule(engine, steps)`` builds its schedule."""

    def __init__(self, engine: Engine, make_schedule: Callable[[Engine, StepState], Schedule]) -> None:
        self.engine = engine
        self.schedule: Schedule = make_schedule(engine, self)
        self.names: list[str] = []  # ring-op owners (fused groups, ring embeddings) by index
        self.numbers: list[int] = []  # each owner's number on the ring, the tag's owner field
        self.groups: list = []  # FusedGroup: pending shared-input outputs
        self.states: list = []  # FusedGroupState: no-sync partials
        self.step = -1
        self._calls: dict[int, int] = {}
        self.phase = StepPhase.IDLE
        self._end_queued = False  # ``_end_of_backward`` is queued on autograd's engine
        self.nonfinite = None  # NonfiniteCheck (``commfuse_dp/nonfinite.py``), set by shard() unless turned off
        self.reads: dict[int, object] = {}  # id(fused parameter) -> its ParamRead (``reads.py``)
        self.read_cache: dict[int, torch.Tensor] = {}  # id(ParamRead) -> the full value gathered in this step

    # -- identity of ring operations -------------------------------------------------------------------------

    def register(self, name: str) -> int:
        """A new owner of ring operations (called in the same order on every rank: at ``shard()`` time, or on a
        shared-input group's first call with another input). Its tag field is numbered on the ring, across every
        model sharded there (a reference beside its policy), so two models' operations do not share a tag; the
        field wraps after 1024 owners, as the tag's other fields wrap (then only the check against ranks that call
        different layers is weaker)."""
        ring = self.engine.ring
        self.names.append(name)
        self.numbers.append(ring.owners)
        ring.owners += 1
        return len(self.names) - 1

    def ring_op(self, owner: int, phase: str) -> RingOp:
        """The next ring operation of ``owner`` in ``phase`` in this step, with its tag."""
        p = _PHASE[phase]
        key = owner << 3 | p
        call = self._calls.get(key, 0)
        self._calls[key] = call + 1
        tag = (_IDENTIFIED | (self.step & 0x3FF) << 19 | (call & 0x3F) << 13 | p << 10
               | (self.numbers[owner] & 0x3FF))
        return RingOp(tag, self.names[owner], phase, call, self.step)

    # -- the step's life ---------------------------------------------------------------------------------------

    def reads_gathered(self) -> bool:
        """Whether a read of a fused parameter from outside its fused forward gets the full value now
        (``reads.py``): inside the root's forward, and from a grad-enabled forward to the end of its backward."""
        return self.phase is not StepPhase.IDLE

    def begin_step(self) -> bool:
        """The root module's forward begins. Returns True if the previous step was left unfinished (and reset)."""
        aborted = self.phase is StepPhase.FORWARD or self.phase is StepPhase.BACKWARD
        if aborted:
            logger.warning("commfuse_dp: the previous %s did not finish (an exception?); its in-flight hops, "
                           "deferred gradients and no-sync partials were dropped", self.phase.value)
            self.reset()
        # Raises if the ranks issued different hops in the previous step (ring/fingerprint.py)
        self.engine.ring.fingerprint.begin_step(self.step + 1, self.engine.config.timeout_s)
        self.engine.stats.begin_step()
        self.step += 1
        self._calls.clear()
        self.read_cache.clear()
        self.phase = StepPhase.FORWARD
        self.schedule.begin_step()
        for group in self.groups:
            group.reset()
        return aborted

    def end_forward(self) -> None:
        self.phase = StepPhase.AWAITING_BACKWARD if torch.is_grad_enabled() else StepPhase.IDLE
        if self.phase is StepPhase.IDLE:
            self.read_cache.clear()

    def backward_begins(self) -> None:
        """A fused backward runs: make sure the end of this backward is seen (``_end_of_backward``). (A backward
        inside the root's forward leaves the step in its forward.)"""
        if self.phase is not StepPhase.FORWARD:
            self.phase = StepPhase.BACKWARD
        if not self._end_queued:
            self._end_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self.schedule.end_backward()  # the last deferred hop / background reduce-scatters
        replicas = self.engine.replicas
        if replicas is not None and self.engine.requires_grad_sync:  # HSDP: the shards cross the copies
            replicas.exchange(accumulate_grad)
        self._end_queued = False
        if self.phase is not StepPhase.FORWARD:
            self.phase = StepPhase.IDLE
        self.read_cache.clear()
        self.engine.ring.fingerprint.end_backward()  # raises if the ranks' previous steps differed

    def reset(self) -> None:
        """Drop all per-step state (after a step that raised); the next step starts as a first step."""
        self.schedule.reset()
        self.engine.ring.fingerprint.drop()
        if self.engine.replicas is not None:
            self.engine.replicas.drop()
        for group in self.groups:
            group.reset()
        for state in self.states:
            state.take_unsynced()
        self._calls.clear()
        self.read_cache.clear()
        self.phase = StepPhase.IDLE
        self._end_queued = False
