"""``CommFuseHandle``: what commfuse_dp keeps on a model, in one attribute (``handle_of``).

``shard()`` gives a model its handle (engine, step state, what the ``"auto"`` settings chose, the modules it kept
out, error feedback's residuals, the hooks it installed); ``use_ring_collectives`` on a stock FSDP2 model gives it
one too, without an engine. Everything else reads it from there: ``handle_of(model)`` also looks through a
wrapper that holds the model as ``.module`` (accelerate, DeepSpeed)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

ATTRIBUTE = "_commfuse"


@dataclass(eq=False)
class CommFuseHandle:
    """What commfuse_dp keeps on one model."""

    engine: Any = None  # runtime.engine.Engine: shard()'s rings and config (None: not sharded by shard())
    steps: Any = None  # runtime.step.StepState: the step's state and schedule
    choice: Any = None  # planner.choose.Choice: what the "auto" settings became, and why
    excluded: dict[str, str] = field(default_factory=dict)  # modules kept off the fused path, and why
    residuals: Any = None  # feedback.Residuals: error feedback's, which checkpoints carry
    empty_weights: Any = None  # the hook refusing a forward before meta-device weights are loaded (meta.py)
    autocast_hooks: tuple = ()  # amp.py's forward hooks
    deferred_reductions: Any = None  # FSDP2 on rings: the reduce-scatters deferred to the backward's end
    backward_gather: Any = None  # FSDP2 on rings: the hook that gathers the root's weights for the backward
    batch_tokens: tuple | None = None  # (tokens, where from): what the Trainer integrations told the defaults
    attachments: list = field(default_factory=list)  # (who, backend) of every ring attachment (attach.py)
    tp: Any = None  # tp.parallelize.TensorParallel: the tensor-parallel group and what it split (tensor_parallel())


def handle_of(model: Any, *, create: bool = False, through_wrapper: bool = True) -> CommFuseHandle | None:
    """The handle of ``model`` (or, ``through_wrapper``, of the model a wrapper holds as ``.module``); with
    ``create``, ``model``'s own, made where it has none."""
    handle = vars(model).get(ATTRIBUTE) if hasattr(model, "__dict__") else None
    if handle is None and through_wrapper and not create:
        inner = getattr(model, "module", None)
        if isinstance(inner, nn.Module) and inner is not model:
            handle = vars(inner).get(ATTRIBUTE)
    if handle is None and create:
        handle = CommFuseHandle()
        object.__setattr__(model, ATTRIBUTE, handle)  # a plain attribute, whatever the model's __setattr__ does
    return handle


def engine_of(model: Any, *, through_wrapper: bool = True):
    """The engine ``shard()`` gave ``model`` (or, ``through_wrapper``, the model its wrapper holds), or None."""
    handle = handle_of(model, through_wrapper=through_wrapper)
    return handle.engine if handle is not None else None
