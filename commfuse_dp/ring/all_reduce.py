"""The sum of a gradient shard over the model's copies (HSDP), on the rings: ``ring_all_reduce``, and
``RingReplicaGroup``, the process group FSDP2's units all-reduce with when their collectives run on the rings.

[Note: the replica all-reduce]
A flat buffer is summed over the R ranks of a replicate group (the ranks that hold the same shard in each copy of
the model) as a ring reduce-scatter into R parts followed by a ring all-gather of the sums (each rank sends
2 (R-1) / R of the buffer, as NCCL's ring all-reduce does). In a narrow ``reduce_format`` (``wire.py``) only the
segments of 2-D and larger parameters narrow, and they cross apart from the rest: each rank's contribution to a
part is encoded once and sent to the part's owner, which sums the contributions in float32 (one rounding per
contribution, never a re-rounded partial sum), then encodes the sum once for the all-gather, its own copy decoded
from the same bytes, so every copy holds bitwise the same sum. With ``error_feedback`` what encoding lost of a
contribution is kept (float32, one row per part) and added to the next step's before it is encoded.

[Note: FSDP2's replica all-reduce on the rings]
``fully_shard`` on a 2-D mesh ``(replicate, shard)`` reduce-scatters a unit's gradients over the shard group and then
all-reduces the unit's shard over the replicate group with ``dist.all_reduce(reduce_output, group=...)``, which on
a GPU runs on FSDP2's all-reduce stream beside the rest of the backward and on CPU (gloo) blocks the thread that
computes until the bytes have crossed. ``use_ring_collectives`` gives such a unit a ``RingReplicaGroup`` as the
group of that call (FSDP2 reads it from the unit's mesh information; the parameters stay DTensors on the mesh
they were sharded on). Its ``allreduce`` sums the buffer as above and returns no work, so that c10d waits for
nothing (a backend that returns none has synchronised itself):
- CUDA: the exchange is ordered on the replicate ring's stream after FSDP2's all-reduce stream, which waits for it
  (stream semantics, as NCCL's all-reduce).
- CPU, where FSDP2 reads the sum at once (a gradient to accumulate into, a hook, a cast, a divide after the sum,
  accumulation with ``set_requires_all_reduce(False)`` before): the exchange runs here, and is complete on return.
- CPU, where FSDP2 leaves the sum unread until the backward ends (the unit's reduce-scatter was deferred,
  ``fsdp_comm.DeferredReductions``): it runs on the replicate ring's thread after that reduce-scatter, beside the
  backward's compute, and the backward's last autograd callback waits for it, as FSDP2's ``finalize_backward``
  makes the compute stream wait for its all-reduce stream.
The unit's reduce-scatter tells the group what comes (``expect``): the tensor it just wrote, its segments, and the
work to wait for. The ring tags of every exchange are drawn on the thread that calls ``allreduce``, in FSDP2's
post-backward order, the same on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..feedback import Residuals
from ..stats import StatsRecorder
from ..wire import RowFormat
from .collectives import ring_all_gather, ring_reduce_scatter
from .issue import OFF, Pending
from .topology import get_ring

Segments = Sequence[tuple[int, int, bool]]  # (start, numel, narrow) covering a flat buffer in order


def ring_all_reduce(flat: torch.Tensor, group: dist.ProcessGroup, *, reduce_format: str = "exact",
                    format_block: int = 2048, narrow: bool = False, async_op: bool = False,
                    tags: tuple[int | None, int | None] = (None, None), residual: torch.Tensor | None = None,
                    label: object = None, **ring_kwargs) -> tuple[torch.Tensor, dist.Work | None]:
    """``flat`` summed over ``group`` ([Note: the replica all-reduce]): a ring reduce-scatter of ``flat`` padded to a
    multiple of the group's size, then a ring all-gather of the sums. Returns the sum (a view of a new buffer) and,
    with ``async_op``, the work to wait for before reading it (else None). ``narrow``: the whole of ``flat`` in
    ``reduce_format``; ``residual``: its error feedback, ``(R, parts)`` (``residual_shape``; float32 or bfloat16,
    ``CommFuseConfig.feedback_dtype``). ``tags``: the
    two ring ops' (default: drawn now)."""
    r = dist.get_world_size(group)
    part = -(-flat.numel() // r)
    padded = flat.new_zeros(part * r)
    padded[:flat.numel()].copy_(flat)
    mine = padded.new_empty(part)
    wire = RowFormat(reduce_format, flat.dtype, part, [(0, part, True)], format_block) \
        if narrow and reduce_format != "exact" and part and r > 1 else None
    ring_reduce_scatter(mine, padded, group, label=label, async_op=async_op, tag=tags[0], wire=wire,
                        residual=residual if wire is not None and wire.lossy else None, **ring_kwargs)
    # the ops of one ring run in the order they were issued (its one thread on CPU, its stream on CUDA)
    work = ring_all_gather(padded, mine, group, label=label, async_op=async_op, tag=tags[1], wire=wire,
                           **ring_kwargs)
    return padded[:flat.numel()], work


def residual_shape(numel: int, ranks: int) -> tuple[int, int]:
    """The error-feedback residual of ``ring_all_reduce`` of ``numel`` elements over ``ranks`` ranks."""
    return ranks, -(-numel // ranks)


class _Expected(NamedTuple):
    """What a unit's reduce-scatter announced for the all-reduce that follows it (``RingReplicaGroup.expect``)."""

    tensor: torch.Tensor  # the reduce-scatter's output, which FSDP2 all-reduces next
    segments: Segments  # its parameters' segments, narrow where 2-D
    owner: object  # whose error-feedback residuals these are (the unit's reduce-scatter)
    after: dist.Work | None  # the deferred reduce-scatter to wait for first (None: it is complete)
    deferred: object  # the ``DeferredReductions`` the exchange joins when it runs behind the backward


class RingReplicaGroup(dist.ProcessGroup):
    """The replicate group as FSDP2's HSDP all-reduce sees it ([Note: FSDP2's replica all-reduce on the rings]):
    ``allreduce`` sums over the copies on the replicate group's ring, in ``reduce_format``; nothing else is served
    (FSDP2 calls nothing else on it)."""

    def __init__(self, group: dist.ProcessGroup, reduce_format: str = "exact", format_block: int = 2048,
                 error_feedback: bool = False, ring_kwargs: dict | None = None,
                 recorder: StatsRecorder | None = None, residuals: Residuals | None = None) -> None:
        super().__init__(dist.get_rank(group), dist.get_world_size(group))
        self.group = group
        self.ring = get_ring(group, caller="FSDP2's HSDP all-reduce")
        self.reduce_format, self.format_block, self.error_feedback = reduce_format, format_block, error_feedback
        self.ring_kwargs = dict(ring_kwargs or {})
        self.recorder = recorder
        self._expected: _Expected | None = None
        self.residuals = residuals if residuals is not None else Residuals()
        self.exchanges = 0  # all-reduces served (tests; describe)
        self.deferred_exchanges = 0  # of which ran behind the backward (CPU)

    def getBackendName(self) -> str:  # noqa: N802 - c10d's name
        return "commfuse-rings"

    def __repr__(self) -> str:
        return f"RingReplicaGroup(rank={self.rank()}, size={self.size()}, reduce_format={self.reduce_format!r})"

    def expect(self, tensor: torch.Tensor, segments: Segments, owner: object, after: dist.Work | None = None,
               deferred=None) -> None:
        """The next ``allreduce`` is of ``tensor`` (a unit's reduce-scatter output), laid out in ``segments``;
        ``after``: a deferred reduce-scatter it must follow, and ``deferred`` the reductions the backward's end
        waits for, which the exchange then joins."""
        self._expected = _Expected(tensor, tuple(segments), owner, after, deferred)

    def allreduce(self, tensors: list[torch.Tensor], opts) -> None:
        """Sum (``ReduceOp.SUM``) or average (``AVG``) ``tensors[0]`` over the copies; returns no work (module
        Note). A tensor no reduce-scatter announced (not FSDP2's) is summed exactly, here."""
        if len(tensors) != 1:
            raise ValueError(f"{self!r}: all-reduces one tensor at a time, got {len(tensors)}")
        flat = tensors[0]
        op = opts.reduceOp  # (a ReduceOp: compared on its side, ``RedOpType == ReduceOp`` is False)
        average = op == dist.ReduceOp.AVG
        if not average and not op == dist.ReduceOp.SUM:
            raise ValueError(f"{self!r}: op {getattr(op, 'op', op)} is not supported; FSDP2 passes SUM or AVG")
        expected, self._expected = self._expected, None
        if expected is None or expected.tensor is not flat:
            expected = _Expected(flat, ((0, flat.numel(), False),), None, None, None)
        parts = self._parts(expected)
        tags = [(self.ring.next_tag(), self.ring.next_tag()) for _ in parts]  # (drawn here, in call order)
        self.exchanges += 1

        def run() -> None:
            if expected.after is not None:
                expected.after.result()  # (the unit's reduce-scatter, on the shard ring's thread)
            self._sum(flat, parts, tags, expected.owner, average)

        if expected.after is None or flat.is_cuda:
            run()  # (CUDA: stream-ordered, the host goes on)
            return None
        self.deferred_exchanges += 1
        hops = 2 * (self.size() - 1) * len(parts)
        expected.deferred.add(Pending(self.recorder or OFF, "all_reduce", hops - 1, future=self.ring.submit(run),
                                      count=hops))
        return None

    def _parts(self, expected: _Expected) -> list[tuple[bool, list[tuple[int, int]]]]:
        """The buffer's runs that cross together: its narrow segments, and the rest (the whole buffer in the exact
        format)."""
        if self.reduce_format == "exact":
            return [(False, [(0, expected.tensor.numel())])]
        runs: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
        for start, numel, narrow in expected.segments:
            if numel:
                runs[bool(narrow)].append((start, numel))
        return [(narrow, runs[narrow]) for narrow in (True, False) if runs[narrow]]

    def _sum(self, flat: torch.Tensor, parts, tags, owner, average: bool) -> None:
        """Each part summed over the copies (``ring_all_reduce``) and written back; the average divided once."""
        label = "a gradient shard across the model's copies (HSDP)"
        for (narrow, runs), tag in zip(parts, tags):
            whole = len(runs) == 1 and runs[0] == (0, flat.numel())
            source = flat if whole else torch.cat([flat[a:a + n] for a, n in runs])
            residual = self._residual(owner, narrow, source) if narrow else None
            summed, _ = ring_all_reduce(source, self.group, reduce_format=self.reduce_format,
                                        format_block=self.format_block, narrow=narrow, tags=tag, residual=residual,
                                        label=label, **self.ring_kwargs)
            if whole:
                flat.copy_(summed)
                continue
            at = 0
            for a, n in runs:
                flat[a:a + n].copy_(summed[at:at + n])
                at += n
        if average:
            flat.div_(self.size())

    def _residual(self, owner, narrow: bool, source: torch.Tensor) -> torch.Tensor | None:
        if not self.error_feedback or owner is None:
            return None
        name = f"{owner.feedback_name}:copies:{'narrow' if narrow else 'exact'}"  # (the unit's place in the model)
        return self.residuals.get(name, residual_shape(source.numel(), self.size()), source.device)

