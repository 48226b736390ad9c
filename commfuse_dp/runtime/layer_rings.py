"""The rings of one fused layer call, and the steps beside each of its compute pieces: the weight all-gather
(``WeightRing``: two alternating buffers in lockstep, an ``(N, numel)`` buffer under the elastic lookahead, reused
on CPU through ``SlotPool``), the gradient reduce-scatter (``GradRing``), a unit's rings sharing their steps
(``Bundle``, ``GradBundle``), what piece k requests and waits for (``piece_steps``), a gradient ring completed
after its layer's backward returned (``Landing``), and partials that travel whole after the layer
(``WholeGrads``, slicing). When they are requested across layers: ``schedule.py``."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..wire import RowFormat
from .engine import Engine, RingOp
from .group import FusedGroupState
from .layout import GroupLayout, MemberBlocks
from .link import Pending


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


class WeightRing:
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
        self.requested = 0  # steps requested so far
        self.bundle: Bundle | None = None  # the rings whose steps it shares (elastic, chosen ahead)
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

    def io(self, k: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """What step k sends and receives (the row held at piece k goes out; the next one comes in)."""
        return [self.held(k)], [self.held(k + 1)]

    def request(self, steps: int | None = None) -> int:
        """Request the next ``steps`` steps (default: all left) of it and of the rings it shares steps with."""
        return (self.bundle or Bundle([self])).request(steps)

    @property
    def unrequested(self) -> int:
        return self.world - 1 - self.requested

    @property
    def nbytes(self) -> int:
        return self.slots.numel() * self.slots.element_size() if self.slots is not None else 0

    def settle(self) -> None:
        for pending in self.pending.values():
            pending.settle()


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


class Bundle:
    """Weight rings of one unit chosen ahead together (in the forward only with ``forward_bundles``): step k of all
    of them travels as one request, so a unit pays one ring's latency, as slicing's per-layer gather does."""

    def __init__(self, rings: list[WeightRing]) -> None:
        self.rings = rings
        for ring in rings:
            ring.bundle = self

    @property
    def unrequested(self) -> int:
        return self.rings[0].unrequested

    def request(self, steps: int | None = None) -> int:
        first = self.rings[0]
        count = first.unrequested if steps is None else min(steps, first.unrequested)
        for _ in range(count):
            k = first.requested
            sends, recvs = [], []
            for ring in self.rings:
                ring_sends, ring_recvs = ring.io(k)
                sends, recvs = sends + ring_sends, recvs + ring_recvs
            pending = first.engine.link.step(sends, recvs, first.op, k, first.world - 1)
            for ring in self.rings:
                ring.pending[k], ring.requested = pending, k + 1
        return count

    def settle(self) -> None:
        for ring in self.rings:
            ring.settle()


class GradRing:
    """A reduce-scatter ring of gradient partials: piece k writes ``part(k)``, this rank's share of rank
    ``t = (r - k - 1) mod N``'s shard; step k (k ≥ 1) sends ``part(k-1)`` plus the partial sum received by step
    k-1 (added on the link, just before the step) and receives the next partial sum into ``racc``. After step
    N-1 lands, ``part(N-1) + racc`` is this rank's complete shard (``final``). ``lag``: one buffer per piece,
    so compute never waits for a step to free one; else two alternating buffers.

    ``wire``: a narrow format ([Note: narrow formats]); then nothing is summed on the way. Step k sends this rank's
    contribution ``part(k-1)``, encoded once, straight to its owner ``(r - k) mod N`` and receives rank
    ``(r + k) mod N``'s contribution to this rank's shard; the contributions are summed in float32 into ``racc``
    in the ring's order (rank r+1's, r+2's, ..., this rank's own last), so the exact format would give the
    ring's sum bit for bit. ``residual``: error feedback, what encoding lost of each contribution (a row per
    shard), added to the next step's before it is encoded."""

    def __init__(self, engine: Engine, op: RingOp | None, numel: int, dtype: torch.dtype, device: torch.device,
                 zeroed: bool, communicates: bool, lag: bool, wire: RowFormat | None = None,
                 residual: torch.Tensor | None = None) -> None:
        world = engine.ring.size
        alloc = torch.zeros if zeroed else torch.empty
        self.world, self.op, self.lag, self.link = world, op, lag and communicates, engine.link
        self.parts = alloc(world if self.lag else min(world, 2), numel, dtype=dtype, device=device)
        self.wire = wire if communicates and world > 1 else None
        self.rank = engine.ring.rank
        if self.wire is not None:
            self.racc = torch.zeros(numel, dtype=torch.float32, device=device)
            self.sent, self.received = wire.empty(None, device), wire.empty(None, device)
            self.residual = residual
        else:
            self.racc = torch.empty(numel, dtype=dtype, device=device) if communicates and world > 1 else None
        self.last: Pending | None = None
        self.bundled = False  # its steps go later, with its unit's other rings (GradBundle), not beside its pieces
        self.later = False  # its last step is waited for by the schedule after its layer's backward (``Landing``)
        self._blocks: tuple[MemberBlocks, ...] | None = None

    def part(self, k: int) -> torch.Tensor:
        return self.parts[k if self.lag else k % 2]

    def blocks(self, layout: GroupLayout, k: int) -> tuple[tuple[MemberBlocks, ...], int]:
        """The members' blocks of the partials, and the row of ``part(k)`` in them (views made once)."""
        if self._blocks is None:
            self._blocks = layout.blocks(self.parts)
        return self._blocks, k if self.lag else k % 2

    def io(self, k: int) -> tuple[list[torch.Tensor], list[torch.Tensor], Callable[[], None] | None,
                                  tuple[int, int] | None]:
        """What step k sends and receives, what runs on the link before it (the add of the sum that step k-1
        received), and the group ranks it sends to and receives from (None: the ring's neighbours)."""
        out = self.part(k - 1)
        if self.wire is not None:
            return [self.sent], [self.received], lambda: self._encode(k, out), \
                ((self.rank - k) % self.world, (self.rank + k) % self.world)
        before = (lambda: out.add_(self.racc)) if k > 1 else None
        return [out], [self.racc], before, None

    def _encode(self, k: int, out: torch.Tensor) -> None:
        """On the link, before step k: sum in the contribution step k-1 brought, and encode the one step k sends."""
        wire = self.wire
        if k > 1:
            wire.add_decoded(self.received, self.racc)
        if self.residual is not None:
            wire.encode_fed(out, self.sent, self.residual[(self.rank - k) % self.world])
        else:
            wire.encode(out, self.sent)

    def final(self, post: float = 1.0) -> torch.Tensor:
        """This rank's complete shard divided by ``post``, once step N-1 (``last``) landed and was waited for. Its
        own buffer, not a row of ``parts``, so that the parameters' gradients may be views of it (as FSDP2's are of
        its reduce-scatter's output): nothing is copied, and no other part is kept alive by them."""
        out = self.part(self.world - 1)
        if self.wire is not None:
            self.wire.add_decoded(self.received, self.racc)
            out = self.racc.add_(out)
            if post != 1.0:
                out.div_(post)
            return out
        if self.racc is not None:
            out = torch.add(out, self.racc)  # (one row of two or of N otherwise: the grads would hold them all)
        if post != 1.0:
            out.div_(post)
        return out


class WholeGrads:
    """A fused layer's gradient partials that travel whole after its pieces (the slicing schedule, whose
    ``finish_grads`` reduce-scatters them): piece k writes this rank's share of shard ``t = (r - k - 1) mod N`` into
    row t of one ``(N, numel)`` buffer. The pieces read it as a ``GradRing`` (``part``, ``blocks``); nothing travels
    beside them (``racc`` None, never ``bundled``, no ``last`` step); ``later``: the reduce-scatter runs in the
    background and lands when the backward ends."""

    racc = None
    bundled = False
    last = None

    def __init__(self, engine: Engine, numel: int, dtype: torch.dtype, device: torch.device, later: bool) -> None:
        self.ring, self.later = engine.ring, later
        self.parts = torch.zeros(engine.ring.size, numel, dtype=dtype, device=device)
        self._blocks: tuple[MemberBlocks, ...] | None = None

    def part(self, k: int) -> torch.Tensor:
        return self.parts[self.ring.shard_reduced(k)]

    def blocks(self, layout: GroupLayout, k: int) -> tuple[tuple[MemberBlocks, ...], int]:
        if self._blocks is None:
            self._blocks = layout.blocks(self.parts)
        return self._blocks, self.ring.shard_reduced(k)


class GradBundle:
    """The gradient rings of one unit's backward (elastic; every unit but the backward's last): their partials wait
    in their buffers and travel as one reduce-scatter ring (one ring's latency per unit, as slicing's per-layer
    reduce-scatter), step k requested beside piece k of the unit's last group; if that group does not run (the
    order changed), the steps left are paced over the next unit's pieces."""

    def __init__(self, unit) -> None:
        self.unit, self.rings, self.pending = unit, [], []
        self.next = 1  # the next step to request (a gradient ring's steps are 1 .. N-1)

    @property
    def unrequested(self) -> int:
        return self.rings[0].world - self.next

    def request(self, steps: int | None = None) -> int:
        count = self.unrequested if steps is None else min(steps, self.unrequested)
        first = self.rings[0]
        for _ in range(count):
            k, sends, recvs, befores, peers = self.next, [], [], [], Peers()
            for ring in self.rings:
                ring_sends, ring_recvs, before, to = ring.io(k)
                peers.add(ring_sends, ring_recvs, to)
                sends, recvs = sends + ring_sends, recvs + ring_recvs
                if before is not None:
                    befores.append(before)
            step = first.link.step(sends, recvs, first.op, k, first.world - 1,
                                   (lambda adds=befores: [add() for add in adds]) if befores else None,
                                   **peers.kwargs(first.link.ring))
            self.pending.append(step)
            self.next += 1
            if self.next == first.world:
                for ring in self.rings:
                    ring.last = step
        return count

    def settle(self) -> None:
        for pending in self.pending:
            pending.settle()


def piece_steps(engine: Engine, k: int, weights: WeightRing | None,
                grads: GradRing | WholeGrads | None) -> Pending | None:
    """Request what goes beside piece k and return what to wait for at its end (the step that brings the row
    of piece k+1, and in lockstep the gradient partial too). ``weights``/``grads``: None where that ring does
    not travel."""
    world, link = engine.ring.size, engine.link
    gather = weights is not None and weights.op is not None and k < world - 1
    reduce = grads is not None and grads.racc is not None and k > 0 and not grads.bundled
    sends, recvs, before, peers = [], [], None, Peers()
    new_gather = gather and weights.requested <= k  # else requested ahead (the link may have run it already)
    if new_gather:
        sends, recvs = weights.io(k)
        peers.add(sends, recvs, None)
        weights.requested = k + 1
    if reduce:
        g_sends, g_recvs, before, to = grads.io(k)
        if grads.lag:  # its own step, not waited here: it lands during later compute
            own = Peers()
            own.add(g_sends, g_recvs, to)
            grads.last = link.step(g_sends, g_recvs, grads.op, k, world - 1, before, **own.kwargs(link.ring))
            before = None
        else:
            peers.add(g_sends, g_recvs, to)
            sends, recvs = sends + g_sends, recvs + g_recvs
    step = None
    if sends:
        op = weights.op if weights is not None and weights.op is not None else grads.op
        step = link.step(sends, recvs, op, k, world - 1, before, **peers.kwargs(link.ring))
        if new_gather:
            weights.pending[k] = step
        if reduce and not grads.lag:
            grads.last = step
    if gather:
        return weights.pending[k]
    return step


class Peers:
    """The group ranks a link step's tensors go to and come from, where a ring of it does not use the neighbours
    (a narrow gradient ring sends straight to a shard's owner): ``link.step``'s ``send_to``/``recv_from``."""

    __slots__ = ("to", "source", "direct")

    def __init__(self) -> None:
        self.to: list[int | None] = []
        self.source: list[int | None] = []
        self.direct = False

    def add(self, sends: list, recvs: list, peers: tuple[int, int] | None) -> None:
        send_to, recv_from = peers if peers is not None else (None, None)
        self.direct = self.direct or peers is not None
        self.to += [send_to] * len(sends)
        self.source += [recv_from] * len(recvs)

    def kwargs(self, ring) -> dict:
        if not self.direct:
            return {}
        return {"send_to": [ring.next if p is None else p for p in self.to],
                "recv_from": [ring.prev if p is None else p for p in self.source]}


class Landing:
    """A fused layer's gradient ring whose last step was still in flight when its backward returned: ``complete()``
    (on the compute thread) adds the received sum, divides and puts the shard into the parameters' grads."""

    __slots__ = ("grads", "state", "post", "dtypes", "train")

    def __init__(self, grads: GradRing, state: FusedGroupState, post: float, dtypes: tuple, train: tuple) -> None:
        self.grads, self.state, self.post, self.dtypes, self.train = grads, state, post, dtypes, train

    def complete(self) -> None:
        self.grads.last.wait()
        self.state.accumulate_grads(self._final(), self.dtypes, self.train)

    def finish(self) -> list:
        """HSDP: the gradient shards to cross the copies, after the last step (CPU: on the replicate ring's thread,
        ``Replicas.after``; CUDA: on its stream, behind the step's event, ``Replicas.after_event``)."""
        if self.grads.last.future is not None:
            self.grads.last.future.result()
        return self.state.landed_grads(self._final(), self.dtypes, self.train)

    def buffers(self) -> list[torch.Tensor]:
        """What ``finish`` reads and writes: another stream uses them (CUDA's ``record_stream``)."""
        grads = self.grads
        narrow = (grads.sent, grads.received) if grads.wire is not None else ()
        return [t for t in (grads.parts, grads.racc, *narrow) if t is not None]

    def _final(self) -> torch.Tensor:
        return self.grads.final(self.post)
