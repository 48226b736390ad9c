"""A fused group's local shards are views of one buffer in the ring layout (as FSDP2's sharded parameters are views
of their padded storage), which its rings send without packing a copy. Replacing the parameters' storage after
sharding (``to_empty()`` and loading, ``double()``) must leave the numbers exact: the group packs them again."""

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from commfuse_dp import CommFuseConfig
from commfuse_dp.runtime.engine import Engine
from commfuse_dp.fused import attach_group, convert_linear, step_state
from commfuse_dp.ring import get_ring
from harness import run_ranks

OUTS, IN = (12, 7, 7), 10  # a q/k/v-like group; 7 rows leave padding in the buffer at 2 and 3 ranks


def _one_storage(mods) -> bool:
    return len({m._parameters["weight"].to_local().untyped_storage().data_ptr() for m in mods}) == 1


def _data(rank, step, dtype):
    gen = torch.Generator().manual_seed(100 * step + rank)
    return (torch.randn(4, IN, generator=gen).to(dtype),
            [torch.randn(4, out, generator=gen).to(dtype) for out in OUTS])


def _check_step(rank, world_size, mods, refs, step, dtype, tol):
    for m in (*mods, *refs):
        m.zero_grad(set_to_none=True)
    x, grads = _data(rank, step, dtype)
    outs = [m(x) for m in mods]
    sum((o * g).sum() for o, g in zip(outs, grads)).backward()
    for src in range(world_size):  # unsharded reference on every rank's data; weight gradients: the mean
        xs, gs = _data(src, step, dtype)
        ys = [r(xs) for r in refs]
        sum((y * g).sum() for y, g in zip(ys, gs)).backward()
        if src == rank:
            for o, y in zip(outs, ys):
                torch.testing.assert_close(o, y, rtol=tol, atol=tol)
    for m, r in zip(mods, refs):
        for name in ("weight", "bias"):
            torch.testing.assert_close(getattr(m, name).grad.full_tensor(), getattr(r, name).grad / world_size,
                                       rtol=tol, atol=tol, msg=lambda s: f"{dtype} {name}: {s}")


def _worker(rank, world_size):
    engine = Engine(get_ring(), init_device_mesh("cpu", (world_size,)), CommFuseConfig(schedule="fused"))
    steps = step_state(engine)
    torch.manual_seed(0)
    refs = [nn.Linear(IN, out) for out in OUTS]
    mods = [nn.Linear(IN, out) for out in OUTS]
    for m, r in zip(mods, refs):
        m.load_state_dict(r.state_dict())
        convert_linear(m, engine, False)
    attach_group(steps, mods, ["q", "k", "v"])
    seen = [_one_storage(mods)]  # each shard its own storage until the group's first call
    for step in range(3):  # the first records the layer order, the next ones gather ahead
        _check_step(rank, world_size, mods, refs, step, torch.float32, 1e-5)
    seen.append(_one_storage(mods))
    # A new storage for every parameter, same dtype (as a model materialised from the meta device and loaded):
    # the values halved, so that a ring sending the old buffer would be seen.
    halves = [[p.to_local().detach() * 0.5 for p in m.parameters()] for m in mods]
    with torch.no_grad():
        for m, values in zip(mods, halves):
            m.to_empty(device="cpu")
            for p, value in zip(m.parameters(), values):
                p.to_local().copy_(value)
        for r in refs:
            for p in r.parameters():
                p.mul_(0.5)
    seen.append(_one_storage(mods))
    for step in range(3):
        _check_step(rank, world_size, mods, refs, step, torch.float32, 1e-5)
    seen.append(_one_storage(mods))
    for m in (*mods, *refs):  # again, in another dtype
        m.double()
    seen.append(_one_storage(mods))
    for step in range(3):
        _check_step(rank, world_size, mods, refs, step, torch.float64, 1e-10)
    seen.append(_one_storage(mods))
    return seen


@pytest.mark.parametrize("world_size", [2, 3])
def test_group_shards_are_views_of_one_buffer_and_stay_exact(world_size):
    for seen in run_ranks(_worker, world_size):
        # separate before the first call, one storage after it; separate again after to_empty() and after
        # double(), one after a call
        assert seen == [False, True, False, True, False, True], seen
