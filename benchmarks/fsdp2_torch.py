"""The bench's ``fsdp2_torch``: stock FSDP2 with torch's own collectives, scheduled as on a GPU, and no code of
commfuse_dp, so that the rings' own gain shows apart from fusing's (the same units and schedule as ``fsdp2_overlap``,
whose collectives are the rings).

- torchtitan's units: the embedding; each decoder layer, the last one not resharded after the forward; the final
  norm with the lm_head, not resharded after the forward; the root.
- all-gathers asynchronous (``_set_unshard_async_op(True)``: gloo returns a ``Work`` that FSDP2 waits for at its
  copy-out), each unit prefetching the next in the forward (``set_modules_to_forward_prefetch``), FSDP2's own
  one-ahead prefetch in the backward, and the backward's first all-gather issued as the backward begins;
- reduce-scatters issued asynchronously (``dist.reduce_scatter_tensor(..., async_op=True)``) and waited for at
  the backward's end, as a GPU's reduce-scatter stream is. FSDP2 on CPU would wait for each at once.

Only for a model whose reduce-scatter output FSDP2 leaves unread until the backward ends: fp32, no gradient
accumulation (a ``.grad`` to add into), no HSDP: the bench's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup


class AsyncReduceScatter(ReduceScatter):
    """torch's reduce-scatter, issued asynchronously; every one is waited for by the backward's last callback."""

    def __init__(self, pending: list) -> None:
        self.pending = pending

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op=dist.ReduceOp.AVG, async_op=False):
        if op != dist.ReduceOp.AVG:
            raise RuntimeError(f"fsdp2_torch: FSDP2 passed {op}; the bench defers AVG reductions only")
        if not self.pending:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self.pending.append(dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group,
                                                       async_op=True))
        return None

    def _end_of_backward(self) -> None:
        pending, self.pending[:] = list(self.pending), []
        for work in pending:
            work.wait()


def build(model: torch.nn.Module) -> torch.nn.Module:
    """Shard the bench's Llama (``bench_model.build_model``) so, in place, and return it."""
    layers = list(model.model.layers)
    units = [model.model.embed_tokens, *layers, model.model.norm]
    fully_shard(model.model.embed_tokens)
    for layer in layers:
        fully_shard(layer, reshard_after_forward=layer is not layers[-1])
    fully_shard([model.model.norm, model.lm_head], reshard_after_forward=False)
    fully_shard(model)
    pending: list = []
    for unit, following in zip(units, units[1:] + [None]):
        unit._set_unshard_async_op(True)
        unit.set_custom_reduce_scatter(AsyncReduceScatter(pending))
        if following is not None:
            unit.set_modules_to_forward_prefetch([following])

    def gather_for_backward(root, args, output) -> None:  # as the backward begins: the last unit resharded
        order = root._get_fsdp_state()._comm_ctx.post_forward_order

        def backward_begins(grads) -> None:
            for group in reversed(order):
                if not group.is_unsharded:
                    FSDPParamGroup._prefetch_unshard(group, "backward")
                    return

        if torch.is_grad_enabled() and output.loss is not None and output.loss.requires_grad:
            torch.autograd.graph.register_multi_grad_hook([output.loss], backward_begins, mode="any")

    model.register_forward_hook(gather_for_backward)
    return model
