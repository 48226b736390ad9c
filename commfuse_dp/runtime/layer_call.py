"""``LayerCall``: one call of a ring fused with compute pieces, the loop that every schedule and every ring op runs.

[Note: one layer call]
A fused layer's forward or backward asks its schedule for a call (``Schedule.forward`` / ``Schedule.backward``):
the schedule builds the call's rings (a ``WeightRing`` that brings the rows piece k computes with, a gradient
ring that carries piece k's partials) and returns the call, typed by the schedule. The layer hands it its
compute (``compute(k)``, piece k's GEMMs) and ``run`` does the rest, the same for every schedule:

    for k in 0 .. pieces-1:
        hop = piece_hops(k)      # piece k's own hops: the row of piece k+1 in, partial k-1 out
        before_piece(k)          # the schedule's hops beside it (rings ahead, a unit's gradients, next layers)
        compute(k)
        after_piece(k)           # what landed meanwhile is taken in (earlier layers' gradients)
        hop.wait()               # what piece k+1 needs
    close()                      # the weight buffer back to the schedule; the gradients to where they land

The ring embedding's and the weight reads' exchanges (``exchange.py``) run the same loop with no schedule
around them (``LayerCall`` itself: nothing beside a piece but what they ask for). What the loop carries, rows of
a weight or of anything else of the same shape on every rank, is the rings' business, not the loop's: tensor
parallelism's activations run through it as the weights do.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch

from ..ring import transport
from .engine import Engine
from .gradients import GradRing, Lands, Peers, Travel, WholeGrads
from .layer_rings import WeightRing
from .link import Pending


class GradSpec(NamedTuple):
    """What a backward's gradient partials are and where they go (``Schedule.backward``)."""

    numel: int  # elements of the group's packed shard
    dtype: torch.dtype  # what the gradient ring carries (``reduce_dtype``)
    device: torch.device
    zeroed: bool  # the partials start as zeros (padding rows, members without a gradient)
    communicates: bool  # gradient sync is on: the partials travel and are finished (else kept locally)
    accumulates: bool  # the reduced shard may be put into ``.grad`` later, by us (``fused/linear.accumulates``)
    post: float  # the divide factor after the sum
    dtypes: tuple[torch.dtype, ...]  # the parameters' dtypes: the gradients'
    train: tuple[bool, ...]  # the members with a gradient


class LayerCall:
    """One call of rings fused with ``pieces`` compute pieces (the Note): ``weights`` (None: no rows travel) and
    ``grads`` (None: no partials). ``beside(k)``: run beside piece k after its own hops were requested."""

    def __init__(self, engine: Engine, phase: str, weights: WeightRing | None = None,
                 grads: GradRing | WholeGrads | None = None, beside: Callable[[int], None] | None = None) -> None:
        self.engine, self.phase, self.weights, self.grads = engine, phase, weights, grads
        self._beside = beside

    def run(self, compute: Callable[[int], None], pieces: int | None = None) -> torch.Tensor | None:
        """The loop of the Note over ``pieces`` pieces (default: one per rank), then ``close``; returns what
        ``close`` returns."""
        engine = self.engine
        for k in range(engine.ring.size if pieces is None else pieces):
            hop = piece_hops(engine, k, self.weights, self.grads)
            self.before_piece(k)
            if transport.watched():
                transport.notify("compute_begin", self.phase, k)
            compute(k)
            if transport.watched():
                transport.notify("compute", self.phase, k)
            self.after_piece(k)
            if hop is not None:
                hop.wait()
        return self.close()

    def before_piece(self, k: int) -> None:
        if self._beside is not None:
            self._beside(k)

    def after_piece(self, k: int) -> None:
        """(Nothing lands between pieces of a call without a schedule.)"""

    def close(self) -> torch.Tensor | None:
        """(Every hop was waited for in the loop: nothing is left.)"""
        return None


class ShardRuns:
    """``CommFuseConfig.piece_shards``: the landed shards a piece computes, in runs of consecutive slots of the
    gathered ``(N, numel)`` buffer. Piece k's shard is ``(r - k) mod N``: they come in descending order, so a run
    ends after ``piece_shards`` of them, at shard 0 (the next is N-1, not adjacent) and at the last piece. A ring
    that landed whole before the loop (``WeightRing.in_shard_order``, slicing) is computed in runs in shard order
    instead, the k-th run at piece k (``pieces``: the forward's pieces, one per run there, else one per shard). Decided
    by k alone, the same in every run of the program. ``piecewise``: one row at a time, from the ring's own blocks
    (``_forward_piece``; ``WeightRing.shard`` says which row)."""

    def __init__(self, engine: Engine, weights: WeightRing | None) -> None:
        self.ring = engine.ring
        whole = weights is not None and weights.slots is not None
        ordered = weights is not None and weights.in_shard_order
        self.size = engine.config.piece_shards if ordered or (whole and self.ring.size > 1) else 1
        if weights is not None and weights.wire is not None:
            self.size = 1  # narrow rows are decoded one at a time, into a scratch row
        self.piecewise = self.size == 1
        self._top: int | None = None  # the run's first (highest) shard
        world = self.ring.size
        self._ordered = [(low, min(low + self.size, world) - 1) for low in range(0, world, self.size)] if ordered \
            else None
        self.pieces = len(self._ordered) if ordered else world

    def add(self, k: int) -> tuple[int, int] | None:
        """Piece k's shard joins the run; returns ``(low, high)`` shards (inclusive) when the run is complete."""
        if self._ordered is not None:
            return self._ordered[k] if k < len(self._ordered) else None
        shard = self.ring.shard_held(k)
        if self._top is None:
            self._top = shard
        if self._top - shard + 1 == self.size or shard == 0 or k == self.ring.size - 1:
            run, self._top = (shard, self._top), None
            return run
        return None


class ScheduledCall(LayerCall):
    """A fused group's call under a schedule (``FusedSchedule``'s ``FusedCall``, slicing's ``SlicingCall``):
    ``keep``, a forward that keeps its gathered weight for its backward (``kept``); ``spec``, a backward's
    gradients; ``runs``, which landed shards each piece computes (``ShardRuns``; the forward runs ``runs.pieces``
    pieces, the backward one per rank, for its gradient partials). Closing releases the weight buffer (``release``) and, where gradient sync is on, finishes the
    gradients (``finish``): the reduced shard to return through autograd, or None where it lands later."""

    def __init__(self, state, phase: str, weights: WeightRing | None, grads: GradRing | WholeGrads | None = None,
                 spec: GradSpec | None = None, keep: bool = False) -> None:
        super().__init__(state.engine, phase, weights, grads)
        self.state, self.spec, self.keep = state, spec, keep

    @functools.cached_property
    def runs(self) -> ShardRuns:
        """The landed shards each piece computes (from the weight ring the call holds when first asked)."""
        return ShardRuns(self.engine, self.weights)

    @property
    def kept(self) -> WeightRing | None:
        """The forward's ring with every shard gathered, kept for the backward (``FusedSchedule.keeps_weight``; a
        lockstep ring requested ahead before the order said a backward follows holds two shards, not all: its
        backward gathers the weight again)."""
        return self.weights if self.keep and self.weights is not None and self.weights.slots is not None else None

    def close(self) -> torch.Tensor | None:
        if self.weights is not None:
            self.release()
        if self.grads is None or not self.spec.communicates:
            return None
        return self.finish()

    def release(self) -> None:
        """The weight ring is done (every hop it is part of was waited for): its buffer may serve a later one."""

    def finish(self) -> torch.Tensor | None:
        raise NotImplementedError


def piece_hops(engine: Engine, k: int, weights: WeightRing | None,
               grads: GradRing | WholeGrads | None) -> Pending | None:
    """Request what goes beside piece k and return what its end waits for: the hop that brings the row of piece
    k+1, and the gradient hop that joined it (``Travel.WITH_PIECES``) unless that is the last one and lands
    later (``Lands.LATER``: ``Gradients.land`` waits for it). ``weights``/``grads``: None where that ring does not
    travel."""
    world, link = engine.ring.size, engine.link
    gather = weights is not None and weights.op is not None and k < world - 1
    reduce = grads is not None and k > 0 and grads.travel.beside_pieces
    sends, recvs, before, peers = [], [], None, Peers()
    new_gather = gather and weights.requested <= k  # else requested ahead (the link may have run it already)
    if new_gather:
        sends, recvs = weights.io(k)
        peers.add(sends, recvs, None)
        weights.requested = k + 1
    if reduce:
        g_sends, g_recvs, before, to = grads.io(k)
        if grads.travel is Travel.LAGGING:  # its own request, not waited here: it lands during later compute
            own = Peers()
            own.add(g_sends, g_recvs, to)
            grads.last = link.hop(g_sends, g_recvs, grads.op, k, world - 1, before, **own.kwargs(link.ring))
            before = None
        else:
            peers.add(g_sends, g_recvs, to)
            sends, recvs = sends + g_sends, recvs + g_recvs
    hop = None
    if sends:
        op = weights.op if weights is not None and weights.op is not None else grads.op
        hop = link.hop(sends, recvs, op, k, world - 1, before, **peers.kwargs(link.ring))
        if new_gather:
            weights.pending[k] = hop
        if reduce and grads.travel is Travel.WITH_PIECES:
            grads.last = hop
    if gather:
        return weights.pending[k]
    if reduce and k == world - 1 and grads.lands is Lands.LATER:
        return None
    return hop
