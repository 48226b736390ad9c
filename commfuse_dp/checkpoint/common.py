"""What the checkpoint modules share: which model is sharded, the model inside a wrapper, this rank."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def is_sharded(model: Any) -> bool:
    """True for a model (or a wrapper with ``.module``) that :func:`commfuse_dp.shard` sharded."""
    return getattr(model, "_commfuse_engine", None) is not None \
        or getattr(getattr(model, "module", None), "_commfuse_engine", None) is not None


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model if getattr(model, "_commfuse_engine", None) is not None else getattr(model, "module", model)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier(group=None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)
