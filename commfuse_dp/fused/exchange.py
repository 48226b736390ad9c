"""The ring loops of the row-exchanging ops (ring embedding, gathered weight reads), driven by the engine: each
ring step timed, observed and bounded by the ring's timeout, and tagged with its owner's ring-op identity.

``state`` is any owner of ring operations: it has ``engine``, ``steps`` (the ``StepState``) and ``op`` (its index
there, from ``StepState.register``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from ..engine import Engine


class RingOwner(Protocol):
    engine: Engine
    steps: object  # StepState
    op: int


def gather(state: RingOwner, mine: torch.Tensor, phase: str) -> torch.Tensor:
    """All-gather a same-shape tensor from every rank: ``out[j]`` is rank j's."""
    ring = state.engine.ring
    out = mine.new_empty(ring.size, *mine.shape)
    out[ring.rank].copy_(mine)
    gather_into(state, out, phase)
    return out


def gather_into(state: RingOwner, out: torch.Tensor, phase: str, piece: Callable[[int], None] | None = None,
                then: Callable[[], None] | None = None) -> None:
    """Fill ``out[j]`` for every rank j from ``out[rank]`` (all-gather ring); ``piece(s)`` runs on each rank's
    slot as soon as it is held, beside the ring step that brings the next one; ``then()`` right after the last
    step started."""
    engine = state.engine
    ring = engine.ring
    world = ring.size
    op = state.steps.ring_op(state.op, phase) if world > 1 else None
    for k in range(world):
        s = ring.shard_held(k)
        step = engine.start([out[s]], [out[(s - 1) % world]], op, k) if k < world - 1 else None
        if then is not None and k == max(world - 2, 0):
            then()
        if piece is not None:
            piece(s)
        if step is not None:
            engine.wait(step)


def reduce(state: RingOwner, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
           piece: Callable[[int, torch.Tensor], None], phase: str, then: Callable[[], None] | None = None
           ) -> torch.Tensor:
    """Reduce-scatter ring: ``piece(t, part)`` writes this rank's contribution for rank t into ``part`` beside the
    step that brings the partial sum for t; returns the complete sum for this rank. ``then()`` runs right after
    the last step started."""
    engine = state.engine
    ring = engine.ring
    world = ring.size
    parts = [torch.empty(shape, dtype=dtype, device=device) for _ in range(min(world, 2))]
    racc = torch.empty(shape, dtype=dtype, device=device) if world > 1 else None
    op = state.steps.ring_op(state.op, phase) if world > 1 else None
    for k in range(world):
        step = engine.start([parts[(k - 1) % 2]], [racc], op, k) if k > 0 else None
        if then is not None and k == world - 1:
            then()
        part = parts[k % 2]
        piece(ring.shard_reduced(k), part)
        if step is not None:
            engine.wait(step)
            part.add_(racc)
    return parts[(world - 1) % 2]
