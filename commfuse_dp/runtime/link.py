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
- The request, its issue and its wait are the ring layer's (``Issuer.step``, ``issue``, ``Pending.wait`` in
  ``ring/issue.py``), the ones the bucketed collectives' steps go through too ([Note: one place for a ring
  step]): the link adds the order, not another way to issue or time a step.
"""

from __future__ import annotations

from ..ring.issue import Issuer, Pending

__all__ = ["Link", "Pending"]


class Link(Issuer):
    """The link scheduler of one ring (module docstring): ``step`` requests one ring step, worked in request
    order; every request is folded into the ring's fingerprint (``ring/fingerprint.py``). ``Link(ring, timeout_s,
    stats)``: ``Issuer``'s."""
