"""Mixed precision that holds whoever replaces ``forward``: autocast entered by the sharded root's own hooks.

accelerate applies ``mixed_precision`` (``TrainingArguments(bf16=True)``) by wrapping ``model.forward`` in autocast
and in a conversion of the outputs to fp32 (``Accelerator.prepare_model``). A library that replaces
``model.forward`` after that wrapper was installed runs without it: TRL's ``SFTTrainer`` installs its fused LM head
(``add_fused_lm_head``) after ``Trainer.__init__``, where ``CommFuseCallback`` prepared the model, so bf16 was
silently lost. Under DDP the order is the other way round (accelerate wraps in ``train()``, after TRL's patch).

FSDP2's ``MixedPrecisionPolicy`` casts inside the module's hooks, so it holds whoever calls the module. This does
the same for autocast: a forward pre-hook on the sharded root enters a fresh autocast context and a forward hook
(``always_call=True``: also when the forward raises) leaves it, then converts the outputs as accelerate's wrapper
does. ``model(...)`` runs both whatever ``model.forward`` is by then.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch.nn as nn

from .handle import handle_of


def autocast_root(model: nn.Module, make_context: Callable[[], AbstractContextManager] | None,
                  convert_outputs: Callable[[Any], Any] | None = None) -> None:
    """Run every forward of ``model`` inside ``make_context()`` (a new context per call, e.g. ``lambda:
    torch.autocast("cuda", dtype=torch.bfloat16)``), and pass its outputs through ``convert_outputs`` (e.g.
    accelerate's ``convert_to_fp32``). Calling it again replaces the previous setting; ``None`` removes it."""
    state = handle_of(model, create=True)
    for hook in state.autocast_hooks:
        hook.remove()
    state.autocast_hooks = ()
    if make_context is None:
        return
    entered: list[AbstractContextManager] = []  # a stack: the root may be called again inside its own forward

    def enter(module: nn.Module, args) -> None:
        context = make_context()
        context.__enter__()
        entered.append(context)

    def leave(module: nn.Module, args, output):
        if not entered:  # an earlier pre-hook raised before ours ran
            return None
        entered.pop().__exit__(None, None, None)
        if convert_outputs is not None and output is not None:
            return convert_outputs(output)
        return None

    state.autocast_hooks = (model.register_forward_pre_hook(enter),
                            model.register_forward_hook(leave, always_call=True))
