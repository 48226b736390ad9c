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

from commfuse_dp.ring.fsdp_comm import RingAllGather, RingReduceScatter, use_ring_collectives

__all__ = ["RingAllGather", "RingReduceScatter", "use_ring_collectives"]
