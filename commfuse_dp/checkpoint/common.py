"""What the checkpoint modules share: which model is sharded, the model inside a wrapper, this rank."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..handle import engine_of, handle_of


def is_sharded(model: Any) -> bool:
    """True for a model (or a wrapper with ``.module``) that :func:`commfuse_dp.shard` sharded."""
    return engine_of(model) is not None


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    own = handle_of(model, through_wrapper=False)
    return model if own is not None and own.engine is not None else getattr(model, "module", model)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier(group=None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)

