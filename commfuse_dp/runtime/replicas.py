"""HSDP: the gradient shards of fused parameters averaged across the model's copies (``CommFuseConfig.replicate``).

[Note: the replica exchange]
With R copies of N ranks each, a fused layer's rings run inside its copy (the shard group) and leave on each rank
its shard of the gradient summed over the copy, divided by N·R (``Engine.divide_factors``). What such a shard
still lacks is the other copies' sums: ranks holding the same shard in each copy (a replicate group) add theirs.
Only the contributions since the last exchange may cross, never what ``.grad`` held before (an accumulation over
steps without ``zero_grad`` would count it R times). So every synchronised contribution to a fused parameter's
gradient crosses the copies on its own, and only the sums go into ``.grad``:
- a fused group's gradient ring crosses as soon as it lands: a bucketed ring reduce-scatter and all-gather per
  dtype over the replicate group, on that group's own ring, beside the rest of the backward. On CPU the landing is
  handed to the replicate ring's thread as soon as its last hop is requested (``after``): that thread waits for
  the hop, completes the shard and sums it, so a host running ahead of its compute (beside a GPU, or the bench's
  emulated one) does not hold it back. On CUDA the same happens on the replicate ring's stream (``after_event``):
  it waits for the compute enqueued so far and for the last hop's event, then completes the shard and sums it;
  the host goes on at once. Landings are handed over and completed in
  request order, the same on every rank, and their ring tags are drawn on the compute thread, so every rank of a
  replicate group runs the same exchanges in the same order.
- a ring embedding's or weight read's gradient that autograd would put into ``.grad`` is kept *pending*; under
  ``no_sync`` it stays pending until the synchronised backward (the shard group sums it even then), so
  accumulation crosses the replicas once, as DeepSpeed's MiCS does.
When the backward ends (an autograd final callback, ``StepState._end_of_backward``, before the non-finite check),
and only when gradient sync is on, the pending shards start their exchange (in the order the parameters were
registered at ``shard()``), every exchange is waited for, and each parameter's sum is added into ``.grad`` once,
in registration order; its post-accumulate-grad hooks run then, once (a tied table gets its lm_head's and its
embedding's parts, added first). Under ``no_sync`` nothing crosses. A gradient that must go back through autograd
(``torch.autograd.grad``, a tensor hook) is exchanged at once instead (``exchange_now``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ..feedback import Residuals
from ..ring.all_reduce import residual_shape, ring_all_reduce
from ..ring.topology import get_ring


class Replicas:
    """HSDP's replica exchange (module docstring): each fused parameter's gradient shard summed over the
    replicate group, the copies of the model, while the backward goes on; ``exchange`` puts them in place."""

    def __init__(self, group: dist.ProcessGroup, ring_kwargs: dict[str, float], reduce_format: str = "exact",
                 format_block: int = 2048, error_feedback: bool = False, residuals: Residuals | None = None) -> None:
        self.group, self.ring_kwargs = group, ring_kwargs
        # narrow formats ([Note: the replica all-reduce]): the 2-D parameters' shards cross in ``reduce_format``,
        # summed in float32 by each part's owner, and the sums come back encoded once, the owner decoding its own
        # too, so every copy holds the same sum; with ``error_feedback`` what encoding lost of a contribution is
        # added to the next step's (a residual per exchange in ``feedback_dtype``, named by the parameters it carries)
        self.reduce_format, self.format_block, self.error_feedback = reduce_format, format_block, error_feedback
        self.residuals = residuals if residuals is not None else Residuals()
        self.ring = get_ring(group, caller="shard (replicate group)")
        self._index: dict[int, int] = {}  # id(parameter) -> registration order (the exchange's order)
        self._pending: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}
        # exchanges started, in order: each a call that waits for it and returns [(summed flat, [(param, numel,
        # shape)])]
        self._inflight: list = []
        self.on_stream = 0  # CUDA: landings completed on the replicate ring's stream (``after_event``)

    @property
    def size(self) -> int:
        return self.ring.size

    def track(self, params) -> None:
        """The fused parameters whose gradients cross the replicas, in an order every rank shares."""
        for p in params:
            self._index.setdefault(id(p), len(self._index))

    def add(self, param: nn.Parameter, local_grad: torch.Tensor) -> None:
        """A synchronised contribution to ``param``'s local gradient shard, not yet summed over the replicas."""
        entry = self._pending.get(id(param))
        if entry is None:
            self._pending[id(param)] = (param, local_grad)
        else:
            entry[1].add_(local_grad)

    def drop(self) -> None:
        """Forget the pending contributions and the exchanges in flight (a step that raised: its window is lost,
        as the no-sync partials)."""
        self._pending.clear()
        self._inflight.clear()

    def send(self, contributions: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
        """Start summing a fused group's landed gradient shards over the replicate group now, on the replicate
        ring (its thread on CPU, its stream on CUDA), so that the exchange overlaps the rest of the backward;
        ``exchange`` waits for it. Only what this landing brought crosses here, never the pending entries: which
        of those exist when a landing completes depends on timing, and every rank of the replicate group must
        start the same exchanges in the same order (landings complete in request order, the same everywhere)."""
        for flat, entries in self._by_dtype(contributions):
            summed, work = self._summed(flat, "the gradients of the fused layers", async_op=True,
                                        narrow=self._narrow(entries), key=_key(entries))

            def done(work=work, summed=summed, entries=entries) -> list:
                work.wait()
                return [(summed, entries)]

            self._inflight.append(done)

    def after(self, finish, dtypes) -> None:
        """CPU: on the replicate ring's thread, in order with the exchanges before it, run ``finish()`` (it waits
        for a fused group's last gradient hop and returns ``[(param, shard)]``) and sum those shards over the
        replicate group there. The compute thread goes on; ``exchange`` waits for it. ``dtypes``: the gradient
        dtypes the shards may have; the ring tags of their exchanges are drawn here, on the compute thread, so that
        every rank pairs them in the same order as the exchanges it starts itself (gloo matches by tag)."""
        what = "the gradients of the fused layers"
        kinds = [(d, narrow) for d in sorted(set(dtypes), key=str)
                 for narrow in ((False, True) if self.reduce_format != "exact" else (False,))]
        tags = {kind: (self.ring.next_tag(), self.ring.next_tag()) for kind in kinds}

        def job() -> list:
            done = []
            for flat, entries in self._by_dtype(finish()):
                narrow = self._narrow(entries)
                done.append((self._summed(flat, what, tags=tags[(flat.dtype, narrow)], narrow=narrow,
                                          key=_key(entries))[0], entries))
            return done

        self._inflight.append(self.ring.submit(job).result)

    def after_event(self, finish, event: torch.cuda.Event, buffers: list[torch.Tensor]) -> None:
        """CUDA: enqueue ``finish()`` (it completes a fused group's gradient shard from ``buffers``) and the sum of
        its shards over the replicate group on the replicate ring's stream, after the compute enqueued so far and
        the last gradient hop (``event``, on the shard ring's stream). The compute stream goes on; ``exchange``
        makes it wait. Called on the compute thread in request order, so the ring tags are drawn in order."""
        with self.ring.on_comm_stream(buffers[0].device, after=event) as (stream, _):  # after the last piece
            self.send(finish())
        for t in buffers:  # freed by the compute thread when the layer's backward is gone
            t.record_stream(stream)
        self.on_stream += 1

    def exchange(self, accumulate) -> None:
        """Sum what is still pending over the replicate group (ring embeddings' and weight reads' gradients, and
        no-sync windows' contributions), wait for the exchanges started by ``send``, and hand each parameter's
        sum to ``accumulate(param, shard)`` once, in registration order (its hooks run once)."""
        pending = sorted(self._pending.values(), key=lambda e: self._index.get(id(e[0]), len(self._index)))
        self._pending = {}
        self.send(pending)
        inflight, self._inflight = self._inflight, []
        totals: dict[int, tuple[nn.Parameter, torch.Tensor]] = {}
        for done in inflight:
            for summed, entries in done():
                if summed.is_cuda:  # made on the replicate ring's stream, read below on the current one
                    summed.record_stream(torch.cuda.current_stream(summed.device))
                at = 0
                for param, numel, shape in entries:
                    part = summed[at:at + numel].view(shape)
                    at += numel
                    if id(param) in totals:
                        totals[id(param)][1].add_(part)
                    else:
                        totals[id(param)] = (param, part)
        for param, grad in sorted(totals.values(), key=lambda e: self._index.get(id(e[0]), len(self._index))):
            accumulate(param, grad)

    def _by_dtype(self, contributions: list[tuple[nn.Parameter, torch.Tensor]]) -> list[tuple[torch.Tensor, list]]:
        """Per dtype (in a fixed order; with a narrow ``reduce_format``, 1-D and larger parameters apart): the shards
        in one flat buffer, and ``(param, numel, shape)`` of each."""
        by_dtype: dict[tuple, list[tuple[nn.Parameter, torch.Tensor]]] = {}
        narrows = self.reduce_format != "exact"
        for param, grad in contributions:
            by_dtype.setdefault((str(grad.dtype), narrows and param.dim() >= 2), []).append((param, grad))
        return [(torch.cat([g.reshape(-1) for _, g in by_dtype[k]]), [(p, g.numel(), g.shape) for p, g in by_dtype[k]])
                for k in sorted(by_dtype)]

    def _narrow(self, entries: list) -> bool:
        return self.reduce_format != "exact" and entries[0][0].dim() >= 2

    def exchange_now(self, grad: torch.Tensor, what: str) -> torch.Tensor:
        """``grad`` summed over the replicate group (a gradient that goes back through autograd)."""
        return self._summed(grad.reshape(-1), what, narrow=self.reduce_format != "exact" and grad.dim() >= 2
                            )[0].view_as(grad)

    def _summed(self, flat: torch.Tensor, what: str, async_op: bool = False, tags: tuple[int, int] = (None, None),
                narrow: bool = False, key: tuple | None = None):
        """``flat`` summed over the replicate group (``ring_all_reduce``): the sum and, with ``async_op``, the work to
        wait for before reading it (else None). ``tags``: of its two ring ops (default: drawn now). ``narrow``: in
        ``reduce_format``; ``key``: whose error-feedback residual it uses (none: no feedback)."""
        residual = None
        if narrow and self.error_feedback and key is not None and self.reduce_format != "exact":
            name = "copies:" + "-".join(str(self._index.get(pid, "x")) for pid in key)  # (registration order)
            residual = self.residuals.get(name, residual_shape(flat.numel(), self.size), flat.device)
        return ring_all_reduce(flat, self.group, reduce_format=self.reduce_format, format_block=self.format_block,
                               narrow=narrow, async_op=async_op, tags=tags, residual=residual,
                               label=f"{what} across the model's copies (HSDP)", **self.ring_kwargs)


def _key(entries: list) -> tuple:
    """An exchange's identity from one step to the next: the parameters it carries, in order."""
    return tuple(id(param) for param, _, _ in entries)

def autograd_grad(engine, param: nn.Parameter, node, grad: torch.Tensor, what: str) -> torch.Tensor | None:
    """What a ring embedding's or weight read's backward returns for ``param``'s local shard ``grad`` (``node``: the
    parameter's AccumulateGrad node, seen at the forward). Without HSDP: ``grad``. With HSDP, where autograd would
    put it into ``.grad`` (a backward that reaches the parameter, no tensor hook on it): kept pending (None is
    returned); otherwise summed across the copies now when gradients sync."""
    replicas = engine.replicas
    if replicas is None:
        return grad
    try:
        into_grad = node is not None and not param._backward_hooks and torch._C._will_engine_execute_node(node)
    except RuntimeError:  # torch.autograd.grad: autograd refuses the question for leaves; nothing is accumulated
        into_grad = False
    if into_grad:
        replicas.add(param, grad.detach().clone())
        return None
    return replicas.exchange_now(grad, what) if engine.requires_grad_sync else grad


def grad_node(local: torch.Tensor):
    """The AccumulateGrad node of the DTensor parameter whose ``to_local()`` is ``local`` (None without grad)."""
    return local.grad_fn.next_functions[0][0] if local.grad_fn is not None else None
