"""``StepFingerprint``: the hops a rank issued in a training step, compared across the ranks one step late.

[Note: the fingerprint of a step]
NCCL pairs point-to-point messages by their order alone, and so does gloo with the tags turned off
(``COMMFUSE_RING_TAGS=0``). Ranks that break the lockstep contract (a data-dependent layer order, a config that
differs) then exchange bytes between *different* hops of the same size and go on with wrong numbers, or hang
where the sizes differ. Each ``Ring`` keeps one fingerprint. While a step of a sharded model is open, every hop
requested on the ring is folded in where it is requested (``ring/issue.py``), on the requesting thread, in
program order:
- each hop of a fused ring, ring embedding or weight read, as the link takes it (``Link.hop``): the op's
  identity tag, its index in its ring, the ring's length in hops, and on a ring (not a direct exchange, whose sizes may
  differ between ranks) the elements a tensor moves;
- each hop of a bucketed collective on the shard ring (FSDP2 units, the slicing schedule, the non-finite check,
  0-d parameters), all of them when ``ring_all_gather`` / ``ring_reduce_scatter`` is called (``collective``): its
  kind, tag and label, the hop's index and the collective's number of hops, and the elements the hop moves.
  (HSDP's replica sums run on the replicate group's ring, which is not checked.)
A few integer operations a hop; a collective's label is hashed once per call.

When a step's backward ends (or, for a forward-only step, when the next one begins), its fingerprint and its
negation go into one asynchronous ``MAX`` all-reduce over the ring's group: equal on every rank exactly when the
largest equals the smallest. The result is read when the next step's backward ends (after forward-only steps,
when the step after next begins): a whole step later, so it has arrived and the host does not wait, and no new
point where the ranks meet is added. Which result is read where depends on the program's order alone, so every
rank reads the same one at the same point and a divergence raises on every rank alike, at most one step late. The
ranks then gather their request lists once, and the error names the first request that differs and what each rank
issued there.
"""

from __future__ import annotations

import zlib
from datetime import timedelta

import torch
import torch.distributed as dist

_MASK = (1 << 63) - 1
_PRIME = 0x100000001B3


class StepFingerprint:
    """The hops one rank issued in the running step (``add``), and the check of the previous step's against
    the other ranks' (``begin_step``, ``end_backward``)."""

    def __init__(self, ring) -> None:
        self.ring, self.timeout_s = ring, 1800.0
        self.value = 0
        self.requests: list[tuple] = []  # (op, k, hops, numel) of the running step
        self._checking: list[tuple] = []  # (step, requests, the reduced pair, waits until it has arrived)
        self.step = -1

    def add(self, op, k: int, hops: int, numel: int) -> None:
        """Fold one requested hop of a fused ring (``op``: its ``RingOp``) into the running fingerprint."""
        if self.step < 0:
            return  # no step of a sharded model is open: nothing is compared
        self.value = ((self.value ^ (op.tag << 20) ^ (k << 8) ^ hops ^ (numel << 30)) * _PRIME) & _MASK
        self.requests.append((op, k, hops, numel))

    def add_collective(self, kind: str, tag: int, label: object, sizes: list[int]) -> None:
        """Fold every hop of one bucketed collective (``kind``: all_gather / reduce_scatter; ``sizes``: the
        elements each hop moves) into the running fingerprint."""
        if self.step < 0:
            return
        name = zlib.crc32(f"{kind} {label}".encode())
        op, hops, value = (label, kind, tag), len(sizes), self.value
        head = (tag << 20) ^ (name << 24) ^ hops
        for k, numel in enumerate(sizes):
            value = ((value ^ head ^ (k << 8) ^ (numel << 30)) * _PRIME) & _MASK
            self.requests.append((op, k, hops, numel))
        self.value = value

    def begin_step(self, step: int, timeout_s: float) -> None:
        """A step begins: read the pending check (the previous step's, started when its backward ended), start the
        check of a previous step that had no backward, and begin folding this one."""
        self.timeout_s = timeout_s
        self.check(keep=1)
        self.close()
        self.step, self.value, self.requests = step, 0, []

    def end_backward(self) -> None:
        """The step's backward ended: read the previous step's check (a step ago: arrived unless a peer is gone),
        start this one's."""
        self.check(keep=0)
        self.close()

    def close(self) -> None:
        """Start comparing the running step's fingerprint across the ranks (asynchronously)."""
        if self.step < 0 or self.ring.size == 1:
            return
        device = self._device()
        pair = torch.tensor([self.value, -self.value], dtype=torch.int64, device=device)
        work = dist.all_reduce(pair, op=dist.ReduceOp.MAX, group=self.ring.group, async_op=True)
        if device.type == "cuda":  # into pinned host memory behind the all-reduce; read when its event has passed
            work.wait()  # orders the current stream after it; the host goes on
            host = torch.empty(2, dtype=torch.int64, pin_memory=True)
            host.copy_(pair, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._checking.append((self.step, self.requests, host, event.synchronize))
        else:
            self._checking.append((self.step, self.requests, pair,
                                   lambda: work.wait(timeout=timedelta(seconds=self.timeout_s))))
        self.step = -1

    def drop(self) -> None:
        """After a step that raised: its requests are not compared (the ranks may have stopped at different ones)."""
        self.value, self.requests, self.step = 0, [], -1

    def check(self, keep: int) -> None:
        """Read the pending checks but the newest ``keep``, waiting for them if need be (they were started a step or
        more ago), and raise if the ranks' fingerprints of a step differ. Which checks are read depends on the
        program's order alone, so every rank reads the same ones at the same point and raises there alike."""
        while len(self._checking) > keep:
            step, requests, pair, arrived = self._checking.pop(0)
            arrived()  # a step or more ago: at once, unless a peer is gone
            high, low = pair.tolist()
            if high != -low:
                self._checking.clear()
                raise RuntimeError(self._divergence(step, requests))

    def _divergence(self, step: int, requests: list[tuple]) -> str:
        mine = [_said(op, k, hops, numel) for op, k, hops, numel in requests]
        every: list[list[str] | None] = [None] * self.ring.size
        dist.all_gather_object(every, mine, group=self.ring.group)
        longest = max(len(r) for r in every)
        first = next(i for i in range(longest + 1)
                     if len({r[i] if i < len(r) else "nothing" for r in every}) > 1 or i == longest)
        said = "; ".join(f"{self.ring.peer_name(rank)}: {r[first] if first < len(r) else 'nothing'}"
                         for rank, r in enumerate(every))
        return (f"commfuse_dp: the ranks issued different hops in step {step}: request {first + 1} differs "
                f"({said}). Every rank must run the same fused layers in the same order (the lockstep contract); "
                f"a layer called data-dependently, or a model or config that differs between ranks, breaks it. Its "
                f"bytes were exchanged with another rank's different hop, so that step's numbers are wrong; "
                f"CommFuseConfig(exclude=[...]) keeps such a layer out of the fused path")

    def _device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if "nccl" in self.ring.backend else torch.device("cpu")


def _said(op, k: int, hops: int, numel: int) -> str:
    """One request, as the error names it: a fused ring's hop, or a collective's (``op`` = (label, kind, tag))."""
    if not hasattr(op, "phase"):
        label, kind, tag = op
        if hasattr(label, "phase"):  # a fused layer's RingOp (the slicing schedule)
            label = f"{label.name} {label.phase} (call {label.occurrence + 1})"
        return f"{label + ' ' if label is not None else ''}{kind} (tag {tag}), hop {k + 1} of {hops}, " \
               f"{numel} elements"
    size = f", {numel} elements a tensor" if numel else ""
    return f"{op.name} {op.phase} (call {op.occurrence + 1}), hop {k + 1} of {hops}{size}"
