"""Stock fully_shard with use_ring_collectives trains like fully_shard with its own collectives."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
from torch.distributed.tensor import Shard

from commfuse_dp import CommFuseConfig
from commfuse_dp.integrations.attach import attachments
from commfuse_dp.integrations.fsdp import use_ring_collectives
from commfuse_dp.ring import RingAllGather, RingReduceScatter, observe_ring
from harness import run_ranks

STEPS = 5


class Block(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.up, self.down, self.norm = nn.Linear(dim, hidden), nn.Linear(hidden, dim), nn.LayerNorm(dim)

    def forward(self, x):
        return self.norm(x + self.down(torch.nn.functional.gelu(self.up(x))))


def _model():
    torch.manual_seed(0)
    # 7 output rows: uneven shards at 2 and 3 ranks (FSDP2 pads inside its buffers).
    return nn.Sequential(Block(16, 40), Block(16, 40), Block(16, 40), nn.Linear(16, 7))


def _sharded(mesh, divide_factor=None, rings=False):
    model = _model()
    for block in model[:3]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if divide_factor is not None:
        for unit in (*model[:3], model):
            unit.set_gradient_divide_factor(divide_factor)
            # FSDP2 then reduces with PREMUL_SUM(1 / factor), which gloo refuses: stock sums, then divides
            unit.set_force_sum_reduction_for_comms(not rings)
    return model


def _train(rank, rings, mesh):
    model = _sharded(mesh)
    if rings:
        use_ring_collectives(model, CommFuseConfig(bucket_mb=1 / 1024, timeout_s=60))  # several buckets per unit
        assert attachments(model) == [("use_ring_collectives", "fsdp2")]  # through the shared attach path, once
        for module in (model, model[0]):
            group = module._get_fsdp_state()._fsdp_param_groups[0]
            assert isinstance(group._all_gather_comm, RingAllGather)
            assert isinstance(group._reduce_scatter_comm, RingReduceScatter)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(100 + rank)  # every rank its own micro-batch
    losses, events = [], []
    with observe_ring(lambda event, op, k: events.append(op)):
        for _ in range(STEPS):
            x, y = torch.randn(32, 16, generator=gen), torch.randn(32, 7, generator=gen)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
    params = {name: p.full_tensor() for name, p in model.named_parameters()}
    return torch.stack(losses), params, events


def _parity_worker(rank, world_size):
    mesh = init_device_mesh("cpu", (world_size,))
    stock_losses, stock_params, stock_events = _train(rank, False, mesh)
    ring_losses, ring_params, ring_events = _train(rank, True, mesh)
    assert not stock_events, "stock FSDP2 must not go through the rings"
    assert ring_events.count("all_gather") and ring_events.count("reduce_scatter"), "the rings were not used"
    torch.testing.assert_close(ring_losses, stock_losses, rtol=1e-5, atol=1e-6)
    for name in stock_params:
        torch.testing.assert_close(ring_params[name], stock_params[name], rtol=1e-5, atol=1e-6, msg=name)
    moved = max((stock_params[n] - p).abs().max().item() for n, p in _model().named_parameters())
    exact = torch.equal(ring_losses, stock_losses) and all(
        torch.equal(ring_params[n], stock_params[n]) for n in stock_params)
    return {"moved": moved, "exact": exact, "ring_events": len(ring_events)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_ring_collectives_train_like_stock_fsdp2(world_size):
    results = run_ranks(_parity_worker, world_size, timeout=180)
    assert results[0]["moved"] > 1e-3, "training did not move the parameters: the comparison would prove nothing"


def _divide_factor_worker(rank, world_size, factor):
    mesh = init_device_mesh("cpu", (world_size,))
    x = torch.randn(32, 16, generator=torch.Generator().manual_seed(100 + rank))
    grads = {}
    for name, divide, rings in (("plain", None, False), ("stock", factor, False), ("rings", factor, True)):
        model = _sharded(mesh, divide, rings)
        events = []
        if rings:
            use_ring_collectives(model, CommFuseConfig(timeout_s=60))
        with observe_ring(lambda event, op, k: events.append(op)):
            model(x).square().mean().backward()
        assert bool(events) == rings
        grads[name] = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    for n, plain in grads["plain"].items():
        torch.testing.assert_close(grads["rings"][n], grads["stock"][n], rtol=1e-5, atol=1e-7, msg=n)
        # plain FSDP2 averages (sum / world_size); with the factor it is sum / factor
        torch.testing.assert_close(grads["rings"][n], plain * (world_size / factor), rtol=1e-5, atol=1e-7, msg=n)
    return True


def test_gradient_divide_factor_premul_sum():
    """set_gradient_divide_factor(f) makes FSDP2 pass ReduceOp.PREMUL_SUM(1/f): the ring sums and scales."""
    run_ranks(_divide_factor_worker, 2, args=(8.0,), timeout=180)


def _refusal_worker(rank, world_size):
    plain = _model()
    try:
        use_ring_collectives(plain)
    except ValueError as err:
        assert "no module of this model was sharded with fully_shard" in str(err)
    else:
        raise AssertionError("an unsharded model was accepted")
    mesh = init_device_mesh("cpu", (world_size,))
    other = FSDPMeshInfo(mesh=DeviceMesh.from_group(dist.new_group(list(range(world_size))), "cpu"),
                         shard_mesh_dim=0)
    model = _model()
    fully_shard(model[0], mesh=mesh,
                shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), other) if p.ndim == 1 else None)
    fully_shard(model, mesh=mesh)
    try:
        use_ring_collectives(model)
    except ValueError as err:
        assert "module '0' (FSDPBlock) has 2 parameter groups" in str(err), str(err)
    else:
        raise AssertionError("a module with several parameter groups was accepted")
    assert attachments(plain) == attachments(model) == []   # a refused model is not recorded as attached
    return True


def test_refuses_what_it_cannot_serve():
    run_ranks(_refusal_worker, 2)
