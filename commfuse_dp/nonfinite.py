"""The non-finite gradient check of a sharded model (``CommFuseConfig.nonfinite_grads``).

After every backward that synchronises gradients, once every gradient shard is final, each rank looks for NaN
or infinity in its local gradient shards and the ranks all-gather one flag each on the model's ring. Then every
rank does the same thing: nothing (all finite), raise ``FloatingPointError`` (``"raise"``), or drop every
gradient (``"skip"``: ``.grad = None``, so ``optimizer.step()`` changes nothing) with a warning.

When the shards are final. The check runs as an autograd final callback that is queued from another final
callback. The autograd engine runs the final callbacks of a backward in the order they were queued, including
those queued while the callbacks run (``GraphTask::exec_post_processing`` loops over a list that may grow; checked
with torch 2.13, and by ``tests/test_nonfinite.py``), and runs none of them when the backward raised. The first
callback is queued from the first tensor hook of the backward on an output of the root module, or from the first
fused layer's backward; by the time it runs, the backward has queued every other callback of its own:
FSDP2's root post-backward callback (``FSDPState._root_post_backward_final_callback``, queued from its
pre-backward hook on the same outputs: it finishes the root unit's reduce-scatter and waits for every
reduce-scatter on CUDA) and ``StepState._end_of_backward`` (the fused layers' deferred last hops, the slicing
schedule's background reduce-scatters). The check, queued then, runs after all of them. So it also runs when
nothing is fused (FSDP2 units only), and it never runs after a backward that raised: it is in lockstep on every
rank that ran the same backward.

Who agrees. Every rank whose gradient shards may differ: the world, or, under HSDP without TP, the ranks of one
model copy (its shard group, inside a node where a copy is a node). The copies hold the same shards bit for bit
once the backward's replica exchange has summed them (one sum, sent to every copy), so each copy reaches the
decision every other copy reaches, and no copy waits at the step's end for another across the links between
nodes (the peer, FSDP2's HSDP, has no such wait). Beside TP the TP ranks hold different parts: every rank agrees.

What is checked: the local shards of every parameter's ``.grad``. A gradient is summed over the ranks before it
is split into shards, so a NaN from one rank's batch shows up in the shards of every rank; a rank named in the
error is a rank whose shards hold non-finite values, not necessarily the rank whose data made them.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .ring.collectives import ring_all_gather

logger = logging.getLogger("commfuse_dp")

_NAMES_SHOWN = 5


class NonfiniteCheck:
    """Installed by ``shard()`` unless ``nonfinite_grads="off"``; reached through ``StepState.nonfinite``."""

    def __init__(self, model: nn.Module, steps) -> None:
        self.steps = steps
        self.engine = steps.engine
        self.mode = self.engine.config.nonfinite_grads
        self.model = model
        self.fp16_params = (self.engine.config.param_dtype is torch.float16
                            or any(p.dtype is torch.float16 for _, p in self.params))
        self.fp16_forward = False  # the last forward of the root ran under fp16 autocast
        self._arm = OncePerBackward(self._queue_check)
        self._told_fp16 = False
        self.ring, self.one_copy = _agreeing_ring(model, self.engine)

    @property
    def params(self) -> list[tuple[str, torch.Tensor]]:
        # Read at each use: a model sharded on the meta device gets new parameters (and its device) from
        # to_empty() after this check was installed.
        return list(self.model.named_parameters())

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters(), torch.empty(0)).device

    # -- when: once per backward, after every other final callback ------------------------------------------

    def watch(self, output) -> None:
        """After a forward of the root that records a graph: hook the outputs, so that the backward that goes
        through them arms the check."""
        device_type = self.device.type
        self.fp16_forward = (torch.is_autocast_enabled(device_type)
                             and torch.get_autocast_dtype(device_type) is torch.float16)
        for t in _grad_tensors(output):
            t.register_hook(self._on_output_grad)

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        self.arm()

    def arm(self) -> None:
        """Inside a backward: make sure this backward ends with the check (once per backward)."""
        self._arm()

    def _queue_check(self) -> None:
        # Runs as a final callback; what it queues runs after every callback this backward queued already.
        torch.autograd.Variable._execution_engine.queue_callback(self.check)

    # -- what --------------------------------------------------------------------------------------------

    def check(self) -> None:
        if not self.engine.requires_grad_sync:
            return  # an accumulation micro-batch: the shards are not final; the synced backward checks them
        mode = self.mode
        if mode == "auto":
            if self.fp16_params or self.fp16_forward:
                if not self._told_fp16:
                    self._told_fp16 = True
                    logger.info("commfuse_dp: fp16 training: the non-finite gradient check stands aside "
                                "(nonfinite_grads='auto'); a GradScaler handles infinities there. Set "
                                "nonfinite_grads='raise' or 'skip' to check anyway")
                return
            mode = "raise"
        ring, stats = self.ring, self.engine.stats  # (every copy decides alike: _agreeing_ring)
        params = self.params
        grads = [(name, p.grad) for name, p in params if p.grad is not None]
        local = [g.to_local() if isinstance(g, DTensor) else g for _, g in grads]
        flags = torch.zeros(ring.size, dtype=torch.uint8, device=self.device)
        mine = flags[ring.rank:ring.rank + 1]
        if local:
            mine.copy_(_any_nonfinite(local))
        step = self.steps.step
        ring_all_gather(flags, mine, ring.group, timeout_s=self.engine.config.timeout_s, stats=stats,
                        label=f"the non-finite gradient check after the backward of step {step}")
        bad = [r for r, flag in enumerate(flags.tolist()) if flag]  # the host waits for the flags here
        if not bad:
            return
        names = [name for (name, _), g in zip(grads, local) if g.numel() and bool(_any_nonfinite([g]))] \
            if ring.rank in bad else []
        bad_ranks = [dist.get_global_rank(ring.group, r) for r in bad]
        where = (f"of the {ring.size} ranks of this model copy (HSDP's copies hold the same gradient shards)"
                 if self.one_copy else f"of {ring.size}")
        if mode == "skip":
            for _, p in params:
                p.grad = None
            stats.skipped += 1
            logger.warning("commfuse_dp: step %d: non-finite gradients on rank(s) %s%s; the step's gradients were "
                           "dropped on every rank (nonfinite_grads='skip'), so optimizer.step() changes nothing "
                           "(%d step(s) skipped so far)", step, bad_ranks, _on_this_rank(dist.get_rank(), names),
                           stats.skipped)
            return
        raise FloatingPointError(
            f"commfuse_dp: step {step}: the gradients are non-finite (NaN or inf) on rank(s) {bad_ranks} "
            f"{where}{_on_this_rank(dist.get_rank(), names)}. A gradient is summed over all ranks before it is "
            f"sharded, so one rank's bad batch shows up on every rank. Lower the learning rate (or warm it up), "
            f"check the data of this step (empty or all-padding sequences, labels out of range), train in bf16 or "
            f"fp32 instead of fp16 (or use a GradScaler), or set CommFuseConfig(nonfinite_grads='skip') to drop "
            f"such steps and go on. Every rank raised this; the .grad of the parameters are left as they are: "
            f"zero them (optimizer.zero_grad()) before the next step")


def _agreeing_ring(model: nn.Module, engine):
    """(the ring whose ranks agree on the check, whether it is one HSDP copy's): the shard group's under HSDP
    without TP, the world's beside TP, else the engine's world ring (which is the world)."""
    from .handle import handle_of
    from .ring import get_ring

    handle = handle_of(model)
    if handle is not None and handle.tp is not None:
        return get_ring(dist.group.WORLD, caller="the non-finite gradient check"), False
    if engine.replicas is not None:
        return engine.ring, True
    return engine.world_ring, False


def _on_this_rank(rank: int, names: list[str]) -> str:
    if not names:
        return ""
    more = f" and {len(names) - _NAMES_SHOWN} more" if len(names) > _NAMES_SHOWN else ""
    return f"; on rank {rank}: {', '.join(names[:_NAMES_SHOWN])}{more}"


def _any_nonfinite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """A 0-dim bool tensor: does any of ``tensors`` hold a NaN or an infinity? No host sync. On CUDA one max-abs
    reduction per tensor in one foreach call (``_foreach_norm`` with ord=inf propagates NaN); on the CPU each
    tensor's ``aminmax`` (NaN propagates to both, an infinity shows in one): torch's CPU ``_foreach_norm`` with
    ord=inf took 5.9 ms over an 8-rank shard of the bench's model (2.1 M floats, one core) against 0.5 ms, in the
    step's tail after the last gradient landed."""
    by_kind: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        if t.numel():
            by_kind[(t.dtype, t.device)].append(t)
    flags = [~(torch.stack(torch._foreach_norm(ts, float("inf"))) if ts[0].is_cuda else
               torch.stack([torch.stack(t.aminmax()) for t in ts])).isfinite().all() for ts in by_kind.values()]
    if not flags:
        return torch.zeros((), dtype=torch.bool, device=tensors[0].device)
    return torch.stack([f.to(flags[0].device) for f in flags]).any()


class OncePerBackward:
    """Calling it inside a backward queues ``callback`` as an autograd final callback of that backward, once
    however often it is called there; outside a backward it does nothing."""

    def __init__(self, callback) -> None:
        self.callback = callback
        self.task: int | None = None  # the graph task whose callback is queued already

    def __call__(self, *_) -> None:
        task = torch._C._current_graph_task_id()
        if task == -1 or task == self.task:
            return
        self.task = task
        torch.autograd.Variable._execution_engine.queue_callback(self._run)

    def _run(self) -> None:
        self.task = None
        self.callback()


def _grad_tensors(output) -> Iterable[torch.Tensor]:
    """The tensors in a forward's output (tensors, tuples, lists, dicts, HF ``ModelOutput``) that record grad."""
    if isinstance(output, torch.Tensor):
        if output.requires_grad:
            yield output
    elif isinstance(output, dict):  # ModelOutput is an OrderedDict
        for value in output.values():
            yield from _grad_tensors(value)
    elif isinstance(output, (tuple, list)):
        for value in output:
            yield from _grad_tensors(value)
