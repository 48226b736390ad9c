"""The gradient path of the fused layers, in one place: where each piece writes its gradient partials, how they
travel (``Travel``), when the reduced shard is waited for and how it reaches the parameters (``Lands``), all
decided by ``Gradients``, one per step state, for either schedule.

[Note: the gradient path]
- A layer's backward asks its schedule for its partials; the schedule picks how they travel and hands the
  choice to ``Gradients.ring``:

  - ``LOCAL``: nothing travels (one rank; a backward with gradient sync off keeps them for the next one).
  - ``WITH_PIECES``: lockstep; hop k joins piece k's weight hop, waited for at the piece's end.
  - ``LAGGING``: elastic; hop k is a request of its own beside piece k, never waited for by the pieces.
  - ``BUNDLED``: elastic; the unit's ``GradBundle`` carries the hops, beside its last group's pieces.
  - ``WHOLE``: slicing; the partials are reduce-scattered whole after the pieces, in the background.
- At the end of the layer's backward (``Gradients.finish``, the named point, as FSDP2's ``post_backward``) the
  ring's ``Lands`` says what happens. ``NOW``: the last hop is waited for and the shard returned through autograd
  (crossing the copies at once under HSDP). ``LATER``: a ``GradWork`` record joins the queue of work in flight.
- ``Gradients.land`` (at piece boundaries, and blocking when the backward ends: ``finish_backward``, as FSDP2's
  ``finalize_backward``) completes the records whose last hop arrived, in request order, by one route
  (``_complete``): the shard divided by the post-factor and put into ``.grad`` (HSDP: handed to the replicate
  ring, which crosses the copies beside the rest of the backward; ``replicas.py``).
- ``LATER`` only under ``loss.backward()`` with no tensor hooks (``fused/linear.accumulates``): elsewhere autograd
  must receive the gradient.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..ring.collectives import ring_reduce_scatter
from ..ring.issue import Pending
from ..ring.transport import RingCommError
from ..wire import RowFormat
from .engine import Engine, RingOp
from .group import FusedGroupState
from .layout import GroupLayout, MemberBlocks
from .link import RingHops


class Travel(enum.Enum):
    """How a layer's gradient partials travel beside its compute pieces (the Note)."""

    LOCAL = "local"
    WITH_PIECES = "with pieces"
    LAGGING = "lagging"
    BUNDLED = "bundled"
    WHOLE = "whole"

    @property
    def beside_pieces(self) -> bool:
        """Whether the layer's own pieces request its hops (``piece_hops``)."""
        return self is Travel.WITH_PIECES or self is Travel.LAGGING

    @property
    def one_buffer_per_piece(self) -> bool:
        """Whether piece k writes a buffer of its own (its hop may leave after later pieces were computed)."""
        return self is Travel.LAGGING or self is Travel.BUNDLED


class Lands(enum.Enum):
    """When a layer's reduced gradient shard is waited for, and where it goes (the Note)."""

    NOW = "now"  # at the layer's end, returned through autograd
    LATER = "later"  # queued; put into ``.grad`` by ``Gradients.land``


class GradRing(RingHops):
    """A reduce-scatter ring of gradient partials: piece k writes ``part(k)``, this rank's share of rank
    ``t = (r - k - 1) mod N``'s shard; hop k (k ≥ 1) sends ``part(k-1)`` plus the partial sum received by hop
    k-1 (added on the link, just before the hop) and receives the next partial sum into ``racc``. After hop
    N-1 lands, ``part(N-1) + racc`` is this rank's complete shard (``final``). One buffer per piece where the hops
    may leave late (``Travel.one_buffer_per_piece``), else two alternating buffers.

    ``wire``: a narrow format ([Note: narrow formats]); then nothing is summed on the way. Hop k sends this rank's
    contribution ``part(k-1)``, encoded once, straight to its owner ``(r - k) mod N`` and receives rank
    ``(r + k) mod N``'s contribution to this rank's shard; the contributions are summed in float32 into ``racc``
    in the ring's order (rank r+1's, r+2's, ..., this rank's own last), so the exact format would give the
    ring's sum bit for bit. ``residual``: error feedback, what encoding lost of each contribution (a row per
    shard), added to the next step's before it is encoded."""

    def __init__(self, engine: Engine, op: RingOp | None, numel: int, dtype: torch.dtype, device: torch.device,
                 zeroed: bool, travel: Travel, lands: Lands = Lands.NOW, wire: RowFormat | None = None,
                 residual: torch.Tensor | None = None) -> None:
        world = engine.ring.size
        if world == 1:
            travel, lands = Travel.LOCAL, Lands.NOW
        alloc = torch.zeros if zeroed else torch.empty
        self.world, self.op, self.travel, self.lands, self.link = world, op, travel, lands, engine.link
        self.lag = travel.one_buffer_per_piece
        self.parts = alloc(world if self.lag else min(world, 2), numel, dtype=dtype, device=device)
        self.wire = wire if travel is not Travel.LOCAL else None
        self.rank = engine.ring.rank
        if self.wire is not None:
            self.racc = torch.zeros(numel, dtype=torch.float32, device=device)
            self.sent, self.received = wire.empty(None, device), wire.empty(None, device)
            self.residual = residual
        else:
            self.racc = torch.empty(numel, dtype=dtype, device=device) if travel is not Travel.LOCAL else None
        self.last: Pending | None = None  # the request of hop N-1
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
        """What hop k sends and receives, what runs on the link before it (the add of the sum that hop k-1
        received), and the group ranks it sends to and receives from (None: the ring's neighbours)."""
        out = self.part(k - 1)
        if self.wire is not None:
            return [self.sent], [self.received], lambda: self._encode(k, out), \
                ((self.rank - k) % self.world, (self.rank + k) % self.world)
        before = (lambda: out.add_(self.racc)) if k > 1 else None
        return [out], [self.racc], before, None

    def _encode(self, k: int, out: torch.Tensor) -> None:
        """On the link, before hop k: sum in the contribution hop k-1 brought, and encode the one hop k sends."""
        wire = self.wire
        if k > 1:
            wire.add_decoded(self.received, self.racc)
        if self.residual is not None:
            wire.encode_fed(out, self.sent, self.residual[(self.rank - k) % self.world])
        else:
            wire.encode(out, self.sent)

    def arrived(self) -> bool:
        """Whether hop N-1 was requested and has landed."""
        return self.last is not None and self.last.done()

    def wait(self) -> None:
        if self.last is not None:
            self.last.wait()

    def final(self, post: float = 1.0) -> torch.Tensor:
        """This rank's complete shard divided by ``post``, once hop N-1 (``last``) landed and was waited for. Its
        own buffer, not a row of ``parts``, so that the parameters' gradients may be views of it (as FSDP2's are of
        its reduce-scatter's output): nothing is copied, and no other part is kept alive by them."""
        out = self.part(self.world - 1)
        if self.wire is not None:
            self.wire.add_decoded(self.received, self.racc)
            out = self.racc.add_(out)
        elif self.racc is not None:
            out = torch.add(out, self.racc)  # (one row of two or of N otherwise: the grads would hold them all)
        if post != 1.0:
            out.div_(post)
        return out

    def buffers(self) -> list[torch.Tensor]:
        """What ``final`` reads and writes: another stream may use them (CUDA's ``record_stream``, HSDP)."""
        narrow = (self.sent, self.received) if self.wire is not None else ()
        return [t for t in (self.parts, self.racc, *narrow) if t is not None]

    def requests(self):
        return (self.last,) if self.last is not None else ()


class WholeGrads:
    """A fused layer's gradient partials that travel whole after its pieces (``Travel.WHOLE``, the slicing
    schedule): piece k writes this rank's share of shard ``t = (r - k - 1) mod N`` into row t of one
    ``(N, numel)`` buffer, which ``reduce_scatter`` sends as one bucketed ring collective."""

    travel = Travel.WHOLE
    last = None  # (no hop of its own: ``Gradients.land`` completes it when the backward ends)

    def __init__(self, engine: Engine, numel: int, dtype: torch.dtype, device: torch.device, lands: Lands) -> None:
        self.engine, self.ring, self.lands = engine, engine.ring, lands
        self.parts = torch.zeros(engine.ring.size, numel, dtype=dtype, device=device)
        self.work: dist.Work | None = None
        self.shard: torch.Tensor | None = None  # this rank's summed gradient shards
        self._blocks: tuple[MemberBlocks, ...] | None = None

    def part(self, k: int) -> torch.Tensor:
        return self.parts[self.ring.shard_reduced(k)]

    def blocks(self, layout: GroupLayout, k: int) -> tuple[tuple[MemberBlocks, ...], int]:
        if self._blocks is None:
            self._blocks = layout.blocks(self.parts)
        return self._blocks, self.ring.shard_reduced(k)

    def reduce_scatter(self, op: RingOp) -> None:
        """Start the partials' reduce-scatter (in the background where the shard lands later)."""
        engine = self.engine
        self.shard = self.parts.new_empty(self.parts.shape[1])
        self.work = ring_reduce_scatter(self.shard, self.parts.view(-1), self.ring.group, dist.ReduceOp.SUM,
                                        async_op=self.lands is Lands.LATER, tag=op.tag, label=op,
                                        stats=engine.stats, **engine.config.ring_kwargs)

    def arrived(self) -> bool:
        return self.work is None

    def wait(self) -> None:
        """Wait for the collective: timed and counted in the step statistics where it is waited for."""
        if self.work is not None:
            self.work.wait()
            self.work = None

    def final(self, post: float = 1.0) -> torch.Tensor:
        return self.shard.div_(post) if post != 1.0 else self.shard

    def settle(self) -> None:
        if self.work is not None:
            try:
                self.work.wait()
            except RingCommError:  # a broken ring has said so already, where it broke
                pass


class GradBundle(RingHops):
    """The gradient rings of one unit's backward (``Travel.BUNDLED``): their partials wait in their buffers and
    travel as one reduce-scatter ring (one ring's latency per unit, as slicing's per-layer reduce-scatter), hop k
    requested beside piece k of the unit's last group; if that group does not run (the order changed), the hops
    left are paced over the next unit's pieces."""

    completes = True  # hops left when the backward ends are requested then: the unit's gradients need them

    def __init__(self, unit) -> None:
        self.unit, self.rings, self.pending = unit, [], []
        self.next = 1  # the next hop to request (a gradient ring's hops are 1 .. N-1)

    @property
    def unrequested(self) -> int:
        return self.rings[0].world - self.next

    def request(self, hops: int | None = None) -> int:
        count = self.unrequested if hops is None else min(hops, self.unrequested)
        first = self.rings[0]
        for _ in range(count):
            k, sends, recvs, befores, peers = self.next, [], [], [], Peers()
            for ring in self.rings:
                ring_sends, ring_recvs, before, to = ring.io(k)
                peers.add(ring_sends, ring_recvs, to)
                sends, recvs = sends + ring_sends, recvs + ring_recvs
                if before is not None:
                    befores.append(before)
            hop = first.link.hop(sends, recvs, first.op, k, first.world - 1,
                                 (lambda adds=befores: [add() for add in adds]) if befores else None,
                                 **peers.kwargs(first.link.ring))
            self.pending.append(hop)
            self.next += 1
            if self.next == first.world:
                for ring in self.rings:
                    ring.last = hop
        return count

    def requests(self):
        return self.pending


class Peers:
    """The group ranks a link hop's tensors go to and come from, where a ring of it does not use the neighbours
    (a narrow gradient ring sends straight to a shard's owner): ``link.hop``'s ``send_to``/``recv_from``."""

    __slots__ = ("direct", "source", "to")

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


@dataclass(slots=True)
class GradWork:
    """A layer's reduced gradient still in flight when its backward returned (``Lands.LATER``): waited for and put
    into ``.grad`` by ``Gradients.land``."""

    grads: GradRing | WholeGrads
    state: FusedGroupState
    post: float  # the divide factor after the sum
    dtypes: tuple[torch.dtype, ...]  # the parameters' dtypes: the gradients'
    train: tuple[bool, ...]  # the members with a gradient

    def landed_grads(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """After the last hop: each parameter's gradient shard (HSDP's replicate ring calls it on its thread or
        stream)."""
        return self.state.landed_grads(self.grads.final(self.post), self.dtypes, self.train)

    def finish(self) -> list:
        """HSDP on CPU, on the replicate ring's thread: wait for the last hop's job, then the shards."""
        last = self.grads.last
        if last is not None and last.future is not None:
            last.future.result()
        return self.landed_grads()


class Gradients:
    """Decides when each layer's reduced gradient is waited for and how it reaches the parameters (the Note): the
    one place a fused layer's gradient goes through after its pieces, for either schedule."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._in_flight: list[GradWork] = []
        self._unit: GradBundle | None = None  # the gradient rings of the unit whose backward runs (BUNDLED)

    def ring(self, state: FusedGroupState, op: RingOp | None, numel: int, dtype: torch.dtype, device: torch.device,
             zeroed: bool, travel: Travel, lands: Lands) -> GradRing:
        """A gradient ring of ``state``'s backward, in the reduce format of the config (and its error feedback)."""
        wire = state.wire_format("reduce", dtype) if travel is not Travel.LOCAL else None
        residual = state.feedback(device) if wire is not None and wire.lossy else None
        return GradRing(self.engine, op, numel, dtype, device, zeroed, travel, lands, wire, residual)

    def finish(self, state: FusedGroupState, grads: GradRing | WholeGrads, post: float, dtypes: tuple,
               train: tuple) -> torch.Tensor | None:
        """The end of a synced backward of ``state``, after its pieces: this rank's reduced gradient shard to return
        through autograd (``Lands.NOW``), or None when ``land`` puts it into ``.grad`` later."""
        if grads.lands is Lands.LATER:
            self._in_flight.append(GradWork(grads, state, post, dtypes, train))
            return None
        grads.wait()
        final = grads.final(post)
        if self.engine.replicas is not None:  # HSDP: it goes back through autograd, so it crosses the copies now
            final = self.engine.replicas.exchange_now(final, f"the gradient of {state.name}")
        return final

    def land(self, block: bool) -> None:
        """Complete the work in flight whose last hop arrived (``block``: all of it, waiting), in request order.
        HSDP: work whose last hop is requested goes at once to the replicate ring (CPU: its thread,
        ``Replicas.after``; CUDA: its stream, ``Replicas.after_event``), which completes it when the hop lands
        and sends it across the copies: a host running ahead of its compute never holds it back."""
        replicas = self.engine.replicas
        while self._in_flight:
            work = self._in_flight[0]
            last = work.grads.last
            if replicas is not None and last is not None and last.future is not None:
                replicas.after(self._in_flight.pop(0).finish, work.dtypes)
            elif replicas is not None and last is not None and last.event is not None:
                replicas.after_event(self._in_flight.pop(0).finish, last.event, work.grads.buffers())
            elif block or work.grads.arrived():
                self._complete(self._in_flight.pop(0))
            else:
                break

    def finish_backward(self) -> None:
        """The backward ended: every gradient in flight lands."""
        self.land(block=True)

    def _complete(self, work: GradWork) -> None:
        """The one route into ``.grad`` (HSDP: into the replicate ring, which puts the sum across copies there)."""
        work.grads.wait()
        work.state.accumulate_grads(work.grads.final(work.post), work.dtypes, work.train)

    # -- a unit's gradient rings as one bundle (``Travel.BUNDLED``) ----------------------------------------------

    def join_unit(self, unit, ring: GradRing) -> None:
        """``ring`` (before its group's pieces) joins the bundle of ``unit``, the unit whose backward runs."""
        if self._unit is None:
            self._unit = GradBundle(unit)
        self._unit.rings.append(ring)

    def unit_hop(self) -> None:
        """Request the next hop of the running unit's bundle (beside piece k ≥ 1 of the unit's last group: every
        group's partial k-1 exists by then)."""
        if self._unit is not None:
            self._unit.request(1)
            if not self._unit.unrequested:
                self._unit = None

    def close_unit(self, unit) -> GradBundle | None:
        """The running unit's bundle, if it is not ``unit``'s (None: whichever): its hops left go to the
        schedule, which paces them over the next unit's pieces."""
        bundle = self._unit
        if bundle is None or bundle.unit == unit:
            return None
        self._unit = None
        return bundle

    def reset(self) -> None:
        """An aborted step: wait for the work in flight (every rank requested it alike) and drop it."""
        if self._unit is not None:
            self._unit.settle()
            self._unit = None
        in_flight, self._in_flight = self._in_flight, []
        for work in in_flight:
            work.grads.settle()
