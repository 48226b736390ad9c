"""The naive reference of a sharded linear: plain collectives, unfused math.

The full weight is all-gathered with DTensor's own collective (``full_tensor``), the layer is one
``F.linear``, and autograd's backward of the all-gather is DTensor's reduce-scatter (a sum over ranks). Kept in the
tree so that the fused path is tested and measured against it (memory, numerics); never used for training.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor


def naive_sharded_linear(x: torch.Tensor, weight: DTensor, bias: DTensor | None = None,
                         transposed: bool = False) -> torch.Tensor:
    """``y = x Wᵀ + b`` (``x W + b`` for a ``(in, out)`` Conv1D weight) from row-sharded DTensor parameters.
    Gradients of ``weight``/``bias`` come out summed over ranks (not averaged)."""
    w = weight.full_tensor()
    b = bias.full_tensor() if bias is not None else None
    if transposed:
        y = x @ w
        return y + b if b is not None else y
    return F.linear(x, w, b)
