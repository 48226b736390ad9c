"""The ring over a process group: who this rank sends to and receives from, and the per-group state.

Ranks here are *group* ranks (0 .. N-1 inside the group, also for a sub-group of the world); the global rank of a
peer is kept beside it for error messages. One ``Ring`` exists per process group (``get_ring``), so every caller
(collectives, FSDP2 adapters, fused layers) draws message tags from one counter: ops are matched between ranks by
the order in which they were *issued*, whichever thread later runs them.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from .fingerprint import StepFingerprint
from .worker import Job, RingWorker

_TAG_SPACE = 1 << 29  # one tag per ring operation, recycled far apart; tags from 2**29 up carry an op identity


class Ring:
    """Neighbours on one process group: ``next = rank + 1``, ``prev = rank - 1`` (mod N)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        # Weak: the registry below must not keep a process group (and gloo's worker threads) alive after
        # dist.destroy_process_group() (see ``group``).
        self._group = weakref.ref(group)
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.next = (self.rank + 1) % self.size
        self.prev = (self.rank - 1) % self.size
        self.global_next = dist.get_global_rank(group, self.next)
        self.global_prev = dist.get_global_rank(group, self.prev)
        self.peers = [(self.rank + j) % self.size for j in range(1, self.size)]  # ring order: next first, prev last
        self.backend = str(dist.get_backend(group))
        self._seq = 0
        self._lock = threading.Lock()
        self._executor: RingWorker | None = None
        self.posted = None  # a hop issued at once by the thread that requested it, maybe in flight (issue.py)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self.broken: str | None = None  # the first failure; every later op raises it at once
        # gloo's messages carry the op's tag; COMMFUSE_RING_TAGS=0 sends all with tag 0, paired by order alone as
        # NCCL pairs them (ring/fingerprint.py then still finds ranks that diverged)
        self.tagged = os.environ.get("COMMFUSE_RING_TAGS", "1") != "0"
        self.fingerprint = StepFingerprint(self)  # what this rank issued in the running step (ring/fingerprint.py)
        self.owners = 0  # ring-op owners of every model sharded on this ring, numbered in one sequence (step.py)

    @property
    def group(self) -> dist.ProcessGroup:
        """The process group. Held weakly: a strong reference from the ``_RINGS`` value to its own key kept every
        group that ever ran a ring alive until interpreter exit, so ``dist.destroy_process_group()`` could not
        stop gloo's worker threads; a gloo worker that then frees a finished work while the interpreter finalizes
        aborts the process (``terminate called without an active exception``)."""
        group = self._group()
        if group is None:
            raise RuntimeError("commfuse ring: its process group was destroyed (dist.destroy_process_group); "
                               "create the group again and use the new one")
        return group

    def next_tag(self) -> int:
        """A tag for one ring operation. Called on the issuing thread, in the same order on every rank."""
        with self._lock:
            self._seq += 1
            return self._seq % _TAG_SPACE

    def shard_held(self, k: int) -> int:
        """Index of the shard in this rank's buffer after k all-gather hops: ``(r - k) mod N``."""
        return (self.rank - k) % self.size

    def shard_reduced(self, k: int) -> int:
        """Index of the shard whose partial sum this rank adds to at reduce-scatter hop k: ``(r - k - 1) mod N``."""
        return (self.rank - k - 1) % self.size

    @property
    def executor(self) -> RingWorker:
        """One worker thread per group for async ring ops on CPU: ops run in the order they were issued."""
        if self._executor is None:
            with self._lock:
                if self._executor is None:
                    self._executor = RingWorker(self, "commfuse-ring")
        return self._executor

    def submit(self, run: Callable[[], object]) -> Job:
        """Run ``run`` on the ring thread after the ops submitted before it (the future holds what it returns);
        under an emulated accelerator (``set_device_clock``), not before the compute issued so far on the calling
        thread has ended."""
        ready = device_ready()
        if ready is None:
            return self.executor.submit(run)

        def gated():
            wait_until(ready)
            return run()

        return self.executor.submit(gated)

    def comm_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The CUDA stream hops run on for ``device`` (compute stays on the caller's current stream)."""
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)
        return stream

    @contextmanager
    def on_comm_stream(self, device: torch.device, after: torch.cuda.Event | None = None
                       ) -> Iterator[tuple[torch.cuda.Stream, torch.cuda.Stream]]:
        """CUDA: run the block with this ring's communication stream for ``device`` current, ordered after the
        work enqueued so far on the current stream (it wrote what the block sends) and after ``after``; yields
        (communication stream, the stream that was current on ``device``). What ``torch.cuda.stream`` does, with
        the device named: ``torch.cuda.stream`` and ``current_stream()`` with no device ask ``is_available()``
        and the current device on every call (29 us of host time a call on the H200, 14 % of the host's time in a
        fused step at 8 ranks). ``set_stream`` makes the stream's device current too: the device that was
        current before is made current again on the way out."""
        here = torch.cuda.current_device()
        if device.index is None:
            device = torch.device("cuda", here)
        current = torch.cuda.current_stream(device.index)
        stream = self.comm_stream(device)
        stream.wait_stream(current)
        if after is not None:
            stream.wait_event(after)
        home = None if here == device.index else torch.cuda.current_stream(here)
        torch.cuda.set_stream(stream)
        try:
            yield stream, current
        finally:
            torch.cuda.set_stream(current)
            if home is not None:
                torch.cuda.set_stream(home)

    def peer_name(self, group_rank: int) -> str:
        g = dist.get_global_rank(self.group, group_rank)
        return f"rank {g}" if g == group_rank else f"rank {g} (group rank {group_rank})"

    def __repr__(self) -> str:
        return f"Ring(rank={self.rank}, size={self.size}, prev={self.prev}, next={self.next}, backend={self.backend})"


_DEVICE_CLOCK: Callable[[], float | None] | None = None


def set_device_clock(clock: Callable[[], float | None] | None) -> None:
    """For an emulated accelerator (the bench's ``--compute emulated``, whose compute runs ahead of the host as a
    GPU's does): ``clock()`` is the ``time.perf_counter()`` at which the compute issued so far on the calling
    thread ends (None: no such compute on this thread). Ring work requested then does not start before it, as a
    CUDA communication stream waits for the compute stream's event. None: unset (the default)."""
    global _DEVICE_CLOCK
    _DEVICE_CLOCK = clock


def device_ready() -> float | None:
    """When ring work requested now on this thread may start (``set_device_clock``), or None: at once."""
    return _DEVICE_CLOCK() if _DEVICE_CLOCK is not None else None


def wait_until(when: float | None) -> None:
    if when is not None:
        ahead = when - time.perf_counter()
        if ahead > 0:
            time.sleep(ahead)


_RINGS: weakref.WeakKeyDictionary[dist.ProcessGroup, Ring] = weakref.WeakKeyDictionary()


def get_ring(group: dist.ProcessGroup | None = None, *, caller: str = "commfuse_dp", op: str | None = None) -> Ring:
    """The ``Ring`` of ``group`` (default: the world), checking that the group can be used from this rank;
    ``caller`` names who asks, in its errors (``op``: its former name, deprecated)."""
    if op is not None:
        warnings.warn("get_ring(op=...) is deprecated: write get_ring(caller=...)", DeprecationWarning, stacklevel=2)
        caller = op
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{caller}: torch.distributed is not initialised. Call torch.distributed.init_process_group(...) first "
            f"(torchrun, accelerate launch and commfuse-dp launch set up the environment it reads).")
    if group is None:
        group = dist.group.WORLD
    if group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(group) < 0:
        raise ValueError(f"{caller}: this process (global rank {dist.get_rank()}) is not a member of the process "
                         f"group it was given; pass a group that contains it")
    ring = _RINGS.get(group)
    if ring is None:
        ring = _RINGS[group] = Ring(group)
        if "gloo" in ring.backend:
            register_exit_drain()
    return ring


EXIT_DRAIN_S = 0.1


def drain_gloo_workers(seconds: float = EXIT_DRAIN_S) -> None:
    """Release the GIL for ``seconds`` so that gloo's worker threads can free the works they finished.

    [Note: the abort at exit] A gloo worker thread (``ProcessGroupGloo::runLoop``) frees a finished work just after
    ``wait()`` returned in Python; the work's tensors have Python objects, so freeing them takes the GIL
    (``TensorImpl::decref_pyobject``). If the main thread has meanwhile begun finalizing the interpreter (the
    script ended), ``take_gil`` ends the worker with ``pthread_exit``; its forced unwind through the work's
    ``noexcept`` destructor calls ``std::terminate``: "terminate called without an active exception", SIGABRT,
    after all the training was done (a core dump shows ``runLoop -> ~AsyncAllreduceWork -> decref_pyobject ->
    gil_scoped_acquire -> take_gil -> pthread_exit -> std::terminate``). Plain torch + gloo does it too, without
    DeepSpeed or commfuse. ``dist.destroy_process_group()`` would prevent it (gloo's destructor joins its workers
    with the GIL released) but only for groups nobody else holds: a DeepSpeed engine (its ZeRO-3 parameters'
    ``ds_process_group``, its optimizer) keeps its groups alive until the interpreter is torn down, and most
    scripts (``trl sft``, transformers' examples, a Trainer script) never call it. So at exit (an ``atexit``
    handler that :func:`register_exit_drain` adds when the first ring on a gloo group is made, before the
    interpreter starts finalizing) and in DeepSpeed's ``shutdown``, the main thread sleeps briefly: a worker
    waiting for the GIL to free its last works gets it now, while the interpreter is whole. A collective still in
    flight at exit (issued and never waited) is not covered."""
    time.sleep(seconds)


_exit_drain_registered = False


def register_exit_drain() -> None:
    """Run :func:`drain_gloo_workers` at interpreter exit (once per process, whoever asks first)."""
    global _exit_drain_registered
    if not _exit_drain_registered:
        atexit.register(drain_gloo_workers)
        _exit_drain_registered = True
