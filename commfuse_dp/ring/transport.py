"""One hop: start the sends to ``next`` and the receives from ``prev``, then wait for them.

This is the whole transport interface: ``handle = start_hop(ring, sends, recvs, ...)`` and ``handle.wait()``,
called for every hop of the fused layers and the collectives by ``issue`` in ``ring/issue.py`` alone.

Backends:
- CPU + gloo: ``ProcessGroup.send/recv`` (the direct calls cost ~35% less host time per hop than
  ``batch_isend_irecv``); gloo runs them on its own threads while this thread computes. ``wait()`` blocks the
  host, because gloo offers no other way to know the bytes landed, and it does so with a deadline of
  ``timeout_s`` per hop, so a dead or stalled peer raises ``RingCommError`` instead of hanging.
- CUDA + NCCL: ``batch_isend_irecv`` issued on the ring's communication stream; ``wait()`` only makes the
  current stream wait (no host synchronisation). A dead peer is then reported by NCCL's own watchdog, which
  uses the process group's timeout.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from itertools import repeat

import torch
import torch.distributed as dist

from .topology import Ring

Observer = Callable[[str, str, int], None]
_OBSERVERS: list[Observer] = []


@contextlib.contextmanager
def observe_ring(callback: Observer) -> Iterator[None]:
    """Call ``callback(event, op, k)`` for every hop (``k``: its index in its ring), and for the fused layers'
    compute pieces, ``"compute_begin"`` and ``"compute"`` (the piece ended), reported through ``notify``. A hop
    (``ring/issue.py``) reports ``"start"`` when it is requested, on the thread requesting it (a collective's hops
    all at once when it is called; ``op``: the fused ring's phase, or ``all_gather`` / ``reduce_scatter``);
    ``"issued"`` and ``"landed"`` around its issue and its bytes' arrival on the thread that works it (CPU: the
    ring's thread, or the caller of a synchronous collective); ``"wait"`` and ``"done"`` around compute's wait for
    it (a collective's: once, with its last hop's index). For schedule tests and timelines."""
    _OBSERVERS.append(callback)
    try:
        yield
    finally:
        _OBSERVERS.remove(callback)


def watched() -> bool:
    """Whether anything observes the rings' events (``observe_ring``): callers skip building what they would
    report otherwise. The one way, with ``bytes_watched``, that code outside this module asks."""
    return bool(_OBSERVERS)


def notify(event: str, op: str, k: int) -> None:
    for callback in _OBSERVERS:
        callback(event, op, k)


Sender = Callable[[str, str, int, int, str], None]
_SENDERS: list[Sender] = []


@contextlib.contextmanager
def observe_sent(callback: Sender) -> Iterator[None]:
    """Call ``callback(what, op, k, nbytes, fmt)`` when a hop, or a collective's hops at once (``k``: its last
    hop's index), is requested: ``what`` the layer or unit it belongs to, ``op`` as ``observe_ring`` reports it,
    ``nbytes`` what this rank sends in it, ``fmt`` the dtype on the wire (``"encoded"`` for a narrow format's
    bytes, [Note: narrow formats]). Reported just before the hop's ``"start"`` (timelines, ``record_timeline``)."""
    _SENDERS.append(callback)
    try:
        yield
    finally:
        _SENDERS.remove(callback)


def bytes_watched() -> bool:
    """Whether anything observes the bytes each hop sends (``observe_sent``)."""
    return bool(_SENDERS)


def notify_sent(what: str, op: str, k: int, nbytes: int, dtype: torch.dtype) -> None:
    fmt = "encoded" if dtype == torch.uint8 else str(dtype).replace("torch.", "")
    for callback in _SENDERS:
        callback(what, op, k, nbytes, fmt)


class RingCommError(RuntimeError):
    """A hop failed: a peer died, stopped answering within the timeout, or the ring broke earlier. ``op``: the ring's
    phase or collective, ``k``: the hop's index in its ring (from 0), ``peer``: the global rank it waited on."""

    def __init__(self, message: str, *, op: str, k: int, peer: int | None, reason: str) -> None:
        super().__init__(message)
        self.op, self.k, self.peer, self.reason = op, k, peer, reason


class HopHandle:
    """The in-flight part of one hop: the works of its sends and receives."""

    __slots__ = ("ring", "sends", "recvs", "op", "k", "hops", "deadline", "timeout_s", "cuda", "label",
                 "send_to", "recv_from")

    def __init__(self, ring: Ring, sends: list, recvs: list, op: str, k: int, hops: int,
                 timeout_s: float, cuda: bool, label: object = None, send_to: Sequence[int] | None = None,
                 recv_from: Sequence[int] | None = None) -> None:
        self.ring, self.sends, self.recvs = ring, sends, recvs
        self.send_to, self.recv_from = send_to, recv_from  # group ranks per work; None: ring.next / ring.prev
        self.op, self.k, self.hops, self.label = op, k, hops, label
        self.timeout_s, self.cuda = timeout_s, cuda
        self.deadline = time.monotonic() + timeout_s

    def wait(self, observed: bool = True) -> None:
        """CPU: block until the hop's bytes have landed (or raise by the deadline). CUDA: order the current
        stream after the hop, without blocking the host. ``observed``: report it to ``observe_ring``
        (``ring/issue.py`` reports the hops it issues itself: requested, issued, waited for)."""
        observed = observed and bool(_OBSERVERS)
        if observed:
            notify("wait", self.op, self.k)
        if self.cuda:
            for work in self.recvs:
                work.wait()
            for work in self.sends:
                work.wait()
        else:
            self._wait_host()
        if observed:
            notify("done", self.op, self.k)

    def completed(self) -> bool:
        """CPU: whether every work of the hop has completed (never blocks; an error is raised by ``wait``)."""
        return all(work.is_completed() for works in (self.recvs, self.sends) for work in works)

    def _wait_host(self) -> None:
        ring = self.ring
        # The last tenth of the timeout (at most 10 s) is kept for asking the peers where they are (_where_peers).
        until = self.deadline - min(0.1 * self.timeout_s, 10.0)
        # Receives first: they are what the next piece of compute needs; a send completes when the peer
        # has posted the matching receive.
        for works, peers, direction in ((self.recvs, self.recv_from or repeat(ring.prev), "receive from"),
                                        (self.sends, self.send_to or repeat(ring.next), "send to")):
            for work, peer in zip(works, peers):
                try:
                    if work.is_completed():  # landed (or failed: wait raises its error at once)
                        work.wait()
                    else:
                        work.wait(timedelta(seconds=max(until - time.monotonic(), 1e-3)))
                except RuntimeError as err:
                    raise self._failure(err, peer, direction) from err

    def _failure(self, err: Exception, peer: int, direction: str) -> RingCommError:
        text = str(err)
        if "Timed out" in text or "timed out" in text or "Timeout" in text:
            reason = "timeout"
            what = (f"no answer within timeout_s={self.timeout_s:g}s (the peer stopped, hangs, or is slower "
                    f"than the timeout allows)")
        elif "closed" in text or "reset" in text or "Broken pipe" in text or "crash" in text:
            reason = "peer lost"
            what = "the connection was lost (the peer process died or exited)"
        else:
            reason = "error"
            what = f"failed: {text.splitlines()[0] if text else type(err).__name__}"
        here = self.ring.peer_name(self.ring.rank)
        message = (f"commfuse ring {self.op}: hop {self.k + 1} of {self.hops}, {direction} "
                   f"{self.ring.peer_name(peer)}: {what}. This rank is {here}")
        if self.ring.broken is None:  # the first failure: say where this rank is and ask where the peers are
            where = str(self.label) if self.label is not None else f"a bucketed ring {self.op} (FSDP2 unit)"
            message += f", in {where}"
            if reason in ("timeout", "peer lost"):  # a peer that raised first has said where it was, then left
                patience = self.deadline - time.monotonic() if reason == "timeout" else 1.0
                message += _where_peers(self.ring, where, (peer,), patience)
        message += ("; check that peer's log. The process group cannot be used after this error.")
        self.ring.broken = message
        return RingCommError(message, op=self.op, k=self.k,
                             peer=dist.get_global_rank(self.ring.group, peer), reason=reason)


def start_hop(ring: Ring, sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor], *,
              tag: int, op: str, k: int, hops: int, timeout_s: float, label: object = None,
              observed: bool = True, send_to: Sequence[int] | None = None,
              recv_from: Sequence[int] | None = None) -> HopHandle:
    """Start one hop, hop ``k`` of the ring's ``hops``: every tensor in ``sends`` goes to ``ring.next``, every
    tensor in ``recvs`` is filled from ``ring.prev``. Tensors must be contiguous and stay untouched until ``wait()``
    returns. On CUDA the caller must be inside ``ring.on_comm_stream(device)``. ``label``: what this
    hop belongs to (a fused layer's ``RingOp``), named in errors. ``observed``: as for ``HopHandle.wait``.
    ``send_to`` / ``recv_from``: a group rank per tensor instead (a direct exchange: the small collectives of
    ``collectives.py`` send to every peer in one round)."""
    if ring.broken is not None:
        raise RingCommError(f"commfuse ring {op}: the ring broke earlier and cannot be used: {ring.broken}",
                            op=op, k=k, peer=None, reason="broken")
    if observed and _OBSERVERS:
        notify("start", op, k)
    tensor = sends[0] if sends else recvs[0]
    to = send_to if send_to is not None else repeat(ring.next)
    source = recv_from if recv_from is not None else repeat(ring.prev)
    if tensor.is_cuda:
        p2p = [dist.P2POp(dist.isend, t, group=ring.group, group_peer=p) for t, p in zip(sends, to)]
        p2p += [dist.P2POp(dist.irecv, t, group=ring.group, group_peer=p) for t, p in zip(recvs, source)]
        works = dist.batch_isend_irecv(p2p)
        return HopHandle(ring, works[:len(sends)], works[len(sends):], op, k, hops, timeout_s, True, label,
                          send_to, recv_from)
    pg = ring.group
    handle = HopHandle(ring, [], [], op, k, hops, timeout_s, False, label, send_to, recv_from)
    tag = tag if ring.tagged else 0
    # Receives first: a gloo send moves its bytes once the receiver has posted the receive, and the notice that
    # it has then leaves ahead of this rank's own outgoing bytes instead of queueing behind them.
    for works, tensors, peers, post, direction in ((handle.recvs, recvs, source, pg.recv, "receive from"),
                                                   (handle.sends, sends, to, pg.send, "send to")):
        for t, peer in zip(tensors, peers):
            try:  # gloo raises here already when the peer's connection is gone
                works.append(post([t], peer, tag))
            except RuntimeError as err:
                raise handle._failure(err, peer, direction) from err
    return handle


def _where_peers(ring: Ring, where: str, peers: tuple[int, ...], patience_s: float) -> str:
    """After a timeout: publish where this rank is (and whom it waits on) in the default store and read where
    ``peers`` said they were when they timed out too (ranks that call different fused layers time out within
    moments of each other). Waits up to ``patience_s`` (what is left of the hop's timeout) for them; returns a
    sentence for the error message."""
    try:
        store = dist.distributed_c10d._get_default_store()
        prefix = f"commfuse/where/{getattr(ring.group, 'group_name', 'group')}/"
        # Also whom this rank waits on: a rank further along the ring, waiting on this one, then names the rank
        # that stopped (a chain: rank 3 waits on rank 2, which waits on rank 1 that stopped early).
        waiting = " and ".join(ring.peer_name(peer) for peer in peers)
        store.set(prefix + str(ring.rank), f"{where}, waiting on {waiting}")
        patience = timedelta(seconds=max(patience_s, 0.05))
        said = []
        for peer in peers:
            name = ring.peer_name(peer)
            try:
                store.wait([prefix + str(peer)], patience)
                said.append(f"{name} was in {store.get(prefix + str(peer)).decode()}")
            except RuntimeError:
                said.append(f"{name} did not say where it was within {patience.total_seconds():g}s (it may be "
                            f"dead, have stopped early, or be blocked outside the rings: in a barrier or another "
                            f"collective of the process group)")
    except Exception as err:  # the store is only a help for the message; never hide the real failure
        return f" (could not ask the peers where they were: {type(err).__name__})"
    lockstep = ("; ranks that run different layers at the same point (a data-dependent module, a config or model "
                "that differs between ranks) or different numbers of steps (uneven inputs: a rank that stopped "
                "calling the model early) break the lockstep the rings need")
    return "; " + "; ".join(said) + lockstep
