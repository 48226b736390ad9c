"""A model built on the meta device: where its shards are allocated, their allocation, the buffers recomputed, and
a forward refused until the weights are loaded (``commfuse_dp.checkpoint``)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .handle import handle_of

logger = logging.getLogger("commfuse_dp")


def materialise_device(requested: torch.device | str | None, mesh: DeviceMesh | None) -> torch.device:
    """Where a meta model's shards are allocated: ``requested``, else the mesh's device type, else the current
    CUDA device if there is one, else the CPU (a CUDA device without an index: the current one)."""
    if requested is not None:
        device = torch.device(requested)
    elif mesh is not None:
        device = torch.device(mesh.device_type)
    else:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "meta":
        raise ValueError("shard: device='meta' is where the model is already; pass the device its shards should be "
                         "allocated on (device='cuda' or 'cpu')")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _refuse_empty_weights(module: nn.Module, args) -> None:
    raise RuntimeError("this model was sharded on the meta device and its parameters are still uninitialised "
                       "(empty memory). Load its weights first: commfuse_dp.checkpoint.load_hf_weights(model, folder) "
                       "for a Hugging Face folder, or checkpoint.load_sharded(...) to resume; if you initialised them "
                       "yourself, call commfuse_dp.checkpoint.mark_initialised(model)")


def materialise(model: nn.Module, device: torch.device) -> None:
    """Allocate every shard (and buffer) of a sharded meta model on ``device``: ``to_empty`` replaces each meta
    tensor by an uninitialised one of the same (local) shape, so each rank allocates its own shards only (FSDP2's
    ``_apply`` re-pads its sharded parameters; DTensor's ``empty_like`` keeps the local shape). Then the
    non-persistent buffers are recomputed, and a forward is refused until the weights are loaded."""
    model.to_empty(device=device)
    _init_buffers(model)
    handle_of(model, create=True).empty_weights = model.register_forward_pre_hook(_refuse_empty_weights,
                                                                                  prepend=True)


def _init_buffers(model: nn.Module) -> None:
    """Recompute the buffers of a model just taken off the meta device, the way ``from_pretrained`` does
    (transformers 5: ``_move_missing_keys_from_meta_to_device`` then ``initialize_weights``): every parameter is
    flagged ``_is_hf_initialized`` so that transformers' guarded init functions leave it alone, and only the
    buffers (rotary ``inv_freq``, ``position_ids``, norm statistics) get their values. Persistent buffers are
    loaded again with the weights anyway."""
    buffers = [name for name, _ in model.named_buffers()]
    if not buffers:
        return
    initialize = getattr(model, "initialize_weights", None)
    if not callable(initialize) or not hasattr(model, "_init_weights"):
        non_persistent = [name for name, _ in _non_persistent_buffers(model)]
        if non_persistent:
            logger.warning("commfuse_dp.shard: %s is no transformers PreTrainedModel, so its non-persistent buffers "
                           "%s are left uninitialised after leaving the meta device; set them yourself after "
                           "shard() (persistent buffers are loaded with the weights)",
                           type(model).__name__, ", ".join(non_persistent))
        return
    params = list(model.parameters())
    flagged = [p for p in params if not getattr(p, "_is_hf_initialized", False)]
    for p in flagged:
        p._is_hf_initialized = True
    modules_before = {id(m) for m in model.modules() if getattr(m, "_is_hf_initialized", False)}
    try:
        initialize()
        for module in model.modules():  # a scale buffer beside its value (Gemma's embedding, and ours in its place)
            scale = getattr(module, "embed_scale", None)
            if isinstance(scale, torch.Tensor) and isinstance(getattr(module, "scalar_embed_scale", None), float):
                with torch.no_grad():
                    scale.fill_(module.scalar_embed_scale)
    finally:
        for p in flagged:
            del p._is_hf_initialized
        for m in model.modules():
            if id(m) not in modules_before and "_is_hf_initialized" in m.__dict__:
                del m._is_hf_initialized


def _non_persistent_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for module_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if name in module._non_persistent_buffers_set:
                yield f"{module_name}.{name}" if module_name else name, buf
