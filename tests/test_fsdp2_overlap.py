"""FSDP2's GPU schedule on the rings (``use_ring_collectives(model, overlap=True)``): exact against DDP, the next
unit's all-gather issued one unit ahead and asynchronously, the reduce-scatters waited for at the backward's end."""

import pytest
import torch
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from commfuse_dp import CommFuseConfig
from commfuse_dp.integrations.fsdp import RingAllGather, RingReduceScatter, use_ring_collectives
from harness import run_ranks
import hf_models

STEPS = 4


def _peer(overlap=True, layers=3):
    model = hf_models.build("llama", num_hidden_layers=layers)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return use_ring_collectives(model, CommFuseConfig(timeout_s=60, bucket_mb=1 / 256), overlap=overlap)


def _train(model, rank, accumulate):
    """``accumulate``: two backwards per step, the first one's gradient kept in ``.grad`` (FSDP2 then adds the
    second reduce-scatter's output to it: the reduce-scatter must be complete when it returns)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        for micro in range(2 if accumulate else 1):
            loss = model(**hf_models.batch(rank, step, micro)).loss
            loss.backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
    params = {name.removeprefix("module."): (p.full_tensor() if hasattr(p, "full_tensor") else p.detach())
              for name, p in model.named_parameters()}
    return torch.stack(losses), params


def _parity_worker(rank, world_size, accumulate):
    ddp_losses, ddp_params = _train(DistributedDataParallel(hf_models.build("llama", num_hidden_layers=3)), rank,
                                    accumulate)
    losses, params = _train(_peer(), rank, accumulate)
    torch.testing.assert_close(losses, ddp_losses, rtol=0, atol=1e-5)
    for name, p in ddp_params.items():
        torch.testing.assert_close(params[name], p, rtol=0, atol=1e-5, msg=name)
    start = hf_models.build("llama", num_hidden_layers=3)
    return max((ddp_params[n] - p.detach()).abs().max().item() for n, p in start.named_parameters())


@pytest.mark.parametrize("world_size,accumulate", [(2, False), (3, False), (2, True)])
def test_overlapping_peer_trains_like_ddp(world_size, accumulate):
    moved = run_ranks(_parity_worker, world_size, args=(accumulate,), timeout=240)
    assert moved[0] > 1e-3, "training did not move the parameters: the comparison would prove nothing"


def _schedule_worker(rank, world_size, overlap):
    model = _peer(overlap)
    layers = list(model.model.layers)
    events = []
    for unit in (model, *layers):
        group = unit._get_fsdp_state()._fsdp_param_groups[0]
        gather, scatter = group._all_gather_comm, group._reduce_scatter_comm
        assert isinstance(gather, RingAllGather) and isinstance(scatter, RingReduceScatter)
        name = "root" if unit is model else f"layer{layers.index(unit)}"

        def gathering(self, *args, _call=type(gather).__call__, _name=name, **kwargs):
            work = _call(self, *args, **kwargs)
            events.append(("gather", _name, work is not None))  # issued (asynchronously: a Work to wait for)
            return work

        gather.__class__ = type("Recorded", (RingAllGather,), {"__call__": gathering})
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: events.append(("forward", f"layer{i}", None)))
        layer.register_full_backward_pre_hook(
            lambda m, g, i=i: events.append(("backward", f"layer{i}", len(deferred.pending) if deferred else 0)))
    deferred = model._commfuse_deferred_reductions
    model(**hf_models.batch(rank, 0)).loss.backward()
    left = len(deferred.pending) if deferred else 0
    return events, left


def test_schedule_gathers_one_unit_ahead_and_defers_reduce_scatters():
    events, left = run_ranks(_schedule_worker, 2, args=(True,), timeout=120)[0]
    # Forward: the root's pre-forward gathers the root and prefetches layer0; each layer's pre-forward prefetches
    # the next layer before the layer computes (the hook "forward" runs after FSDP2's pre-forward). Every gather
    # is asynchronous (a Work); the root's is waited for at once, as nothing computes before it.
    # Backward: the root's pre-backward prefetches layer2, each layer's the one before it.
    assert events == [
        ("gather", "root", True), ("gather", "layer0", True), ("gather", "layer1", True), ("forward", "layer0", None),
        ("gather", "layer2", True), ("forward", "layer1", None), ("forward", "layer2", None),
        ("gather", "layer2", True), ("backward", "layer2", 0), ("gather", "layer1", True), ("backward", "layer1", 1),
        ("gather", "layer0", True), ("backward", "layer0", 2)], events
    # (the last field of "backward": reduce-scatters issued and still deferred when that layer's backward began)
    assert left == 0, "backward() returned with reduce-scatters still pending"
    # Without overlap (stock FSDP2 on CPU): each layer is gathered at its own pre-forward and waited for at once
    events, left = run_ranks(_schedule_worker, 2, args=(False,), timeout=120)[0]
    assert events[:7] == [
        ("gather", "root", False), ("gather", "layer0", False), ("forward", "layer0", None),
        ("gather", "layer1", False), ("forward", "layer1", None), ("gather", "layer2", False),
        ("forward", "layer2", None)], events
    assert all(e[2] == 0 for e in events if e[0] == "backward"), events
