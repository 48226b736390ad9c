"""The weight rings of one fused layer call: the all-gather (``WeightRing``: two alternating buffers in lockstep, an
``(N, numel)`` buffer under the elastic lookahead, reused on CPU through ``SlotPool``) and a unit's weight rings
sharing their hops (``Bundle``). The gradient partials and their hops: ``gradients.py``; the loop that runs both
beside the compute pieces: ``layer_call.py``; when rings are requested across layers: ``schedule.py``."""

from __future__ import annotations

import torch

from ..wire import RowFormat
from .engine import Engine, RingOp
from .layout import GroupLayout, MemberBlocks
from .link import Pending, RingHops


def _identity(k: int) -> int:
    return k


def decode_scratch(engine: Engine, numel: int, dtype: torch.dtype, device: torch.device, which: int) -> torch.Tensor:
    """One of two rows of ``numel`` elements that pieces decode a narrow weight row into, shared by every ring of
    the model (a piece decodes, computes, and the next piece decodes into the other row)."""
    key = (numel, dtype, device)
    rows = engine.scratch.get(key)
    if rows is None:
        rows = engine.scratch[key] = tuple(torch.empty(numel, dtype=dtype, device=device) for _ in range(2))
    return rows[which]


class WeightRing(RingHops):
    """An all-gather ring over same-shape rows: piece k reads ``held(k)``, rank ``(r - k) mod N``'s row.
    ``slots``: ``(N, numel)`` where every row stays (its own row filled, unless ``own`` holds it), or None for two
    alternating buffers ``pair`` (lockstep: the full weight never exists). ``own``: this rank's row where the
    parameters are views of it (``FusedGroupState.own_packed``): sent and computed with in place, never copied
    into ``slots``; only the pieces read rows one at a time then (``piece_shards=1``). ``in_shard_order``: every
    row landed before the layer's loop (slicing's whole gather), so its pieces compute runs of ``piece_shards`` rows
    in shard order 0 .. N-1 (``ShardRuns``; one a piece: piece k computes shard k, ``shard``), not in the order a
    ring brings them. ``wire``: the rows travel in a narrow format ([Note: narrow formats]): ``slots`` and ``pair``
    hold their bytes, and each piece decodes its row into a scratch row of the compute dtype (``blocks``)."""

    def __init__(self, engine: Engine, op: RingOp | None, slots: torch.Tensor | None,
                 pair: tuple[torch.Tensor, torch.Tensor | None] | None = None, own: torch.Tensor | None = None,
                 views: dict | None = None, in_shard_order: bool = False, wire: RowFormat | None = None) -> None:
        self.engine, self.op, self.slots, self.pair, self.own = engine, op, slots, pair, own
        self.in_shard_order, self.wire = in_shard_order, wire
        # shard(k): the shard whose row piece k computes with (bound once: it runs several times a piece)
        self.shard = _identity if in_shard_order else engine.ring.shard_held
        self.world = engine.ring.size
        self.pending: dict[int, Pending] = {}
        self.requested = 0  # hops requested so far
        self.bundle: Bundle | None = None  # the rings whose hops it shares (elastic, chosen ahead)
        self.pooled = False  # ``slots`` came from the schedule's SlotPool and goes back there (release)
        # ``blocks`` made so far: {key: (buffer, blocks)}, kept across rings by the schedule (``views``) where the
        # buffers outlive a ring (pooled slots, the parameters' own packed row)
        self._views = views if views is not None else {}

    def held(self, k: int) -> torch.Tensor:
        if self.slots is None:
            return self.pair[k % 2]
        return self.own if k == 0 and self.own is not None else self.slots[self.shard(k)]

    def blocks(self, layout: GroupLayout, k: int, dtype: torch.dtype | None = None
               ) -> tuple[tuple[MemberBlocks, ...], int]:
        """The members' blocks of the buffer that holds piece k's row, and the row's index in it: views made once
        per buffer of this ring, not per piece. A ring in a narrow format decodes the row into ``dtype`` first."""
        if self.wire is not None:
            buf = decode_scratch(self.engine, self.wire.numel, dtype, self.held(k).device, k % 2)
            self.wire.decode(self.held(k), buf)
            index, key = 0, (id(buf), id(layout))
        elif self.slots is None:
            buf, index, key = self.pair[k % 2], 0, k % 2
        elif k == 0 and self.own is not None:
            buf, index, key = self.own, 0, ("own", id(layout))  # one own row per group: a new one replaces it
        else:
            buf, index = self.slots, self.shard(k)
            key = (id(buf), id(layout))
        made = self._views.get(key)
        if made is None or made[0] is not buf:
            made = self._views[key] = (buf, layout.blocks(buf))
        return made[1], index

    def landed(self) -> WeightRing:
        """The same rows as a ring with nothing left to travel (a forward's kept weight, read by its backward)."""
        return WeightRing(self.engine, None, self.slots, own=self.own, wire=self.wire)

    def io(self, k: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """What hop k sends and receives (the row held at piece k goes out; the next one comes in)."""
        return [self.held(k)], [self.held(k + 1)]

    def request(self, hops: int | None = None) -> int:
        """Request the next ``hops`` hops (default: all left) of it and of the rings it shares hops with."""
        return (self.bundle or Bundle([self])).request(hops)

    @property
    def unrequested(self) -> int:
        return self.world - 1 - self.requested

    @property
    def nbytes(self) -> int:
        return self.slots.numel() * self.slots.element_size() if self.slots is not None else 0

    def requests(self):
        return self.pending.values()


class SlotPool:
    """Gathered-weight buffers of finished rings, kept for the next ring of the same shape (CPU only: CUDA's caching
    allocator reuses memory by itself). Holds at most what the schedule held at once."""

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = {}
        self.reused = 0

    def take(self, shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        free = self._free.get((shape, dtype, device))
        if not free:
            return None
        self.reused += 1
        return free.pop()

    def give(self, buf: torch.Tensor) -> None:
        self._free.setdefault((tuple(buf.shape), buf.dtype, buf.device), []).append(buf)


class WeightRings:
    """Makes the weight rings of the fused schedule's layers and takes their buffers back: elastic (or a weight
    kept for the backward), an ``(N, numel)`` buffer where every row stays, reused on CPU (``SlotPool``); lockstep,
    two alternating row buffers; in a narrow format, rows of its bytes ([Note: narrow formats])."""

    def __init__(self, engine: Engine, elastic: bool) -> None:
        self.engine, self.elastic = engine, elastic
        self._pool = SlotPool()
        self._views: dict = {}  # WeightRing's views of the buffers that outlive a ring (pooled slots, own rows)

    def new(self, state, params, compute_dtype: torch.dtype, op: RingOp | None, keep: bool) -> WeightRing:
        """The ring of ``state``'s weights ``params`` (its local shards) in ``compute_dtype``."""
        layout, ring = state.layout, self.engine.ring
        wire = state.wire_format("gather", compute_dtype)
        if wire is not None:
            return self._narrow(state, params, op, wire, keep)
        if keep or (self.elastic and ring.size > 1):
            device = params[0].device
            pooled = not keep and device.type == "cpu"
            slots = self._pool.take((ring.size, layout.numel), compute_dtype, device) if pooled else None
            if slots is None:
                slots = torch.empty(ring.size, layout.numel, dtype=compute_dtype, device=device)
            own = state.own_packed(params, compute_dtype)  # the params are views of it: nothing to pack (adopt_packed)
            if own is None:
                layout.pack(state.pairs(params), compute_dtype, out=slots[ring.rank])
            weights = WeightRing(self.engine, op, slots, own=own, views=self._views if pooled else None)
            weights.pooled = pooled
            return weights
        buf = layout.pack(state.pairs(params), compute_dtype)
        return WeightRing(self.engine, op, None, (buf, torch.empty_like(buf) if ring.size > 1 else None))

    def _narrow(self, state, params, op: RingOp | None, wire: RowFormat, keep: bool) -> WeightRing:
        """A weight ring whose rows travel in ``wire``'s format: this rank's row encoded once, the rest arriving as
        bytes."""
        ring, device = self.engine.ring, params[0].device
        if keep or self.elastic:
            pooled = not keep and device.type == "cpu"
            slots = self._pool.take((ring.size, wire.nbytes), torch.uint8, device) if pooled else None
            if slots is None:
                slots = wire.empty(ring.size, device)
            state.encode_own(params, wire, slots[ring.rank])
            weights = WeightRing(self.engine, op, slots, views=self._views if pooled else None, wire=wire)
            weights.pooled = pooled
            return weights
        own = wire.empty(None, device)
        state.encode_own(params, wire, own)
        return WeightRing(self.engine, op, None, (own, wire.empty(None, device)), wire=wire)

    def release(self, weights: WeightRing) -> None:
        """``weights`` is done (every hop it is part of was waited for): its gathered weight buffer may serve a
        later ring (CPU: a fresh buffer is first touched, page by page, in every ring of every step)."""
        if weights.pooled:
            weights.pooled = False
            self._pool.give(weights.slots)


class Bundle(RingHops):
    """Weight rings of one unit chosen ahead together (in the forward only with ``forward_bundles``): hop k of all
    of them travels as one request, so a unit pays one ring's latency, as slicing's per-layer gather does."""

    completes = False  # hops not requested when the backward ends are dropped: no layer will read them

    def __init__(self, rings: list[WeightRing]) -> None:
        self.rings = rings
        for ring in rings:
            ring.bundle = self

    @property
    def unrequested(self) -> int:
        return self.rings[0].unrequested

    def request(self, hops: int | None = None) -> int:
        first = self.rings[0]
        count = first.unrequested if hops is None else min(hops, first.unrequested)
        for _ in range(count):
            k = first.requested
            sends, recvs = [], []
            for ring in self.rings:
                ring_sends, ring_recvs = ring.io(k)
                sends, recvs = sends + ring_sends, recvs + ring_recvs
            pending = first.engine.link.hop(sends, recvs, first.op, k, first.world - 1)
            for ring in self.rings:
                ring.pending[k], ring.requested = pending, k + 1
        return count

    def requests(self):
        for ring in self.rings:
            yield from ring.requests()
