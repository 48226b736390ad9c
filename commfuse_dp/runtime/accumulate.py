"""``accumulate_grad``: how a reduced gradient shard reaches a fused parameter's ``.grad``."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def accumulate_grad(param: torch.nn.Parameter, local_grad: torch.Tensor) -> None:
    """Add ``local_grad`` (this rank's shard) into the DTensor parameter's ``.grad``, then run its
    post-accumulate-grad hooks, as autograd's AccumulateGrad would (FSDP2 does the same for its sharded
    parameters). Tensor hooks (``register_hook``) never reach here: ``accumulates`` returns such gradients
    through autograd."""
    if param.grad is None:
        if local_grad.dtype == param.dtype and local_grad.shape == param._local_tensor.shape:
            # The parameter's own spec (mesh, placements, global shape, stride, dtype): what FSDP2 does for its
            # sharded gradients (``_from_local_no_grad``), without ``from_local``'s checks and autograd node.
            param.grad = DTensor(local_grad, param._spec, requires_grad=False)
        else:
            param.grad = DTensor.from_local(local_grad, param.device_mesh, param.placements, run_check=False,
                                            shape=param.shape, stride=param.stride())
    else:
        param.grad.to_local().add_(local_grad)
    for hook in (getattr(param, "_post_accumulate_grad_hooks", None) or {}).values():
        hook(param)
