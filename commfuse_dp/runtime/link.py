"""The link scheduler: one queue of ring steps per rank, worked in the order they were requested.

Every ring step of a fused layer, a ring embedding or a gathered weight read is a request here
(``Link.step``); the compute that needs its bytes waits on what the request returns (``Pending.wait``). The
schedule (``runtime/schedule.py``) decides only *when* to request: a lockstep layer requests step k beside compute
piece k; an elastic one requests the steps of coming layers ahead of their compute, within the memory budget.

[Note: the link]
- Order. Requests are made on the compute thread, in program order, so every rank makes the same requests in the
  same order (the lockstep contract). The link works them in that order, one at a time; a request's ``before``
  (the add of the partial sum received by the step before it, on a reduce-scatter ring) runs on the link just
  before the step is issued. Nothing here decides by timing, so the order never differs between ranks.
- Requests are made only when their inputs are ready (a gradient partial is requested after the piece that
  wrote it), so the link never waits for compute: it waits only for its peers.
- CPU + gloo: the link is the ring's worker thread (``Ring.executor``), the one that also runs the asynchronous
  bucketed collectives (FSDP2 units' prefetched all-gathers, the slicing schedule's gathers and reduce-scatters):
  one queue for all of them. ``Pending.wait`` blocks the host until the step landed, bounded by ``timeout_s``.
- CUDA + NCCL: a request is enqueued on the ring's communication stream at once, after an event recorded on the
  compute stream (its inputs are written); ``Pending.wait`` makes the compute stream wait for the step's event;
  the host never waits. Tensors used on the communication stream are marked with ``record_stream`` so that the
  caching allocator does not reuse them before the step ran. Waiting time is measured by CUDA events on the
  compute stream and read at the end of the step. (Written for NCCL and never run here: no GPU.)
"""

from __future__ import annotations

import time
from collections.abc import Callable
import torch

from ..ring import transport
from ..ring.topology import Ring
from ..ring.worker import Job
from ..stats import StatsRecorder


class Pending:
    """One requested ring step; ``wait()`` from the compute side."""

    __slots__ = ("link", "future", "event", "device", "op", "k", "requested", "waited")

    def __init__(self, link: Link, op: str, k: int, future: Job | None = None,
                 event: torch.cuda.Event | None = None, device: int | None = None) -> None:
        self.link, self.future, self.event, self.op, self.k = link, future, event, op, k
        self.device = device  # CUDA: the device index whose current stream waits for ``event``
        self.requested = time.perf_counter()
        self.waited = False

    def done(self) -> bool:
        """Whether the step landed (never blocks)."""
        if self.future is not None:
            return self.future.done()
        return self.event is None or self.event.query()

    def wait(self) -> None:
        """CPU: block until the step's bytes landed and re-raise its error. CUDA: order the current stream after
        the step (the host goes on). Once: a second call returns at once."""
        if self.waited:
            return
        self.waited = True
        if transport._OBSERVERS:
            transport.notify("wait", self.op, self.k)
        stats = self.link.stats
        began = time.perf_counter()
        if self.future is not None:
            self.future.result()  # the step's own deadline (timeout_s) bounds this
        elif self.event is not None:
            stream = torch.cuda.current_stream(self.device)
            if stats.enabled:
                before = stream.record_event(torch.cuda.Event(enable_timing=True))
                stream.wait_event(self.event)
                stats.cuda_wait(before, stream.record_event(torch.cuda.Event(enable_timing=True)))
            else:
                stream.wait_event(self.event)
        if stats.enabled:
            stats.ring_step(self.requested, began, time.perf_counter())
        if transport._OBSERVERS:
            transport.notify("done", self.op, self.k)

    def settle(self) -> None:
        """Wait for a step of an aborted step; a broken ring has said so already, where it broke."""
        try:
            if self.future is not None:
                self.future.result()
        except transport.RingCommError:
            pass


class Link:
    """The link scheduler of one ring (module docstring): ``step`` requests one ring step, worked in request
    order; every request is folded into the ring's fingerprint (``ring/fingerprint.py``)."""

    def __init__(self, ring: Ring, timeout_s: float, stats: StatsRecorder) -> None:
        self.ring, self.timeout_s, self.stats = ring, timeout_s, stats

    def step(self, sends: list[torch.Tensor], recvs: list[torch.Tensor], op, k: int, steps: int,
             before: Callable[[], None] | None = None, direct: bool = False,
             send_to: list[int] | None = None, recv_from: list[int] | None = None) -> Pending:
        """Request one ring step: ``sends`` go to ``ring.next``, ``recvs`` are filled from ``ring.prev``.
        ``op`` is the ``RingOp`` (tag and name); ``k`` the step's index in its ring of ``steps``. The tensors
        must stay untouched (``recvs``: unread) until the step is waited for. ``direct``: a direct exchange
        instead, send ``i`` to and receive ``i`` from ``ring.peers[i]`` (``exchange.gather``), or from the group
        ranks ``send_to[i]`` / ``recv_from[i]`` where given (``exchange.swap``)."""
        if transport._OBSERVERS:
            transport.notify("start", op.phase, k)
        ring = self.ring
        tensor = sends[0] if sends else recvs[0]
        # compared across the ranks (ring/fingerprint.py); a direct exchange's sizes may differ (embedding rows)
        ring.fingerprint.add(op, k, steps, 0 if direct or send_to is not None else tensor.numel())

        def issue() -> transport.StepHandle:
            if before is not None:
                before()
            peers = ring.peers if direct else None
            return transport.start_step(ring, sends, recvs, tag=op.tag, op=op.phase, step=k, steps=steps,
                                        timeout_s=self.timeout_s, label=op, observed=False,
                                        send_to=peers if send_to is None else send_to,
                                        recv_from=peers if recv_from is None else recv_from)

        if tensor.is_cuda:
            with ring.on_comm_stream(tensor.device) as (stream, _):  # after the compute that wrote the inputs
                issue().wait(observed=False)  # orders the communication stream after the NCCL work; the host goes on
                event = stream.record_event()
            for t in (*sends, *recvs):
                t.record_stream(stream)
            return Pending(self, op.phase, k, event=event, device=stream.device_index)

        def run() -> None:
            if transport._OBSERVERS:
                transport.notify("issued", op.phase, k)
            issue().wait(observed=False)
            if transport._OBSERVERS:
                transport.notify("landed", op.phase, k)

        return Pending(self, op.phase, k, future=ring.submit(run))
