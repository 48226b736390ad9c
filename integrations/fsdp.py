"""Stock FSDP2 with ring collectives: ``use_ring_collectives(model)`` after ``fully_shard``.

    from torch.distributed.fsdp import fully_shard
    from commfuse_dp.integrations.fsdp import use_ring_collectives

    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    use_ring_collectives(model)        # every FSDPModule now all-gathers / reduce-scatters through rings

Nothing else about the model changes: same DTensor parameters, state dicts, optimizers and numerics (the ring
reduce-scatter sums in ring order, so results differ from the stock collective only by float rounding).
"""

from __future__ import annotations

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from commfuse_dp.config import CommFuseConfig
from commfuse_dp.ring.fsdp_comm import RingAllGather, RingReduceScatter


def use_ring_collectives(model: nn.Module, config: CommFuseConfig | None = None) -> nn.Module:
    """Install ``RingAllGather`` / ``RingReduceScatter`` on every ``FSDPModule`` inside ``model`` (itself
    included) and return ``model``. Raises ``ValueError`` if no module was ``fully_shard``-ed, or if a module
    has several parameter groups (``shard_placement_fn`` with per-parameter meshes), which FSDP2's custom-comm
    hooks cannot serve."""
    config = config if config is not None else CommFuseConfig()
    sharded = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    if not sharded:
        raise ValueError("use_ring_collectives: no module of this model was sharded with fully_shard; call "
                         "fully_shard(...) on its layers and on the root first, then use_ring_collectives(model)")
    for name, module in sharded:
        param_groups = module._get_fsdp_state()._fsdp_param_groups
        if len(param_groups) > 1:
            raise ValueError(
                f"use_ring_collectives: module '{name or '<root>'}' ({type(module).__name__}) has "
                f"{len(param_groups)} parameter groups (per-parameter meshes from shard_placement_fn); FSDP2 can "
                f"install a custom collective only on a module with one group. Shard that module's parameters on "
                f"one mesh, or leave it out of fully_shard's shard_placement_fn.")
    all_gather, reduce_scatter = RingAllGather(config), RingReduceScatter(config)
    for _, module in sharded:
        if module._get_fsdp_state()._fsdp_param_groups:
            module.set_custom_all_gather(all_gather)
            module.set_custom_reduce_scatter(reduce_scatter)
    return model
