"""The link scheduler: one queue of hops per rank, worked in the order they were requested.

Every hop of a fused layer, a ring embedding or a gathered weight read is a request here
(``Link.hop``); the compute that needs its bytes waits on what the request returns (``Pending.wait``). The
schedule (``runtime/schedule.py``) decides only *when* to request: a lockstep layer requests hop k beside compute
piece k; an elastic one requests the hops of coming layers ahead of their compute, within the memory budget.

[Note: the link]
- Order. Requests are made on the compute thread, in program order, so every rank makes the same requests in the
  same order (the lockstep contract). The link works them in that order, one at a time; a request's ``before``
  (the add of the partial sum received by the hop before it, on a reduce-scatter ring) runs on the link just
  before the hop is issued. Nothing here decides by timing, so the order never differs between ranks.
- Requests are made only when their inputs are ready (a gradient partial is requested after the piece that
  wrote it), so the link never waits for compute: it waits only for its peers.
- CPU + gloo: the link is the ring's worker thread (``Ring.executor``), the one that also runs the asynchronous
  bucketed collectives (FSDP2 units' prefetched all-gathers, the slicing schedule's gathers and reduce-scatters):
  one queue for all of them. ``Pending.wait`` blocks the host until the hop landed, bounded by ``timeout_s``.
- CUDA + NCCL: a request is enqueued on the ring's communication stream at once, after an event recorded on the
  compute stream (its inputs are written); ``Pending.wait`` makes the compute stream wait for the hop's event;
  the host never waits. Tensors used on the communication stream are marked with ``record_stream`` so that the
  caching allocator does not reuse them before the hop ran. Waiting time is measured by CUDA events on the
  compute stream and read at the end of the step. (Written for NCCL and never run here: no GPU.)
- The issue and the wait are the ring layer's (``issue``, ``Pending.wait`` in ``ring/issue.py``), the ones the
  bucketed collectives' hops go through too ([Note: one place for a hop]): the link adds the request and
  its order, not another way to issue or time a hop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from ..ring import transport
from ..ring.issue import Hop, Pending, Posted, after_posted, issue
from ..ring.topology import Ring, device_ready
from ..stats import StatsRecorder

__all__ = ["Link", "Pending", "RingHops"]


class RingHops:
    """What every ring of a layer call shares (``WeightRing`` and a unit's ``Bundle`` of them, ``GradRing`` and a
    unit's ``GradBundle``): the hops requested for it so far (``requests``) and, for an aborted step, ``settle``:
    each of them waited for (every rank requested them alike) and its bytes dropped."""

    __slots__ = ()

    def requests(self) -> Iterable[Pending]:
        raise NotImplementedError

    def settle(self) -> None:
        for pending in self.requests():
            pending.settle()


class Link:
    """The link scheduler of one ring (module docstring): ``hop`` requests one hop of a fused layer, ring
    embedding or weight read, worked in request order; every request is folded into the ring's fingerprint
    (``ring/fingerprint.py``). It keeps the deadline per hop and the step statistics they are recorded in."""

    def __init__(self, ring: Ring, timeout_s: float, stats: StatsRecorder) -> None:
        self.ring, self.timeout_s, self.stats = ring, timeout_s, stats

    def hop(self, sends: list[torch.Tensor], recvs: list[torch.Tensor], op, k: int, hops: int,
             before: Callable[[], None] | None = None, direct: bool = False,
             send_to: list[int] | None = None, recv_from: list[int] | None = None) -> Pending:
        """Request one hop: ``sends`` go to ``ring.next``, ``recvs`` are filled from ``ring.prev``.
        ``op`` is the ``RingOp`` (tag and name); ``k`` the hop's index in its ring of ``hops``. The tensors
        must stay untouched (``recvs``: unread) until the hop is waited for. ``direct``: a direct exchange
        instead, send ``i`` to and receive ``i`` from ``ring.peers[i]`` (``exchange.gather``), or from the group
        ranks ``send_to[i]`` / ``recv_from[i]`` where given (``exchange.swap``). CPU: issued here at once when
        nothing of the ring is in flight or queued, else worked on the ring's thread in request order; CUDA:
        enqueued on its communication stream at once."""
        ring = self.ring
        tensor = sends[0] if sends else recvs[0]
        if self.stats.enabled or transport.bytes_watched():
            nbytes = sum(t.numel() * t.element_size() for t in sends)
            if self.stats.enabled:
                self.stats.sent(nbytes)
            if transport.bytes_watched():
                transport.notify_sent(op.name, op.phase, k, nbytes, tensor.dtype)
        if transport.watched():
            transport.notify("start", op.phase, k)
        # compared across the ranks (ring/fingerprint.py); a direct exchange's sizes may differ (embedding rows)
        ring.fingerprint.add(op, k, hops, 0 if direct or send_to is not None else tensor.numel())
        if direct:
            send_to = ring.peers if send_to is None else send_to
            recv_from = ring.peers if recv_from is None else recv_from
        hop = Hop(ring, sends, recvs, op.tag, op.phase, k, hops, self.timeout_s, op, send_to, recv_from, before)
        if tensor.is_cuda:
            with ring.on_comm_stream(tensor.device) as (stream, _):  # after the compute that wrote the inputs
                issue(hop)
                event = stream.record_event()
            for t in (*sends, *recvs):
                t.record_stream(stream)
            return Pending(self.stats, op.phase, k, event=event, device=stream.device_index)

        posted = ring.posted
        if posted is not None and posted.done():
            posted = ring.posted = None
        if posted is None and not ring.executor.queued and device_ready() is None:
            # Nothing of this ring in flight or queued: issue it here, now (no hand-over to the ring's thread)
            handle = issue(hop, wait=False)
            ring.posted = Posted(handle, op.phase, k)
            return Pending(self.stats, op.phase, k, future=ring.posted)

        def run() -> None:
            issue(hop)

        return Pending(self.stats, op.phase, k, future=ring.submit(after_posted(ring, run)))
