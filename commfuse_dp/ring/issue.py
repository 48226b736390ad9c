"""Where every hop is requested, issued and waited for: the fused layers' hops and the collectives' alike.

A hop is one exchange on a ring: every rank sends a shard to its next neighbour and receives one from the previous;
a ring over N ranks takes N-1 of them. (A *step* is a training step.)

[Note: one place for a hop]
A hop passes three points, each of them here and nowhere else:
- *Requested*, on the thread that calls for it, in program order: folded into the ring's fingerprint
  (``ring/fingerprint.py``) and reported as ``"start"`` to ``observe_ring``. A hop of a fused layer, ring embedding
  or weight read is requested on its own (``Link.hop``, the link scheduler's ``runtime/link.py``); a bucketed
  collective (``ring/collectives.py``) requests all of its hops at once when it is called (``collective``), their
  sizes known from its wavefront before any of them runs.
- *Issued* by ``issue``, the one call of ``transport.start_hop``, on the worker that runs the hop: the ring's
  thread (CPU: the link's hops and the asynchronous collectives), the calling thread (a synchronous collective
  on CPU, and a link hop requested while nothing of its ring is in flight or queued: ``Posted``, which the
  ring's next job waits for first, ``after_posted``), or the host enqueueing onto the ring's communication stream
  (CUDA). On CPU it reports ``"issued"`` and ``"landed"`` around the hop.
- *Waited for* from the compute side by ``Pending.wait``: a link hop on its own, a collective once for all of its
  hops (its ``dist.Work`` is a ``RingWork`` around it; a synchronous one is waited for where it is called). The
  one timed wait: on CPU by the host's clock, on CUDA by two CUDA events around the compute stream's wait
  (``StatsRecorder.cuda_wait``, read at the end of the step), reported as ``"wait"`` and ``"done"``. The step
  statistics count every hop here (a collective adds its number of hops).
A collective's waits inside its own hop loop (each hop before the next, on its worker) are not compute waits:
they are neither timed nor counted. A collective that moves nothing (one rank, empty tensors) has no hop and
runs where it is called.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..stats import StatsRecorder
from . import transport
from .topology import Ring, device_ready, wait_until
from .worker import Job

OFF = StatsRecorder(enabled=False)  # for collectives whose caller keeps no step statistics


class Pending:
    """Hops requested on a ring (one of a fused layer, or all of a collective's); ``wait()`` from the
    compute side."""

    __slots__ = ("stats", "future", "event", "device", "run", "op", "k", "count", "requested", "waited")

    def __init__(self, stats: StatsRecorder, op: str, k: int, future: Job | Posted | None = None,
                 event: torch.cuda.Event | None = None, device: int | None = None,
                 run: Callable[[], None] | None = None, count: int = 1) -> None:
        self.stats, self.future, self.event, self.op, self.k = stats, future, event, op, k
        self.device = device  # CUDA: the device index whose current stream waits for ``event``
        self.run = run  # a synchronous collective on CPU: run by ``wait``, where it is waited for
        self.count = count  # hops it stands for
        self.requested = time.perf_counter()
        self.waited = False

    def done(self) -> bool:
        """Whether the hops landed (never blocks)."""
        if self.future is not None:
            return self.future.done()
        return self.event is None or self.event.query()

    def wait(self) -> None:
        """CPU: block until the hops' bytes landed and re-raise their error. CUDA: order the current stream after
        them (the host goes on). Once: a second call returns at once."""
        if self.waited:
            return
        self.waited = True
        if transport.watched():
            transport.notify("wait", self.op, self.k)
        stats = self.stats
        began = time.perf_counter()
        if self.future is not None:
            self.future.result()  # the hop's own deadline (timeout_s) bounds this
        elif self.event is not None:
            stream = torch.cuda.current_stream(self.device)
            if stats.enabled:
                before = stream.record_event(torch.cuda.Event(enable_timing=True))
                stream.wait_event(self.event)
                stats.cuda_wait(before, stream.record_event(torch.cuda.Event(enable_timing=True)))
            else:
                stream.wait_event(self.event)
        elif self.run is not None:
            self.run()
        if stats.enabled:
            stats.hop(self.requested, began, time.perf_counter(), self.count)
        if transport.watched():
            transport.notify("done", self.op, self.k)

    def settle(self) -> None:
        """Wait for a hop of an aborted step; a broken ring has said so already, where it broke."""
        try:
            if self.future is not None:
                self.future.result()
        except transport.RingCommError:
            pass


class Hop(NamedTuple):
    """One hop to issue (``issue``): the arguments of ``transport.start_hop``, and ``before``, run first on
    the worker that issues it (a received partial sum's add, a narrow contribution's encoding)."""

    ring: Ring
    sends: Sequence[torch.Tensor]
    recvs: Sequence[torch.Tensor]
    tag: int
    op: str  # the fused ring's phase, or the collective's kind
    k: int  # its index in its ring
    hops: int  # the ring's hops (N-1 on a ring of N ranks)
    timeout_s: float
    label: object
    send_to: Sequence[int] | None = None
    recv_from: Sequence[int] | None = None
    before: Callable[[], None] | None = None


def issue(hop: Hop, wait: bool = True) -> transport.HopHandle:
    """Issue one hop and wait for it on the worker running it (CPU: until its bytes landed; CUDA: the
    communication stream, current here, is ordered after it). ``wait=False``: return at once (``Posted``
    waits)."""
    observed = transport.watched() and not (hop.sends[0] if hop.sends else hop.recvs[0]).is_cuda
    if observed:
        transport.notify("issued", hop.op, hop.k)
    if hop.before is not None:
        hop.before()
    handle = transport.start_hop(hop.ring, hop.sends, hop.recvs, tag=hop.tag, op=hop.op, k=hop.k,
                                 hops=hop.hops, timeout_s=hop.timeout_s, label=hop.label, observed=False,
                                 send_to=hop.send_to, recv_from=hop.recv_from)
    if wait:
        handle.wait(observed=False)
        if observed:
            transport.notify("landed", hop.op, hop.k)
    return handle


class Posted:
    """A hop issued on the thread that requested it (CPU, the ring's thread idle and no other hop of the
    ring in flight: ``Link.hop``), as a ``Job`` of the ring's thread is seen: ``done()`` never blocks,
    ``result()`` waits for its bytes (its deadline bounds it) once, on whichever thread asks first, and raises
    its error on every call."""

    __slots__ = ("handle", "op", "k", "error", "landed", "lock")

    def __init__(self, handle: transport.HopHandle, op: str, k: int) -> None:
        self.handle, self.op, self.k = handle, op, k
        self.error: BaseException | None = None
        self.landed = False
        self.lock = threading.Lock()

    def done(self) -> bool:
        return self.landed or self.handle.completed()

    def result(self) -> None:
        with self.lock:
            if not self.landed:
                try:
                    self.handle.wait(observed=False)
                except BaseException as err:  # noqa: BLE001 - raised below, on every call
                    self.error = err
                self.landed = True
                if transport.watched():
                    transport.notify("landed", self.op, self.k)
        if self.error is not None:
            raise self.error


def after_posted(ring: Ring, run: Callable[[], object]) -> Callable[[], object]:
    """``run``, first waiting for the ring's hop issued at once and still in flight (``Ring.posted``), if any: the
    ring's thread works its jobs after it, as after its own (the link works one hop at a time, in request order)."""
    posted, ring.posted = ring.posted, None
    if posted is None or posted.done():  # (its own Pending still waits for it, and raises its error)
        return run

    def ordered():
        posted.result()
        return run()

    return ordered


def collective(ring: Ring, kind: str, tag: int, label: object, sizes: list[int], run: Callable[[], None],
               device: torch.device, async_op: bool, tensors: tuple[torch.Tensor, ...],
               stats: StatsRecorder | None, itemsize: int = 1, encoded: bool = False) -> dist.Work | None:
    """Request every hop of a bucketed collective (``sizes``: the elements of ``itemsize`` bytes each of its hops
    moves, in order; ``encoded``: bytes of a narrow format)
    and run ``run``, its hop loop, which issues them through ``issue``: on the ring's communication stream (CUDA),
    on the ring's thread (CPU, ``async_op``) or here. Returns a ``RingWork`` with ``async_op``, else waits for it.
    ``tensors``: what the loop reads and writes (CUDA: kept from the allocator until the stream is done)."""
    if not sizes:  # one rank, or nothing to move: no hop
        if device.type != "cuda":
            wait_until(device_ready())
        run()
        if not async_op or (ring.size == 1 and device.type != "cuda"):
            return None
        landed = Pending(OFF, kind, 0, count=0)  # a Work as before, with nothing to wait for
        landed.waited = True
        return RingWork(landed)
    ring.fingerprint.add_collective(kind, tag, label, sizes)
    last = len(sizes) - 1
    if transport.bytes_watched():
        transport.notify_sent(str(label) if label is not None else kind, kind, last, sum(sizes) * itemsize,
                              torch.uint8 if encoded else tensors[0].dtype)
    if transport.watched():
        for k in range(last + 1):
            transport.notify("start", kind, k)
    stats = stats if stats is not None else OFF
    if stats.enabled:
        stats.sent(sum(sizes) * itemsize)
    if device.type == "cuda":
        with ring.on_comm_stream(device) as (stream, _):  # after the compute that wrote the inputs
            run()
            event = stream.record_event()
        for t in tensors:  # the allocator must not hand their memory out before the ring stream is done with it
            t.record_stream(stream)
        pending = Pending(stats, kind, last, event=event, device=stream.device_index, count=len(sizes))
    elif async_op:
        pending = Pending(stats, kind, last, future=ring.submit(after_posted(ring, run)), count=len(sizes))
    else:
        wait_until(device_ready())  # an emulated accelerator's compute issued so far has ended (topology.py)
        pending = Pending(stats, kind, last, run=after_posted(ring, run), count=len(sizes))
    if async_op:  # the caller's wait(): compute until then overlaps it
        return RingWork(pending)
    pending.wait()
    return None


class RingWork(dist.Work):
    """An asynchronous collective: ``wait()`` is its ``Pending.wait`` (CPU: blocks until it ran on the ring's
    thread and re-raises its error, ``RingCommError`` and all, on every call; CUDA: the current stream waits for
    it, the host goes on). A ``Work`` made from a torch future by ``_create_work_from_future`` would return from
    ``wait()`` as if it had succeeded, and its output would be read as if it held the bytes."""

    def __init__(self, pending: Pending) -> None:
        super().__init__()
        self.pending = pending

    def wait(self, timeout: timedelta | None = None) -> bool:
        pending = self.pending
        if pending.waited and pending.future is not None:
            pending.future.result()  # waited for before: its error again, if it failed
        pending.wait()
        return True

    def is_completed(self) -> bool:
        return self.pending.done()

    def result(self) -> None:
        """Block until its hops ran, on any thread, and re-raise their error: a wait that is not the compute's (it
        is neither timed nor counted; ``wait`` still is)."""
        if self.pending.future is not None:
            self.pending.future.result()
