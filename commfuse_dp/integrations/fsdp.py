"""Stock FSDP2 with ring collectives: one line, ``use_ring_collectives(model)``, after the model is sharded.

Your own ``fully_shard`` code: add the line after the last ``fully_shard``::

    from torch.distributed.fsdp import fully_shard
    from commfuse_dp.integrations.fsdp import use_ring_collectives

    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    use_ring_collectives(model)        # every FSDP2 unit now all-gathers / reduce-scatters through rings

A model transformers shards at load time (``DistributedConfig``, checked with transformers 5.23; launch with
torchrun): add the line after ``from_pretrained``::

    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(fsdp_size=N))
    use_ring_collectives(model)

``from_pretrained`` starts the process group itself when none exists (gloo on CPU, nccl on CUDA) and applies
FSDP2 with the model's FSDP plan (for a Llama: the embedding and each decoder layer are units, the final norm
and the untied lm_head one unit, kept unsharded between forward and backward). It needs no ``device_map`` or
``dtype``. HSDP (``dp_replicate_size=R``) and ``fsdp_mixed_precision=True`` (bf16 parameters, fp32 reductions)
work as well. ``CommFuseConfig(bucket_mb=..., timeout_s=...)`` as second argument sets the rings' bucket size and
how long a hop waits for a peer before raising ``RingCommError``.

What changes: each FSDP2 unit's all-gather and reduce-scatter (over its shard group; for HSDP the ``fsdp``
dimension) run as rings; on CPU a prefetched all-gather runs on the ring's thread. ``set_gradient_divide_factor``
(FSDP2's ``PREMUL_SUM``, refused by gloo) works: the ring sums and scales. Results equal stock FSDP2's up to
float rounding (the reduce-scatter sums in ring order; with 2 ranks per shard group they are bitwise equal).

What does not change: the parameters (the same DTensor shards), gradients, optimizers (build them before or
after, from ``model.parameters()``), ``state_dict`` / ``torch.distributed.checkpoint``, ``clip_grad_norm_``,
``no_sync`` / ``set_requires_gradient_sync``, and saving: ``model.save_pretrained(dir)`` on every rank gathers
through torch's own collectives and rank 0 writes ordinary safetensors that ``from_pretrained`` loads anywhere.
HSDP's all-reduce across replicas, tensor-parallel DTensors and every DTensor redistribution (``full_tensor``,
the gradient norm) stay torch's collectives. As in stock FSDP2, a forward without backward (``torch.no_grad``)
leaves the units that do not reshard after forward (transformers' norm + lm_head) unsharded until the next
backward, ``model.reshard()`` or ``state_dict()``.

Refused with ``ValueError``, changing nothing: a model with no FSDP2 unit; a unit with several parameter groups
(per-parameter meshes from ``shard_placement_fn``); a unit with another custom collective
(``set_custom_all_gather``, ``set_symm_mem_for_comm``, ...); a model ``commfuse_dp.shard()`` sharded (its units
run on rings already, with its config and statistics). ``commfuse_dp.shard()`` in turn refuses a model FSDP2 or
``DistributedConfig`` sharded. Not tested: CUDA (the ring's NCCL path has not run on a GPU), CPU offload
(``CPUOffloadPolicy`` / ``fsdp_cpu_offload``; on a machine without accelerator FSDP2 itself refuses it),
transformers' expert parallelism.
"""

from __future__ import annotations

import torch.nn as nn

from commfuse_dp.config import CommFuseConfig
from commfuse_dp.integrations.attach import attach
from commfuse_dp.ring.fsdp_comm import RingAllGather, RingReduceScatter

__all__ = ["RingAllGather", "RingReduceScatter", "use_ring_collectives"]


def use_ring_collectives(model: nn.Module, config: CommFuseConfig | None = None, *, overlap: bool = False
                         ) -> nn.Module:
    """Install ``RingAllGather`` / ``RingReduceScatter`` on every FSDP2 unit inside ``model`` and return ``model``:
    :func:`commfuse_dp.integrations.attach.attach` with ``backend="fsdp2"``, which runs
    :func:`commfuse_dp.ring.fsdp_comm.use_ring_collectives` (its checks, ``config`` and ``overlap``: see there)
    and records the attachment on the model."""
    attach(model, config, who="use_ring_collectives", backend="fsdp2", overlap=overlap)
    return model
