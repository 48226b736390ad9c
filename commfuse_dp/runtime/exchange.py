"""The rings of the row-exchanging ops (ring embedding, gathered weight reads): the fused layers' own
``WeightRing``/``GradRing`` run by the one layer call loop (``LayerCall``, ``layer_call.py``), always lockstep, with
their hops requested on the engine's link: timed, observed, bounded by the ring's timeout, and tagged with the
owner's ring-op identity.

``state`` is any owner of ring operations: it has ``engine``, ``steps`` (the ``StepState``) and ``owner`` (its
index there, from ``StepState.register``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch

from ..ring.collectives import goes_direct
from .engine import Engine
from .gradients import GradRing, Travel
from .layer_call import LayerCall
from .layer_rings import WeightRing


class RingOwner(Protocol):
    """What an exchange needs of its owner (a fused group's or ring embedding's state): the engine, the step
    state that names its ring operations, and its owner index there (``owner``)."""

    engine: Engine
    steps: object  # StepState
    owner: int


def gather(state: RingOwner, mine: torch.Tensor, phase: str) -> torch.Tensor:
    """All-gather a same-shape tensor from every rank: ``out[j]`` is rank j's. A small one (``direct_kb``) in one
    direct exchange with every peer, as ``ring_all_gather`` does."""
    engine = state.engine
    ring = engine.ring
    out = mine.new_empty(ring.size, *mine.shape)
    out[ring.rank].copy_(mine)
    if goes_direct(ring, out, engine.config.direct_kb):
        engine.link.hop([out[ring.rank]] * len(ring.peers), [out[p] for p in ring.peers],
                        state.steps.ring_op(state.owner, phase), 0, 1, direct=True).wait()
        return out
    gather_into(state, out, phase)
    return out


def swap(state: RingOwner, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor], phase: str,
         then: Callable[[], None] | None = None):
    """One direct exchange of tensors of any size: ``sends[p]`` goes to group rank p, ``recvs[p]`` is filled from
    rank p. Both sides of each pair know its sizes and leave out a pair with nothing to move. ``then()`` runs right
    after the request. Returns the pending hop (``wait()`` before reading ``recvs``), or None if nothing moves."""
    op = state.steps.ring_op(state.owner, phase)  # on every rank, moving or not: the ring-op sequence stays the same
    hop = None
    if sends or recvs:
        hop = state.engine.link.hop(list(sends.values()), list(recvs.values()), op, 0, 1,
                                    send_to=list(sends), recv_from=list(recvs))
    if then is not None:
        then()
    return hop


def gather_into(state: RingOwner, out: torch.Tensor, phase: str, piece: Callable[[int], None] | None = None,
                then: Callable[[], None] | None = None) -> None:
    """Fill ``out[j]`` for every rank j from ``out[rank]`` (all-gather ring, lockstep); ``piece(s)`` runs on each
    rank's slot as soon as it is held, beside the hop that brings the next one; ``then()`` right after the
    last hop was requested."""
    engine = state.engine
    ring = engine.ring
    weights = WeightRing(engine, state.steps.ring_op(state.owner, phase) if ring.size > 1 else None, out)
    compute = (lambda k: piece(ring.shard_held(k))) if piece is not None else _nothing
    LayerCall(engine, phase, weights, beside=_at(max(ring.size - 2, 0), then)).run(compute)


def reduce(state: RingOwner, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
           piece: Callable[[int, torch.Tensor], None], phase: str, then: Callable[[], None] | None = None,
           by_piece: bool = False) -> torch.Tensor:
    """Reduce-scatter ring (lockstep): ``piece(t, part)`` writes this rank's contribution for rank t into
    ``part`` beside the hop that brings the partial sum for t (``by_piece``: ``piece(k, part)``, k the piece,
    whose part is for ``ring.shard_reduced(k)``); returns the complete sum for this rank. ``then()`` runs right
    after the last hop was requested."""
    engine = state.engine
    world = engine.ring.size
    numel = math.prod(shape)
    op = state.steps.ring_op(state.owner, phase) if world > 1 else None
    grads = GradRing(engine, op, numel, dtype, device, zeroed=False, travel=Travel.WITH_PIECES)
    LayerCall(engine, phase, None, grads, beside=_at(world - 1, then)).run(
        lambda k: piece(k if by_piece else engine.ring.shard_reduced(k), grads.part(k).view(shape)))
    return grads.final().view(shape)


def _at(last: int, then: Callable[[], None] | None) -> Callable[[int], None] | None:
    """``then()`` beside piece ``last`` (right after that piece's hop was requested), or nothing."""
    return None if then is None else (lambda k: then() if k == last else None)


def _nothing(k: int) -> None:
    """(A piece with nothing to compute.)"""
